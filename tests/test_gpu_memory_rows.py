"""The memory estimate against every measured GPU row (benchmarks/gpu_memory_rows.py): the dry run's peak within 10% of
the run's max allocated and its reserved bytes within 10% of the run's max reserved; and the dry run moving with
compile and Float8 the way the H200 measurements moved. torchtitan's published rows are held in
tests/test_published_runs.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BOUND = (0.9, 1.1)


def _rows():
    spec = importlib.util.spec_from_file_location("gpu_memory_rows", REPO / "benchmarks" / "gpu_memory_rows.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


ROWS = _rows()
GIB = 2**30


@pytest.mark.parametrize(
    "row",
    [pytest.param(row, marks=pytest.mark.xfail(strict=True, reason=row.unmet)) if row.unmet else row for row in ROWS.ROWS],
    ids=[row.name for row in ROWS.ROWS],
)
def test_every_measured_gpu_row_is_estimated_within_10_percent(row):
    memory = ROWS.estimate(row)
    ratios = {"reserved": memory.reserved / GIB / row.reserved_gib}
    if row.allocated_gib:
        ratios["allocated"] = memory.peak / GIB / row.allocated_gib
    assert all(BOUND[0] <= ratio <= BOUND[1] for ratio in ratios.values()), ratios


def test_the_estimate_moves_with_compile_and_float8_as_measured():
    """Each H200 mode's step from the one before it (eager -> compile -> compile + Float8, compile -> compile +
    selective_op) has the measured sign and lies within 10% of the eager run's peak of the measured step."""
    rows = [row for row in ROWS.ROWS if row.source == ROWS.H200_ISSUE_43]
    eager, compiled, float8, selective = rows
    peak = {row.name: ROWS.estimate(row).peak / GIB for row in rows}
    for before, after in ((eager, compiled), (compiled, float8), (compiled, selective)):
        estimated = peak[after.name] - peak[before.name]
        measured = after.allocated_gib - before.allocated_gib
        assert estimated < 0 and measured < 0
        assert abs(estimated - measured) <= 0.1 * eager.allocated_gib, (before.name, after.name, estimated, measured)


def test_the_dry_run_prints_the_compiled_estimate_allocated_and_reserved():
    """`meshloom train --dry-run` with compile prints what the rows are held to: the peak (allocated) and the
    allocator's reserved bytes."""
    from meshloom.config.loader import load_config
    from meshloom.planning.dry_run import dry_run, split_dry_run_args

    row = next(row for row in ROWS.ROWS if row.name.endswith(", compile"))
    world_size, rest = split_dry_run_args(row.dry_run_args.split())
    report = dry_run(load_config(rest), world_size)
    memory = ROWS.estimate(row)
    text = report.format()
    assert f"peak                       {memory.peak / GIB:10.2f} GiB allocated" in text
    assert f"reserved                   {memory.reserved / GIB:10.2f} GiB by the caching allocator" in text
    assert "compile" in text.splitlines()[0]
