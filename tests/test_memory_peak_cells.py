"""Every cell of the whole-peak table (benchmarks/RESULTS.md, "The whole peak on every rank") held by a test: the
committed CPU measurements of all 120 cells against the current estimator, on every rank, nothing trained again (the
benchmark's `--table --measured` path). A change to the estimator that moves any cell out of 0.9-1.1 fails here."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "2026-12-03"
# The two measurement files the table is printed from: 99 cells (every family but gpt-oss) and gpt-oss's 21.
MEASURED = ["memory_peak_table_qwen3_next_measured.json", "memory_peak_gpt_oss_flexbwd_table_measured.json"]
PEAK_BOUND = (0.9, 1.1)


def _benchmark():
    spec = importlib.util.spec_from_file_location("memory_estimate_cells", REPO / "benchmarks" / "memory_estimate.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_every_measured_whole_peak_cell_is_within_bound_on_every_rank(tmp_path):
    bench = _benchmark()
    measured: dict[str, list[dict]] = {}
    for name in MEASURED:
        measured.update(json.loads((RESULTS / name).read_text()))
    # The table's every (family, layout, AC mode) cell is measured: nothing of the table is left out of this test.
    assert set(bench.table_specs().values()) == set(measured)
    assert len(measured) == 120
    results = bench.with_estimates(measured, argparse.Namespace(flavor="debug", seq_len=128, batch=2), tmp_path)
    outside = {}
    for spec, ranks in results.items():
        ratios = [round(rank["measured"]["peak"] / rank["estimated"]["peak"], 3) for rank in ranks]
        if not all(PEAK_BOUND[0] <= ratio <= PEAK_BOUND[1] for ratio in ratios):
            outside[spec] = ratios
    assert not outside, outside
