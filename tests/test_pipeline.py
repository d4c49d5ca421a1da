"""Pipeline parallelism: stage plans, bad-input errors, per-stage init, and loss parity of every schedule (gloo)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from meshloom.config.loader import ConfigError, load_config
from meshloom.models.registry import get_model_args, get_model_spec
from meshloom.parallel.apply import carve_stage
from meshloom.parallel.pipeline import SCHEDULES
from meshloom.planning.run_plan import RunPlan
from meshloom.testing.layout_parity import BF16_TOLERANCE, FP32_TOLERANCE, compare
from meshloom.testing.resume_parity import Case, launch, run_case
from meshloom.train.model_setup import build_model, build_pipeline_stages
from meshloom.train.optim import OptimizerGroup


def run_plan(*overrides: str, n_layers: int = 4, pp: int = 2, dp_shard: int = 1, flavor: str = "tiny") -> RunPlan:
    config = load_config([
        "--model.flavor", flavor, "--model.n_layers", str(n_layers), "--training.local_batch_size", "8",
        "--parallelism.pp", str(pp), "--parallelism.dp_shard", str(dp_shard), *overrides,
    ])  # fmt: skip
    return RunPlan.build(config, world_size=pp * dp_shard)


def plan(*overrides: str, **kwargs):
    return run_plan(*overrides, **kwargs).pipeline


# --------------------------------------------------------------------------- plans


def test_even_split_gives_leftover_layers_to_middle_stages_first():
    assert plan(n_layers=4).stage_layers == ((0, 1), (2, 3))
    assert plan(n_layers=5).stage_layers == ((0, 1, 2), (3, 4))
    assert plan("--pipeline.schedule", "Interleaved1F1B", n_layers=6).stage_layers == ((0,), (1, 2), (3, 4), (5,))


def test_split_points_by_index_or_name_make_uneven_stages():
    p = plan("--pipeline.split_points", "1", n_layers=4)
    assert p.stage_layers == ((0,), (1, 2, 3))
    p = plan("--pipeline.schedule", "LoopedBFS", "--pipeline.split_points", "layers.1, 3,layers.5", n_layers=6)
    assert p.stage_layers == ((0,), (1, 2), (3, 4), (5,))
    # A first stage may hold the embedding alone.
    assert plan("--pipeline.split_points", "layers.0", n_layers=2).stage_layers == ((), (0, 1))


def test_stage_placement_is_looped_or_v_shaped():
    looped = plan("--pipeline.schedule", "Interleaved1F1B", n_layers=8, pp=4)
    assert [looped.stages_of(r) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    v = plan("--pipeline.schedule", "ZBVZeroBubble", n_layers=8, pp=4)
    assert [v.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert plan("--pipeline.schedule", "1F1B").stages_of(1) == [1]


def test_defaults_microbatches_and_stages_per_rank():
    p = plan()
    assert (p.schedule, p.microbatches, p.stages_per_rank, p.num_stages) == ("1F1B", 8, 1, 2)
    assert plan("--pipeline.schedule", "DualPipeV", "--pipeline.microbatches", "4").stages_per_rank == 2
    assert set(SCHEDULES) == {"GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "overrides, n_layers, message",
    [
        # a layer count that cannot be split as asked
        (["--pipeline.schedule", "Interleaved1F1B"], 3, "cannot be split into pp x stages_per_rank = 2 x 2 = 4 stages"),
        (["--pipeline.split_points", "1,2"], 4, "has 2 entries but pp x stages_per_rank = 2 x 1 = 2 stages need 1"),
        (["--pipeline.schedule", "LoopedBFS", "--pipeline.split_points", "2,1,3"], 4, "must be strictly increasing"),
        # microbatches fewer than stages where the schedule needs more
        (["--pipeline.microbatches", "1"], 4, "1F1B needs at least as many microbatches as stages"),
        (["--pipeline.schedule", "DualPipeV", "--pipeline.microbatches", "2"], 4, "pipeline.microbatches=2 < 4 stages"),
        (["--pipeline.schedule", "Interleaved1F1B", "--pipeline.microbatches", "5", "--training.local_batch_size", "5"], 4, "must be a multiple of 2"),
        (["--pipeline.microbatches", "3"], 4, "pipeline.microbatches=3 does not divide training.local_batch_size=8"),
        # a split point that names no layer
        (["--pipeline.split_points", "layers.4"], 4, "'layers.4' names no layer; the model has layers 0 .. 3"),
        (["--pipeline.split_points", "output"], 4, "'output' names no layer"),
        # a V schedule (or a single-stage one) with the wrong number of stages per rank
        (["--pipeline.schedule", "ZBVZeroBubble", "--pipeline.stages_per_rank", "1"], 4, "needs a V of exactly 2 stages per rank"),
        (["--pipeline.schedule", "DualPipeV", "--pipeline.stages_per_rank", "3"], 6, "stages_per_rank=3; set pipeline.stages_per_rank = 2"),
        (["--pipeline.schedule", "GPipe", "--pipeline.stages_per_rank", "2"], 4, "needs exactly 1 stage per rank"),
    ],
)
def test_bad_pipeline_settings_name_the_setting_and_fix(overrides, n_layers, message):
    with pytest.raises(ConfigError) as err:
        plan(*overrides, n_layers=n_layers)
    assert message in str(err.value)


def test_negative_pipeline_counts_are_rejected_at_load():
    with pytest.raises(ConfigError, match="pipeline.microbatches must be >= 0"):
        load_config(["--pipeline.microbatches", "-1"])
    with pytest.raises(ConfigError, match="model.n_layers must be >= 0"):
        load_config(["--model.n_layers", "-2"])


def test_tied_embeddings_cannot_be_pipelined():
    with pytest.raises(ConfigError, match="ties its output projection to the embedding"):
        plan(flavor="1B", n_layers=4)


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_zero_bubble_schedules_keep_fsdp_parameters_gathered(schedule):
    """Resharding between forward and the weight-gradient pass gives silently wrong gradients in torch 2.13."""
    assert plan("--pipeline.schedule", schedule, "--pipeline.microbatches", "4", dp_shard=2).fsdp_reshard_after_forward == "never"
    with pytest.raises(ConfigError, match="fsdp_reshard_after_forward = default"):
        plan("--pipeline.schedule", schedule, "--pipeline.microbatches", "4", "--parallelism.fsdp_reshard_after_forward", "always", dp_shard=2)
    # Without FSDP there is nothing to reshard: the setting is refused as idle. Other schedules keep the user's choice.
    with pytest.raises(ConfigError, match=r"^parallelism.fsdp_reshard_after_forward = 'always' has no effect"):
        plan("--pipeline.schedule", schedule, "--pipeline.microbatches", "4", "--parallelism.fsdp_reshard_after_forward", "always")
    assert plan("--parallelism.fsdp_reshard_after_forward", "always", dp_shard=2).fsdp_reshard_after_forward == "always"


# --------------------------------------------------------------------------- stages


def owners(module: torch.nn.Module) -> set[str]:
    """Top-level parts holding parameters: "tok_embeddings", "layers.3", "norm", "output"."""
    return {".".join(name.split(".")[:2]) if name.startswith("layers.") else name.split(".")[0] for name, _ in module.named_parameters()}


def test_carved_stages_hold_only_their_layers():
    spec = get_model_spec("llama3")
    args = dataclasses.replace(get_model_args("llama3", "tiny"), n_layers=4)
    with torch.device("meta"):
        first = carve_stage(spec.model_cls(args), spec.parallel, (0,), True, False)
        middle = carve_stage(spec.model_cls(args), spec.parallel, (1, 2), False, False)
        last = carve_stage(spec.model_cls(args), spec.parallel, (3,), False, True)
    assert owners(first) == {"tok_embeddings", "layers.0"}
    assert owners(middle) == {"layers.1", "layers.2"}
    assert owners(last) == {"layers.3", "norm", "output"}


def test_stage_weights_equal_the_one_process_model():
    p = run_plan("--training.seed", "3", "--pipeline.schedule", "Interleaved1F1B")
    whole_model = build_model(p, torch.device("cpu"), bare=True)
    whole = dict(whole_model.named_parameters())
    stages = build_pipeline_stages(p, torch.device("cpu"), [0, 1, 2, 3])
    seen = set()
    for stage in stages:
        for name, param in stage.named_parameters():
            torch.testing.assert_close(param, whole[name], rtol=0, atol=0)
            seen.add(name)
        assert torch.equal(stage.rope_cos, whole_model.rope_cos)
    assert seen == set(whole)


def test_sharded_stage_init_is_deterministic_and_differs_between_stages():
    p = run_plan("--parallelism.init", "sharded")
    first, second = (build_pipeline_stages(p, torch.device("cpu"), [0, 1]) for _ in range(2))
    for a, b in zip(first, second):
        for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
            assert torch.equal(x, y), name
    wq = lambda stage, layer: stage.layers[str(layer)].attention.wq.weight
    assert not torch.equal(wq(first[0], 0), wq(first[1], 2))


# --------------------------------------------------------------------------- parity (gloo)

SCHEDULE_NAMES = list(SCHEDULES)
PP2_LAYOUTS = (
    # Every schedule with one stage per rank (the V schedules need two)...
    [f"pp=2,pipeline.schedule={s},pipeline.stages_per_rank=1" for s in SCHEDULE_NAMES if not SCHEDULES[s].v_shaped]
    # ...and the interleaved and V schedules with two.
    + [f"pp=2,pipeline.schedule={s},pipeline.stages_per_rank=2" for s in SCHEDULE_NAMES if SCHEDULES[s].multi_stage]
    # Gradient accumulation (2 steps) around 2 microbatches: nothing may be scaled twice.
    + ["pp=2,training.local_batch_size=4,pipeline.microbatches=2"]
    # bf16 autocast in every stage (compared with the bf16 bound).
    + ["pp=2,mixed_precision=bf16"]
)
MULTI_D_LAYOUTS = [
    "pp=4",  # one layer per stage
    "pp=2,dp_shard=2",
    "pp=2,dp_replicate=2",
    "pp=2,tp=2",
    # Two blocks per stage, so default FSDP would reshard the first between forward and the weight-gradient pass.
    "pp=2,dp_shard=2,pipeline.schedule=InterleavedZeroBubble,pipeline.stages_per_rank=1",
    # Two microbatches, not one per sequence: 8 ranks share 2 cores here, and each microbatch costs every rank the
    # same fixed dispatch overhead whatever its size (the schedules are the 2-rank cases above).
    "pp=2,dp_shard=2,tp=2,pipeline.microbatches=2",
]


@pytest.fixture(scope="module")
def parity_dir(tmp_path_factory):
    """Shared by the parity tests, so the tokenizer and token caches are built once."""
    os.environ.pop("WORLD_SIZE", None)  # the references run in this process
    return tmp_path_factory.mktemp("pipeline-parity")


def test_every_schedule_and_3d_layout_matches_one_process(parity_dir):
    """Per-step losses, the last gradient norm and the held-out loss after 6 steps, against one fp32 process.

    Four layers, so that two stages per rank (and pp=4) fit; one launch per world size (2, 4 and 8 ranks).
    """
    reference, comparisons = compare(
        PP2_LAYOUTS + MULTI_D_LAYOUTS, steps=6, workdir=parity_dir, common="model.n_layers=4,validation.enable=true,data.validation_fraction=0.2"
    )
    assert reference.validation is not None
    report = "\n".join(
        f"{c.layout.spec}: max |dloss| {c.max_loss_diff:.2e}, |dgrad_norm| {c.grad_norm_diff:.2e}, "
        f"|dval| {abs(c.curve.validation - reference.validation):.2e}"
        for c in comparisons
    )
    print(report)
    for c in comparisons:
        assert c.layout.tolerance == (BF16_TOLERANCE if "bf16" in c.layout.spec else FP32_TOLERANCE)
        assert c.max_loss_diff <= c.layout.tolerance and c.grad_norm_diff <= c.layout.tolerance, report
        # Validation batches are local_batch_size sequences: a layout that changes it evaluates other samples.
        if "training.local_batch_size" not in c.layout.settings:
            assert abs(c.curve.validation - reference.validation) <= c.layout.tolerance, report
    # bf16 must really change the numbers, or its bound proves nothing.
    assert min(c.max_loss_diff for c in comparisons if "bf16" in c.layout.spec) > 10 * FP32_TOLERANCE, report


def test_document_masks_reach_every_stage(parity_dir):
    """With data.document_mask every stage's attention needs the document ids, also across a V schedule."""
    layouts = ["pp=2,pipeline.schedule=ZBVZeroBubble"]
    common = "model.n_layers=4,data.document_mask=true"
    reference, (c,) = compare(layouts, steps=6, workdir=parity_dir, common=common)
    assert c.max_loss_diff <= FP32_TOLERANCE and c.grad_norm_diff <= FP32_TOLERANCE, (reference.losses, c.curve.losses)


