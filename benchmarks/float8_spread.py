"""Float8's own run-to-run spread on the pairwise matrix's Float8 cells, which sets each cell's tolerance.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/float8_spread.py --out benchmarks/results/2026-12-04

For every Float8 cell of meshloom/testing/matrix_cells.py this trains the cell's one-process reference (its settings
on one process, eager, without activation checkpointing: what the matrix holds the cell to) for matrix.STEPS steps
three times: with the whole local batch at once, and cut into 2 and 4 microbatches of gradient accumulation. The
three compute the same step in exact arithmetic; under Float8 each microbatch takes its own tensorwise scales (as
each data-parallel rank of a layout does) and bf16 sums in another order, so the largest difference between their
losses is Float8's own spread for those settings. A cell's layout cuts the batch no finer than 4 ways (a run whose ranks read 2 sequences each is cut in 2 only).

It prints, and writes as float8_spread.json and float8_spread.txt, each cell's spread (max |dloss| over the steps and
the two cut runs against the whole one), with the commit and the CPU's flags. matrix_checks.FLOAT8_SPREAD_BOUND takes a
bound per cell from this output (see its comment).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MICROBATCHES = (1, 2, 4)


def _lscpu_flags() -> str:
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    line = next((ln for ln in flags.splitlines() if ln.startswith("Flags:")), "")
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return " ".join(f for f in wanted if f in line.split())


def main() -> None:
    from meshloom.testing import matrix
    from meshloom.testing.layout_parity import ParityCase
    from meshloom.testing.matrix_cells import CELLS
    from meshloom.testing.matrix_run import reference_spec
    from meshloom.testing.resume_parity import Case, launch
    from tests.test_matrix import _paths

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.pop("WORLD_SIZE", None)
    workdir = Path(tempfile.mkdtemp(prefix="meshloom-float8-spread-"))
    paths = _paths(workdir)
    cases, specs = [], {}
    for cell in CELLS:
        if cell["float8"] != "float8":
            continue
        spec = reference_spec(dict(cell))
        specs[matrix.cell_id(cell)] = spec
        settings = dict(item.split("=", 1) for item in spec.split(","))
        local = int(settings.get("training.local_batch_size", matrix.GLOBAL_BATCH // ParityCase.parse(spec).dp))
        for cut in [c for c in MICROBATCHES if local % c == 0]:  # a rank's batch of 2 is cut in 2 at most
            name = f"{matrix.cell_id(cell)}|{cut}"
            case_spec = ",".join(f"{k}={v}" for k, v in {**settings, "training.local_batch_size": str(local // cut)}.items())
            extra = matrix.data_args(cell["data"], paths)
            cases.append(Case(name, str(workdir / name.replace("|", "_")), case_spec, matrix.STEPS, None, extra))
    started = time.time()
    results = launch(cases, workdir)
    rows = {}
    for cell_id, spec in specs.items():
        whole = results[f"{cell_id}|1"].losses
        cuts = {cut: results[f"{cell_id}|{cut}"].losses for cut in MICROBATCHES if f"{cell_id}|{cut}" in results}
        spread = max(abs(a - b) for cut, losses in cuts.items() if cut > 1 for a, b in zip(whole, losses, strict=True))
        rows[cell_id] = {"reference": spec, "losses": cuts, "spread": spread}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    report = {
        "commit": commit, "cpu_flags": _lscpu_flags(), "steps": matrix.STEPS, "microbatches": MICROBATCHES,
        "seconds": round(time.time() - started), "cells": rows,
    }  # fmt: skip
    (args.out / "float8_spread.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"commit {commit}; lscpu flags: {report['cpu_flags']}; {matrix.STEPS} steps; {report['seconds']} s", ""]
    lines += [f"{row['spread']:.2e}  {cell_id}" for cell_id, row in rows.items()]
    (args.out / "float8_spread.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
