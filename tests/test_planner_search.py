"""`meshloom plan`'s search: what it tries (ep, AC, Muon, Float8, schedules, accumulation), that every layout it
reports is RunPlan's, per-stage estimates with split points, one-line errors, and the 671B plan on 1,024 GPUs."""

from __future__ import annotations

import dataclasses
import re
import time

import pytest

from cli_checks import one_line_error
from meshloom.config.errors import UserError
from meshloom.config.loader import load_config
from meshloom.models.registry import get_model_args, get_model_spec
from meshloom.planning.layout import Layout, Precision, layout_config, layout_of
from meshloom.planning.memory_estimate import GIB, estimate_memory
from meshloom.planning.planner import Cluster, SearchSpace, base_config, plan
from meshloom.planning.run_plan import RunPlan
from meshloom.cli.plan import main as plan_main


def _shape(model: str, flavor: str):
    return get_model_spec(model).shape_model(get_model_args(model, flavor))


def test_search_covers_ep_schedules_and_accumulation_and_reports_runplan_layouts():
    cluster = Cluster(gpus=16, gpus_per_node=8, memory_gib=80)
    found = plan("30B-A3B", cluster, seq_len=4096, global_batch=64, model="qwen3")
    layouts = [c.layout for c in found]
    assert all(lay.world_size == 16 for lay in layouts)
    assert any(lay.ep > 1 for lay in layouts)
    assert {lay.pipeline_schedule for lay in layouts if lay.pp > 1} == {"1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"}
    assert any(lay.grad_accum_steps > 1 for lay in layouts) and any(lay.pp > 1 and lay.grad_accum_steps > 1 for lay in layouts)
    # Fastest first (to the microsecond: equal times go by fewer dimensions, then memory), and each one is the layout
    # RunPlan builds from the settings its recipe carries.
    assert [round(c.step_s, 6) for c in found] == sorted(round(c.step_s, 6) for c in found)
    base = base_config("qwen3", "30B-A3B", 4096)
    for candidate in found[:10]:
        assert layout_of(RunPlan.build(layout_config(base, candidate.layout), 16)) == candidate.layout


def test_each_layout_takes_the_fastest_ac_optimizer_and_float8_that_fit():
    """AC none before selective_op before full, AdamW before Muon (Newton-Schulz time): a layout carries a slower choice
    only where every faster one runs out of memory. At 8B's sizes Float8's faster matmuls outweigh its casts."""
    cluster = Cluster(gpus=8, gpus_per_node=8, memory_gib=80)
    shape = _shape("llama3", "8B")
    found = plan("8B", cluster, seq_len=8192, global_batch=16)
    precision = Precision("bf16")
    assert {"none", "selective_op", "full"} <= {c.layout.ac for c in found}
    for c in found:
        faster = []
        if c.layout.ac != "none":
            faster.append(dataclasses.replace(c.layout, ac=("none", "selective_op")[c.layout.ac == "full"]))
        if c.layout.optimizer == "Muon":
            faster.append(dataclasses.replace(c.layout, optimizer="AdamW"))
        for other in faster:
            assert not cluster.fits(estimate_memory(shape, other, 8192, precision).peak, other), (c.layout, other)
    # Where AdamW fits nowhere but Muon's one buffer per matrix does, the plan trains with Muon.
    tight = Cluster(gpus=8, gpus_per_node=8, memory_gib=40)
    only = SearchSpace(ac_modes=("full",), float8=(False,), schedules=("1F1B",))
    muon = [c for c in plan("8B", tight, seq_len=2048, global_batch=8, space=only) if c.layout.optimizer == "Muon"]
    assert muon
    for c in muon:
        adamw = estimate_memory(shape, dataclasses.replace(c.layout, optimizer="AdamW"), 2048, precision)
        assert not tight.fits(adamw.peak, c.layout) and c.memory.optimizer < adamw.optimizer