# --------------------------------------------------------------------------- checkpoints


def test_optimizer_group_steps_all_and_its_scheduler_drives_every_learning_rate():
    parts = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    optimizers = [torch.optim.AdamW(part.parameters(), lr=1.0) for part in parts]
    group = OptimizerGroup(optimizers)
    scheduler = torch.optim.lr_scheduler.LambdaLR(group, lambda step: 0.5**step)
    before = [part.weight.detach().clone() for part in parts]
    sum(part(torch.ones(1, 2)).sum() for part in parts).backward()
    group.step()
    assert all(not torch.equal(b, part.weight) for b, part in zip(before, parts))
    # Loading a state dict gives an optimizer new group dicts; the scheduler must still reach them.
    optimizers[1].load_state_dict(optimizers[1].state_dict())
    scheduler.step()
    assert [o.param_groups[0]["lr"] for o in optimizers] == [0.5, 0.5]
    group.zero_grad()
    assert all(p.grad is None for part in parts for p in part.parameters())

SAVE = ["--checkpoint.enable", "true", "--checkpoint.interval", "5"]
RESUME = SAVE + ["--checkpoint.resume", "true"]


def test_checkpoints_move_between_pipeline_and_one_process(tmp_path, data_cache):
    """Stages save under the model's own parameter names, so a checkpoint resumes under any layout, pp included."""
    os.environ.pop("WORLD_SIZE", None)
    w = tmp_path
    (w / "cache").symlink_to(data_cache)
    reference = run_case(Case("ref", str(w / "ref")), w).losses
    one_stop = run_case(Case("one_stop", str(w / "one"), stop_after=5, overrides=SAVE), w)
    cases = [
        Case("pp_stop", str(w / "pp"), "pp=2", stop_after=5, overrides=SAVE),
        Case("one_to_pp", str(w / "one"), "pp=2,pipeline.schedule=GPipe", overrides=RESUME),
    ]
    runs = launch(cases, w)
    pp_to_one = run_case(Case("pp_to_one", str(w / "pp"), overrides=RESUME), w)
    for name, losses, expected in [
        ("1 process, steps 1-5", one_stop.losses, reference[:5]),
        ("pp=2, steps 1-5", runs["pp_stop"].losses, reference[:5]),
        ("1 process -> pp=2, steps 6-10", runs["one_to_pp"].losses, reference[5:]),
        ("pp=2 -> 1 process, steps 6-10", pp_to_one.losses, reference[5:]),
    ]:
        assert len(losses) == len(expected) and max(abs(a - b) for a, b in zip(losses, expected)) <= FP32_TOLERANCE, name
