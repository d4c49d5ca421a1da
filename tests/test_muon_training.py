"""Muon through the real Trainer: QK-clip on and off under every layout, bitwise resume and resharding, and the memory
estimate of Muon's state against the real optimizer's. (Muon's loss parity under each layout, dense and MoE, is the
pairwise matrix's: tests/test_matrix.py.)

All runs are fp32 training of the `tiny` model (the parity harness's settings) with optimizer.name = Muon. The layouts
of one world size share one launch (testing/ranks.py): 2 ranks (QK-clip cases), 4 ranks, and 2 ranks for the resume
cases.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshloom.config.errors import ConfigError
from meshloom.config.loader import load_config
from meshloom.models.common.qk_clip import clip_factors, head_max_logits
from meshloom.models.llama3 import SPEC, Transformer
from meshloom.models.registry import get_model_args, get_model_spec
from meshloom.planning.dry_run import _build_rank0, dry_run
from meshloom.planning.layout import layout_of, precision_from_config
from meshloom.planning.memory_estimate import estimate_memory
from meshloom.planning.run_plan import RunPlan
from meshloom.testing.layout_parity import (
    FP32_TOLERANCE, ParityCase, base_overrides, clip_mismatches,
)  # fmt: skip
from meshloom.testing.ranks import run_ranks
from meshloom.testing.resume_parity import Case, launch, run_case
from meshloom.train.muon import MuonAdamW, optimizer_state_elements, parameter_kinds
from meshloom.train.qk_clip import QKClip
from meshloom.train.trainer import Trainer


# Newton-Schulz rounds every update to bf16, so the last-bit gradient differences between layouts come back as rounding
# flips; at the harness's learning rate (1e-2) Muon's curves already sit within 0.3-0.9 of the fp32 tolerance, so the
# QK-clip runs use half of it. Their tau clips most of the tiny model's 16 heads at every step (its largest logits
# start near 0.15).
CLIP_LR = 5e-3
TAU = 0.01
CLIP_LAYOUTS = ["tp=2", "dp_shard=2", "pp=2", "cp=2", "dp_shard=2,tp=2"]
STEPS = 10


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def _argv(workdir: Path, name: str, layout: str, tau: float) -> list[str]:
    overrides = ParityCase.parse(layout).overrides() if layout else []
    return base_overrides(STEPS, workdir) + [
        "--optimizer.name", "Muon", "--optimizer.lr", str(CLIP_LR), "--optimizer.qk_clip_threshold", str(tau),
        "--job.dump_folder", str(workdir / name),
    ] + overrides  # fmt: skip


def _train(argv: list[str]) -> tuple[dict, Trainer]:
    """Losses, gradient norms and clipped heads (in all, and which at each step) of a run in this process (alone, or
    one rank of a launch)."""
    trainer = Trainer(load_config(argv))
    results, clipped, near = [], [], []
    for _ in range(STEPS):
        results.append(trainer.train_step())
        clipped.append([list(head) for head in trainer.qk_clip.clipped])
        near.append([list(head) for head in trainer.qk_clip.near_tau])
    curve = {"losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results],
             "clipped_heads": trainer.qk_clip.total_clipped_heads, "clipped": clipped, "near_tau": near}  # fmt: skip
    return curve, trainer


def _clip_worker(cases_file: Path, out_file: Path) -> None:
    from meshloom.parallel.distributed import rank, shutdown_and_exit

    results = {name: _train(argv)[0] for name, argv in json.loads(cases_file.read_text()).items()}
    if rank() == 0:
        out_file.write_text(json.dumps(results))
    shutdown_and_exit(0)


@pytest.fixture(scope="module")
def clip_runs(tmp_path_factory):
    """The QK-clip references (on and off) in this process, then the clipped layouts, one launch per world size."""
    workdir = tmp_path_factory.mktemp("muon_clip")
    os.environ.pop("WORLD_SIZE", None)
    reference, trainer = _train(_argv(workdir, "reference", "", TAU))
    no_clip, _ = _train(_argv(workdir, "no_clip", "", 0.0))
    curves = {}
    for world in sorted({ParityCase.parse(layout).world_size for layout in CLIP_LAYOUTS}):
        layouts = [layout for layout in CLIP_LAYOUTS if ParityCase.parse(layout).world_size == world]
        cases = {layout: _argv(workdir, f"run_{i}_{world}", layout, TAU) for i, layout in enumerate(layouts)}
        cases_file, curves_file = workdir / f"cases_{world}.json", workdir / f"curves_{world}.json"
        cases_file.write_text(json.dumps(cases))
        run_ranks(_clip_worker, world, cases_file, curves_file)
        curves.update(json.loads(curves_file.read_text()))
    for layout, curve in curves.items():
        print(f"QK-clip {layout:<10} max |dloss| {_max_diff(curve['losses'], reference['losses']):.2e} "
              f"clipped heads {curve['clipped_heads']} (1 process: {reference['clipped_heads']})")
    return reference, trainer, curves, no_clip


def test_moe_experts_are_muon_matrices_and_the_router_stays_on_adamw():
    spec = get_model_spec("qwen3")
    kinds = parameter_kinds(spec.model_cls(get_model_args("qwen3", "tiny_moe")), spec.adamw_only)
    assert {kinds[f"layers.0.moe.experts.w{i}"] for i in (1, 2, 3)} == {"muon"}
    assert kinds["layers.0.moe.router.weight"] == kinds["tok_embeddings.weight"] == "adamw"


@pytest.mark.parametrize("layout", CLIP_LAYOUTS)
def test_qk_clip_layout_matches_one_process(clip_runs, layout):
    reference, _, curves, _ = clip_runs
    curve = curves[layout]
    # The same heads were clipped at every step as in one process (gathered over pipeline stages), except any whose
    # largest logit lay within rounding of tau in either run ...
    assert reference["clipped_heads"] > STEPS
    assert not clip_mismatches(curve["clipped"], reference["clipped"], curve["near_tau"], reference["near_tau"]), layout
    assert _max_diff(curve["losses"], reference["losses"]) <= FP32_TOLERANCE, (layout, reference, curve)
    assert abs(curve["grad_norms"][-1] - reference["grad_norms"][-1]) <= FP32_TOLERANCE


def test_qk_clip_changes_training_and_counts_heads(clip_runs):
    reference, trainer, _, no_clip = clip_runs
    assert isinstance(trainer.optimizer, MuonAdamW)
    assert reference["clipped_heads"] == trainer.qk_clip.total_clipped_heads > STEPS
    assert no_clip["clipped_heads"] == 0
    assert trainer.qk_clip.metrics() == {"qk_clipped_heads": float(trainer.qk_clip.clipped_heads)}
    # The clip moved the losses by more than the parity tolerance (the tiny model's attention still matters little).
    assert _max_diff(reference["losses"], no_clip["losses"]) > FP32_TOLERANCE


def test_muon_state_bytes_equal_the_estimate_in_one_process(clip_runs):
    _, trainer, _, _ = clip_runs
    state = [t for s in trainer.optimizer.state.values() for t in s.values() if t.ndim > 0]
    measured = sum(t.numel() * t.element_size() for t in state)
    plan = trainer.plan
    seq_len, precision = plan.config.training.seq_len, precision_from_config(plan.config)
    estimate = estimate_memory(plan.shape(), layout_of(plan), seq_len, precision, optimizer="Muon")
    assert measured == estimate.optimizer
    adamw = estimate_memory(plan.shape(), layout_of(plan), seq_len, precision, optimizer="AdamW")
    assert adamw.optimizer == 2 * adamw.params > estimate.optimizer  # AdamW's figure is unchanged


# --------------------------------------------------------------------------- resume


SAVE = ["--optimizer.name", "Muon", "--checkpoint.enable", "true", "--checkpoint.interval", "5"]
RESUME = SAVE + ["--checkpoint.resume", "true"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, data_cache):
    w = tmp_path_factory.mktemp("muon_resume")
    (w / "cache").symlink_to(data_cache)
    os.environ.pop("WORLD_SIZE", None)
    out = {}
    for case in (
        Case("ref", str(w / "ref"), overrides=["--optimizer.name", "Muon"]),
        Case("1proc_stop", str(w / "1proc"), stop_after=5, overrides=SAVE),
        Case("1proc_resume", str(w / "1proc"), overrides=RESUME),
    ):
        out[case.name] = run_case(case, w)
    out.update(launch([
        Case("fsdp2_ref", str(w / "fsdp2_ref"), "dp_shard=2", overrides=["--optimizer.name", "Muon"]),
        Case("fsdp2_stop", str(w / "fsdp2"), "dp_shard=2", stop_after=5, overrides=SAVE),
        Case("fsdp2_resume", str(w / "fsdp2"), "dp_shard=2", overrides=RESUME),
        Case("reshard_stop", str(w / "reshard"), "dp_shard=2", stop_after=5, overrides=SAVE),
    ], w))  # fmt: skip
    out["reshard_resume"] = run_case(Case("reshard_resume", str(w / "reshard"), overrides=RESUME), w)
    return out


@pytest.mark.parametrize("layout", ["1proc", "fsdp2"])
def test_muon_stop_and_resume_is_bitwise_equal_to_training_straight(resumed, layout):
    straight = resumed["ref"] if layout == "1proc" else resumed[f"{layout}_ref"]
    stop, resume = resumed[f"{layout}_stop"], resumed[f"{layout}_resume"]
    assert len(straight.losses) == STEPS
    assert stop.losses == straight.losses[:5] and resume.losses == straight.losses[5:]
    assert resume.final_state and resume.final_state == straight.final_state
    assert any(key.endswith("momentum_buffer") for key in straight.final_state)  # Muon's state was compared too
    assert any(key.endswith("exp_avg_sq") for key in straight.final_state)  # and AdamW's
    assert stop.final_state != straight.final_state


def test_muon_checkpoint_of_fsdp2_resumes_in_one_process(resumed):
    reference = resumed["ref"].losses
    assert _max_diff(resumed["reshard_stop"].losses, reference[:5]) <= FP32_TOLERANCE
    assert _max_diff(resumed["reshard_resume"].losses, reference[5:]) <= FP32_TOLERANCE


# --------------------------------------------------------------------------- in-process units


def test_muon_state_bytes_of_fsdp2_shards_equal_the_estimate_and_the_dry_run():
    """Rank 0 of FSDP 2 built on meta over the fake process group (as the dry run does): its real shard shapes and
    Muon/AdamW split give the optimizer state the estimator and the dry run report."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    config = load_config(["--model.flavor", "tiny", "--optimizer.name", "Muon", "--training.seq_len", "64"])
    plan = RunPlan.build(config, 2)
    dist.init_process_group(backend="fake", store=FakeStore(), rank=0, world_size=2)
    try:
        plan.dims.build_mesh("cpu")
        (model,) = _build_rank0(plan)
        kinds = parameter_kinds(model, SPEC.adamw_only)
        named = list(model.named_parameters())
        shapes = [tuple(p.to_local().shape) for _, p in named]
        elements = optimizer_state_elements(shapes, [kinds[n] for n, _ in named])
    finally:
        dist.destroy_process_group()
    estimate = estimate_memory(plan.shape(), layout_of(plan), 64, precision_from_config(config), optimizer="Muon")
    assert 4 * elements == estimate.optimizer
    report = dry_run(config, 2)
    assert report.memory.optimizer == estimate.optimizer and "dp_shard=2" in report.layout