def test_float8_is_chosen_by_predicted_time_and_only_where_linears_qualify():
    """Float8 is one more variant timed against bf16: chosen where its faster matmuls outweigh its casts (8B), never
    on small matrices (llama3 `debug`, dim 256), and not offered where no linear layer has float8-sized dims."""
    from meshloom.planning.planner import float8_choices
    from meshloom.planning.step_time import float8_flops_saved, step_time

    precision = Precision("bf16")
    for flavor, seq, gpus in (("8B", 8192, 8), ("debug", 2048, 8)):
        shape, cluster = _shape("llama3", flavor), Cluster(gpus=gpus, gpus_per_node=8, memory_gib=80)
        found = plan(flavor, cluster, seq_len=seq, global_batch=16)
        for c in found:
            other = dataclasses.replace(c.layout, float8=not c.layout.float8)
            if cluster.fits(estimate_memory(shape, other, seq, precision).peak, other):
                assert c.step_s <= step_time(shape, other, seq, precision, cluster).step, (c.layout, other)
        chosen = {c.layout.float8 for c in found}
        # 8B: Float8 wherever it is faster (all but TP 8 with full AC, whose gathered inputs' casts outweigh the gain).
        assert (sum(c.layout.float8 for c in found) > 0.9 * len(found)) if flavor == "8B" else chosen == {False}, chosen
        sign = float8_flops_saved(shape, dataclasses.replace(found[0].layout, float8=True), seq)
        assert (sign > 0) == (flavor == "8B")
    # `tiny` (dim 64, FFN 192) at tp 8: no linear has both dims / 8 a multiple of 16, so Float8 is not offered.
    assert float8_choices("llama3", "tiny", 8, SearchSpace()) == (False,)
    assert float8_choices("llama3", "tiny", 1, SearchSpace()) == (False, True)


def test_the_chunked_loss_is_taken_only_where_whole_logits_do_not_fit_and_its_recipe_builds():
    """The chunked loss costs no step time in the model, so a layout carries it only where its whole-logits twin (same
    degrees, AC mode, optimizer and Float8) runs out of memory; at gpt-oss 20B's 201k vocabulary on 8 x 80 GiB
    that is the fastest layout. `--chunked-loss off` offers none, and a chunked layout's recipe builds the same layout."""
    cluster = Cluster(gpus=8, gpus_per_node=8, memory_gib=80)
    shape = _shape("gpt_oss", "20B")
    found = plan("20B", cluster, seq_len=8192, global_batch=16, model="gpt_oss")
    chunked = [c for c in found if c.layout.loss_chunk_tokens]
    assert found[0].layout.loss_chunk_tokens == 1024 and len(chunked) < len(found)
    for c in chunked:
        whole = dataclasses.replace(c.layout, loss_chunk_tokens=0)
        assert not cluster.fits(estimate_memory(shape, whole, 8192, Precision("bf16")).peak, whole), c.layout
    base = base_config("gpt_oss", "20B", 8192)
    for candidate in chunked[:5]:
        config = layout_config(base, candidate.layout)
        assert config.loss.chunked and config.loss.chunk_tokens == 1024
        assert layout_of(RunPlan.build(config, 8)) == candidate.layout
    off = plan("20B", cluster, seq_len=8192, global_batch=16, model="gpt_oss", space=SearchSpace(loss_chunks=(0,)))
    assert off and not any(c.layout.loss_chunk_tokens for c in off)
    assert found[0].step_s < off[0].step_s  # whole logits need a slower AC mode or layout here


def test_plan_command_offers_the_chunked_loss_unless_told_not_to(capsys):
    argv = ["--model", "gpt_oss", "--flavor", "20B", "--gpus", "8", "--seq-len", "8192", "--global-batch", "16", "--top", "1"]
    assert plan_main(argv) == 0
    assert "chunked loss (1024 tokens)" in capsys.readouterr().out
    assert plan_main([*argv, "--chunked-loss", "off"]) == 0
    assert "chunked loss" not in capsys.readouterr().out


def test_expert_all_to_all_overlapped_up_to_the_expert_compute_or_exposed():
    """Overlapped: dispatch and combine hidden behind the routed experts' matmuls up to their time, the remainder
    exposed; exposed (meshloom's own dispatch): all of it on the critical path."""
    from meshloom.planning.step_time import expert_flops_share, step_time

    shape = _shape("deepseek_v3", "671B")
    layout = Layout(dp_shard=64, pp=4, ep=64, ac="full", microbatch_size=1, microbatches=8,
                    pipeline_schedule="Interleaved1F1B", stages_per_rank=8)  # fmt: skip
    p = Precision("bf16")
    exposed = step_time(shape, layout, 4096, p, Cluster(256, 8, 80, expert_comm="exposed"))
    overlapped = step_time(shape, layout, 4096, p, Cluster(256, 8, 80))
    assert exposed.exposed["ep"] == exposed.comm["ep"] > 0
    hidden = overlapped.compute * expert_flops_share(shape, 4096)
    assert overlapped.exposed["ep"] == pytest.approx(max(0.0, overlapped.comm["ep"] - hidden))
    assert overlapped.step < exposed.step and 0.3 < expert_flops_share(shape, 4096) < 0.8
    with pytest.raises(UserError, match="expert_comm"):
        plan("16B", Cluster(8, 8, 80, expert_comm="hidden"), 4096, 8, model="deepseek_v3")


