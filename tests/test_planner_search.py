"""`meshloom plan`'s search: what it tries (ep, AC, Muon, Float8, schedules, accumulation), that every layout it
reports is RunPlan's, per-stage estimates with split points, one-line errors, and the 671B plan on 1,024 GPUs."""

from __future__ import annotations

import dataclasses
import time

import pytest

from cli_checks import one_line_error
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
    """AC none before selective_op before full, AdamW before Muon (Newton-Schulz time), Float8 before bf16: a layout
    carries a slower choice only where every faster one runs out of memory."""
    cluster = Cluster(gpus=8, gpus_per_node=8, memory_gib=80)
    shape = _shape("llama3", "8B")
    found = plan("8B", cluster, seq_len=8192, global_batch=16)
    precision = Precision("bf16")
    assert {"none", "selective_op", "full"} <= {c.layout.ac for c in found} and all(c.layout.float8 for c in found)
    for c in found:
        faster = []
        if c.layout.ac != "none":
            faster.append(dataclasses.replace(c.layout, ac=("none", "selective_op")[c.layout.ac == "full"]))
        if c.layout.optimizer == "Muon":
            faster.append(dataclasses.replace(c.layout, optimizer="AdamW"))
        for other in faster:
            assert estimate_memory(shape, other, 8192, precision).peak > cluster.usable_bytes, (c.layout, other)
    # Where AdamW fits nowhere but Muon's one buffer per matrix does, the plan trains with Muon.
    tight = Cluster(gpus=8, gpus_per_node=8, memory_gib=40)
    only = SearchSpace(ac_modes=("full",), float8=(False,), schedules=("1F1B",))
    muon = [c for c in plan("8B", tight, seq_len=2048, global_batch=8, space=only) if c.layout.optimizer == "Muon"]
    assert muon
    for c in muon:
        adamw = estimate_memory(shape, dataclasses.replace(c.layout, optimizer="AdamW"), 2048, precision)
        assert adamw.peak > tight.usable_bytes and c.memory.optimizer < adamw.optimizer


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
    assert estimate_memory(run.shape(), best, 4096, Precision("bf16")).peak < 80 * GIB * 0.9
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
