"""The planner's communication volume (planning/comm_estimate.py) against the bytes real runs send.

Each case trains the `tiny` model (Qwen3 `tiny_moe` for expert parallel) for one step, then counts every
collective of a second step on every rank (observe/comm_count.py: FSDP's gathers and reduce-scatters, DTensor's
tensor-parallel collectives, pipeline sends, ring-attention hops, the expert all-to-all) at the bytes a ring
algorithm sends, by mesh dimension. In each dimension the estimate must be within 5% of the busiest rank (the mean
over ranks for expert parallel, whose per-rank share follows the routing). Layouts: FSDP 2, TP 2, PP 2, CP 2, EP 2
(on the FSDP ranks) in one 2-rank launch, and HSDP 2 x FSDP 2 x TP 2 in one 8-rank launch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshloom.testing.layout_parity import ParityCase, base_overrides
from meshloom.testing.ranks import run_ranks

QWEN3_MOE = "model.name=qwen3,model.flavor=tiny_moe"
CASES = {
    2: ["dp_shard=2", "tp=2", "pp=2", "cp=2", f"dp_shard=2,ep=2,{QWEN3_MOE}"],
    8: ["dp_replicate=2,dp_shard=2,tp=2"],
}
# Small all-reduces the model leaves out (the step's loss, the gradient norm's partial sums, the balancing counts).
NOISE_BYTES = 1024


def _count(cases: dict[str, list[str]], out_file: Path) -> None:
    import torch.distributed as dist

    from meshloom.config.loader import load_config
    from meshloom.observe.comm_count import CommCounter, group_dimensions
    from meshloom.parallel.distributed import rank, shutdown_and_exit
    from meshloom.planning.comm_estimate import step_comm_bytes
    from meshloom.planning.layout import layout_of, precision_from_config
    from meshloom.train.trainer import Trainer

    results = {}
    for spec, argv in cases.items():
        trainer = Trainer(load_config(argv))
        trainer.train_step()  # the first step also builds optimizer state and caches
        counter = CommCounter(group_dimensions(trainer.dims))
        with counter:
            trainer.train_step()
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {"sent": dict(counter.sent), "calls": dict(counter.calls)})
        plan, config = trainer.plan, trainer.config
        estimate = step_comm_bytes(plan.shape(), layout_of(plan), config.training.seq_len, precision_from_config(config))
        results[spec] = {"ranks": everyone, "estimate": estimate}
    if rank() == 0:
        out_file.write_text(json.dumps(results))
    shutdown_and_exit(0)


@pytest.fixture(scope="module")
def counted(tmp_path_factory, data_cache: Path) -> dict:
    workdir = tmp_path_factory.mktemp("comm")
    (workdir / "cache").symlink_to(data_cache)
    results = {}
    for world, specs in CASES.items():
        cases = {}
        for i, spec in enumerate(specs):
            case = ParityCase.parse(spec)
            cases[spec] = base_overrides(2, workdir) + case.overrides() + ["--job.dump_folder", str(workdir / f"run_{world}_{i}")]
        out = workdir / f"counts_{world}.json"
        run_ranks(_count, world, cases, out)
        results.update(json.loads(out.read_text()))
    return results


@pytest.mark.parametrize("spec", [spec for specs in CASES.values() for spec in specs])
def test_estimated_bytes_per_dimension_are_within_5_percent_of_the_counted(counted, spec: str) -> None:
    ranks, estimate = counted[spec]["ranks"], counted[spec]["estimate"]
    assert not [call for r in ranks for call in r["calls"] if call.startswith("uncounted:")], ranks[0]["calls"]
    dims = {dim for r in ranks for dim, value in r["sent"].items() if value} | {dim for dim, value in estimate.items() if value}
    report = []
    for dim in sorted(dims):
        per_rank = [r["sent"].get(dim, 0.0) for r in ranks]
        measured = sum(per_rank) / len(per_rank) if dim == "ep" else max(per_rank)
        expected = estimate.get(dim, 0.0)
        report.append(f"{dim}: counted {measured:.0f} B, estimated {expected:.0f} B")
        if expected == 0.0:
            assert measured <= NOISE_BYTES, report  # a group the layout does not have, or the loss reduction
        else:
            assert abs(measured - expected) <= 0.05 * expected, report
    print(f"{spec}: " + "; ".join(report))
    # Every dimension the layout splits moves bytes.
    layout = ParityCase.parse(spec).layout
    split = {name for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep") if getattr(layout, name) > 1}
    assert all(estimate[name] > NOISE_BYTES for name in split), (split, estimate)