def test_split_points_are_honoured_and_the_largest_stage_is_reported():
    shape = _shape("llama3", "8B")  # 32 layers
    cluster = Cluster(gpus=16, gpus_per_node=8, memory_gib=80)
    space = SearchSpace(schedules=("1F1B",), split_points="4,20,26")
    found = plan("8B", cluster, seq_len=8192, global_batch=64, space=space)
    piped = [c for c in found if c.layout.pp > 1]
    assert piped and all(c.layout.pp == 4 and c.layout.stage_layer_counts == (4, 16, 6, 6) for c in piped)
    for c in piped[:5]:
        per_stage = [estimate_memory(shape, c.layout, 8192, Precision("bf16"), stage_index=s).peak for s in range(4)]
        assert c.memory.peak == max(per_stage) and c.memory.stage == per_stage.index(max(per_stage)) == 1
    # Uneven stages: the 16-layer stage needs more than the even split's busiest stage.
    even = dataclasses.replace(piped[0].layout, stage_layer_counts=())
    assert estimate_memory(shape, even, 8192, Precision("bf16")).peak < piped[0].memory.peak


def test_interleaved_and_v_schedules_change_bubble_and_memory():
    from meshloom.planning.step_time import bubble_share

    shape = _shape("llama3", "70B")
    base = Layout(dp_shard=8, tp=8, pp=4, ac="full", microbatch_size=1, microbatches=16)
    inter = dataclasses.replace(base, pipeline_schedule="Interleaved1F1B", stages_per_rank=2)
    zbv = dataclasses.replace(base, pipeline_schedule="ZBVZeroBubble", stages_per_rank=2)
    gpipe = dataclasses.replace(base, pipeline_schedule="GPipe")
    assert bubble_share(base) == 3 / 16 and bubble_share(inter) == 3 / 32 and bubble_share(zbv) == pytest.approx(1 / 32)
    p = Precision("bf16")
    acts = {lay.pipeline_schedule: estimate_memory(shape, lay, 8192, p).activations for lay in (base, inter, gpipe)}
    assert acts["1F1B"] < acts["Interleaved1F1B"] < acts["GPipe"]