def test_head_max_logits_equals_the_largest_visible_score():
    torch.manual_seed(0)
    b, hq, hkv, s, d = 2, 6, 3, 9, 4
    q, k = torch.randn(b, hq, s, d), torch.randn(b, hkv, s, d)
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0] * 9])
    full = q @ k.repeat_interleave(hq // hkv, dim=1).transpose(-1, -2) / d**0.5  # [b, hq, s, s]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    assert torch.allclose(head_max_logits(q, k), full.masked_fill(~causal, -torch.inf).amax(dim=(0, 2, 3)))
    visible = causal & (documents[:, :, None] == documents[:, None, :])
    expected = full.masked_fill(~visible[:, None], -torch.inf).amax(dim=(0, 2, 3))
    assert torch.allclose(head_max_logits(q, k, documents), expected)
    assert not torch.allclose(expected, full.amax(dim=(0, 2, 3)))  # the mask matters for these inputs


def test_clip_factors_split_a_head_evenly_and_cap_every_head_of_a_group():
    tau = 2.0
    # One query head per kv head: Kimi K2's rule, sqrt(tau / max) on both sides, untouched below tau.
    q, k = clip_factors(torch.tensor([8.0, 1.0, 2.0]), tau, n_kv_heads=3)
    assert torch.allclose(q, torch.tensor([0.5, 1, 1])) and torch.allclose(k, torch.tensor([0.5, 1, 1]))
    # Groups of three: the shared k takes sqrt of the group's worst head; each query head is then capped alone.
    maxima = torch.tensor([8.0, 1.0, 6.0, 1.5, 0.5, 1.0])
    q, k = clip_factors(maxima, tau, n_kv_heads=2)
    assert torch.allclose(k, torch.tensor([0.5, 1.0]))
    after = maxima * q * k.repeat_interleave(3)
    assert (after <= tau + 1e-6).all() and torch.allclose(after[0], torch.tensor(tau))
    assert torch.allclose(q[1:3], torch.tensor([1.0, 2 / 3])) and torch.equal(q[3:], torch.ones(3))


def test_clipped_weights_cap_the_next_forward_at_tau():
    args = dataclasses.replace(get_model_args("llama3", "tiny"), n_layers=2)
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():  # large logits, as a long Muon run would grow them
        for block in model.layers.values():
            block.attention.wq.weight.mul_(20)
    clip = QKClip.build(SPEC, [model], tau=3.0, dims=None)
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    model(tokens)
    before = torch.cat([t.attention.max_logits for t in clip.targets])
    assert clip.after_update() == int((before > 3.0).sum()) > 0
    assert all(t.attention.max_logits is None for t in clip.targets)
    model(tokens)
    after = torch.cat([t.attention.max_logits for t in clip.targets])
    # Every head ends at most at tau, the worst head of each clipped kv group exactly at it.
    assert after.max() <= 3.0 * (1 + 1e-5) and after.max() >= 3.0 * (1 - 1e-5)
    group = args.n_heads // args.kv_heads
    groups_before, groups_after = before.view(-1, group), after.view(-1, group)
    clipped = groups_before.amax(dim=1) > 3.0
    assert torch.allclose(groups_after[clipped].amax(dim=1), torch.tensor(3.0))
    assert torch.allclose(groups_after[~clipped], groups_before[~clipped])  # groups below tau keep their weights
    model.eval()  # evaluation forwards are not tracked
    clip.discard()
    model(tokens)
    assert all(t.attention.max_logits is None for t in clip.targets)


def test_qk_clip_is_refused_where_it_cannot_work():
    with pytest.raises(ConfigError, match=r"optimizer.qk_clip_threshold must be >= 0"):
        load_config(["--optimizer.qk_clip_threshold", "-1"])
    toy = ["--model.plugin", "tests.toy_family", "--model.name", "toy", "--model.flavor", "tiny"]
    toy += ["--optimizer.qk_clip_threshold", "50"]
    with pytest.raises(ConfigError, match=r"^optimizer.qk_clip_threshold > 0 \(QK-clip\) with toy tiny .*this model family does not offer it \(its attention does not factor per head\); set optimizer.qk_clip_threshold = 0$"):
        RunPlan.build(load_config(toy), 1)
    qwen3 = ["--model.name", "qwen3", "--model.flavor", "tiny", "--optimizer.qk_clip_threshold", "50"]
    with pytest.raises(ConfigError, match=r"with qwen3 tiny .*this model family does not offer it \(its QK-norm RMS-normalises"):
        RunPlan.build(load_config(qwen3), 1)
    for name in ("llama3", "deepseek_v3"):  # context parallel takes the maxima over cp
        cp = ["--model.name", name, "--model.flavor", "tiny", "--optimizer.qk_clip_threshold", "50",
              "--parallelism.cp", "2", "--training.seq_len", "64"]  # fmt: skip
        RunPlan.build(load_config(cp), 2)
    RunPlan.build(load_config(["--optimizer.qk_clip_threshold", "50", "--parallelism.tp", "2"]), 2)  # llama3: fine