def _held_at_peak(schedule_name: str, pp: int, microbatches: int, stages_per_rank: int, rank: int) -> dict[int, int]:
    """Microbatches each stage of `rank` holds (forward run, input gradient not yet) when the rank holds the most, read
    off the action order torch's schedule gives that rank (no stages or process group needed to build it)."""
    from torch.distributed.pipelining import schedules

    schedule = object.__new__(getattr(schedules, f"Schedule{schedule_name}"))
    schedule.pp_group_size, schedule._n_microbatches, schedule.n_local_stages = pp, microbatches, stages_per_rank
    schedule.rank, schedule.num_stages = rank, pp * stages_per_rank
    schedule.number_of_rounds = max(1, microbatches // pp)
    schedule.microbatches_per_round = microbatches // schedule.number_of_rounds
    live: dict[int, int] = {}
    best: dict[int, int] = {}
    for action in filter(None, schedule._calculate_single_rank_operations(rank)):
        for step in action.sub_actions or (action,):
            if step.computation_type == schedules._ComputationType.FORWARD:
                live[step.stage_index] = live.get(step.stage_index, 0) + 1
            elif step.computation_type in (schedules._ComputationType.BACKWARD_INPUT, schedules._ComputationType.FULL_BACKWARD):
                live[step.stage_index] -= 1
            if sum(live.values()) > sum(best.values()):
                best = dict(live)
    return best


@pytest.mark.parametrize("schedule, pp, stages_per_rank, loss_rank", [("DualPipeV", 16, 2, 0), ("ZBVZeroBubble", 16, 2, 0),
                                                                       ("Interleaved1F1B", 16, 2, 15), ("Interleaved1F1B", 8, 4, 7)])  # fmt: skip
def test_schedules_hold_the_loss_stage_for_one_microbatch_at_the_ranks_peak(schedule, pp, stages_per_rank, loss_rank):
    """torch's V and interleaved schedules keep many microbatches of the loss rank's other stages but one of the last
    stage (its backward follows each forward there) when that rank holds the most, so the estimate keeps the last
    stage's vocabulary-wide tensors once: doubling the vocabulary of DeepSeek-V3 671B adds about one microbatch's
    logits and log-softmax to the loss rank's activations, not one per microbatch in flight."""
    microbatches = 32
    held = _held_at_peak(schedule, pp, microbatches, stages_per_rank, loss_rank)
    last_stage = pp * stages_per_rank - 1
    assert held[last_stage] == 1 and sum(held.values()) >= pp
    args = get_model_args("deepseek_v3", "671B")
    layout = Layout(dp_shard=128, pp=pp, ep=64, ac="full", microbatch_size=1, microbatches=microbatches,
                    pipeline_schedule=schedule, stages_per_rank=stages_per_rank)  # fmt: skip
    def loss_rank_activations(vocab_size: int) -> int:
        shape = get_model_spec("deepseek_v3").shape_model(dataclasses.replace(args, vocab_size=vocab_size))
        return estimate_memory(shape, layout, 4096, Precision("bf16"), stage_index=loss_rank).activations

    logits = 4 * args.vocab_size * 4096  # one microbatch's fp32 logits
    added = loss_rank_activations(2 * args.vocab_size) - loss_rank_activations(args.vocab_size)
    assert logits <= added < 4 * logits  # the MTP head's logits and log-softmaxes too; never one per microbatch


def test_deepseek_v3_671b_on_1024_gpus_finds_pipeline_and_expert_parallel(tmp_path, capsys):
    out = tmp_path / "plan.toml"
    argv = [
        "--model", "deepseek_v3", "--flavor", "671B", "--gpus", "1024", "--gpus-per-node", "8", "--gpu-memory-gib", "80",
        "--seq-len", "4096", "--global-batch", "4096", "--output", str(out),
    ]  # fmt: skip
    start = time.process_time()
    assert plan_main(argv) == 0
    assert time.process_time() - start < 60
    printed = capsys.readouterr().out
    assert printed.count("\n#") == 5 and "tokens/s per GPU" in printed and "bubble" in printed
    config = load_config(["--config", str(out)])
    run = RunPlan.build(config, 1024)
    best = layout_of(run)
    assert best.world_size == 1024 and best.pp > 1 and best.ep > 1
    # Expert all-to-all overlapped with the expert matmuls, as DeepSeek-V3 and NeMo run it: a layout like theirs,
    # pipeline x expert parallel with the expert groups across nodes, ranks among the five shown.
    assert "expert all-to-all assumed overlapped" in printed
    shown = [tuple(map(int, m)) for m in re.findall(r"#\d+ +dp_replicate (\d+) dp_shard (\d+) tp (\d+) pp (\d+) cp (\d+) ep (\d+)", printed)]
    assert len(shown) == 5 and any(pp > 1 and tp * ep > 8 for _, _, tp, pp, _, ep in shown), shown
    assert Cluster(1024, 8, 80).fits(estimate_memory(run.shape(), best, 4096, Precision("bf16")).peak, best)
    assert "Predicted peak memory" in out.read_text()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--flavor", "405B", "--gpus", "8", "--global-batch", "8"], r"smallest peak is [0-9.]+ GiB .* at least [0-9.]+ GiB"),
        (["--flavor", "debug", "--gpus", "7", "--seq-len", "256", "--global-batch", "8"], "--gpus 7 cannot be factored"),
        (["--flavor", "9B", "--gpus", "8", "--global-batch", "8"], "model.flavor"),
        (["--model", "qwen3", "--flavor", "8B", "--gpus", "8", "--global-batch", "8", "--split-points", "x"], "split_points"),
    ],
)
def test_plan_errors_are_one_line(argv, message, capsys):
    import re

    err = one_line_error(plan_main(argv), capsys.readouterr().err, "")
    assert re.search(message, err), err


def test_plan_does_not_overwrite_a_file_it_did_not_make(tmp_path, capsys):
    out = tmp_path / "mine.toml"
    out.write_text("keep me\n")
    assert plan_main(["--flavor", "debug", "--gpus", "2", "--seq-len", "128", "--global-batch", "4", "--output", str(out)]) == 2
    assert out.read_text() == "keep me\n" and "--overwrite" in capsys.readouterr().err
