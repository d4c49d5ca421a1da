"""The pairwise matrix (meshloom/testing/matrix.py): every pair of values of its eleven axes is in a cell that trains and
matches its reference, or the declaration (meshloom/planning/features.py) refuses that pair with one line.

Each training cell runs the tiny run of the parity harness for matrix.STEPS = 4 steps (two of warm-up, two of decay; a
wrong layout shows from its second step). What a cell must match, within which tolerance, and how a kill cell stops,
is meshloom/testing/matrix_checks.py's `cell_check` (docs/compatibility.md prints it): one process; pure replication
for streaming under several data-parallel ranks; for replica groups, every group against one process; for DiLoCo and
LocalSGD, every group against the same groups emulated in one process with the outer step, the groups ending
bit-equal; Float8 cells within their measured bound. Every reference must itself train (matrix_checks.TRAINS_BY).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from meshloom.config.schema import DataConfig
from meshloom.data.build import run_tokenizer
from meshloom.testing import matrix
from meshloom.testing.layout_parity import BF16_TOLERANCE
from meshloom.testing.matrix_cells import CELLS
from meshloom.testing.matrix_checks import (
    FLOAT8_SPREAD,
    FLOAT8_SPREAD_BOUND,
    KILLED,
    LAYOUT_CLASSES,
    TRAINS_BY,
    cell_check,
    float8_spread_key,
    layout_class,
)
from meshloom.testing.matrix_run import Outcome, run_cells
from tests.shard_fixtures import document, prepared, write_jsonl

pytest.importorskip("torchft", reason='replica-group cells need torchft: pip install -e ".[ft]"')

def _paths(workdir: Path) -> dict[str, str]:
    """Two prepared shard sources (web, code) and a stream file, tokenized by the runs' own built-in tokenizer."""
    tokenizer = run_tokenizer(DataConfig(vocab_size=512, max_bytes=400_000, cache_dir=str(workdir / "cache")))
    web = prepared(workdir / "web", tokenizer, [document(i) for i in range(120)])
    code = prepared(workdir / "code", tokenizer, [document(1000 + i, words=60) for i in range(120)])
    stream = write_jsonl(workdir / "stream.jsonl", [document(2000 + i) for i in range(300)])
    return {"shards": f"{web}:1,{code}:1", "stream": str(stream)}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    os.environ.pop("WORLD_SIZE", None)
    workdir = tmp_path_factory.mktemp("matrix")
    return run_cells([dict(c) for c in CELLS], workdir, _paths(workdir))


def test_the_cells_cover_every_pair_the_declaration_accepts() -> None:
    missing = matrix.required_pairs()
    for cell in CELLS:
        assert matrix.plan_refusal(dict(cell)) is None, f"{matrix.cell_id(cell)} is refused: {matrix.plan_refusal(dict(cell))}"
        missing -= matrix.pairs_of(dict(cell))
    assert not missing, f"pairs in no training cell (regenerate with python -m meshloom.testing.matrix): {sorted(missing)}"


@pytest.mark.parametrize(("pair", "line"), sorted(matrix.refused_pairs().items()), ids=lambda p: "x".join(p) if isinstance(p, tuple) else "")
def test_a_refused_pair_is_refused_by_name_before_anything_is_built(pair: tuple[str, str], line: str) -> None:
    """The refusal is one line that names a setting of each value (or the family that cannot take the other)."""
    assert "\n" not in line
    a, b = pair
    words = {name: [*matrix.settings_named(name)] for name in pair}
    assert any(w in line for w in words[a]) and any(w in line for w in words[b]), (pair, line)


@pytest.mark.parametrize("cell", [matrix.cell_id(c) for c in CELLS])
def test_cell_matches_its_reference(outcomes: dict[str, Outcome], cell: str) -> None:
    """What matrix_checks.cell_check states for the cell (and docs/compatibility.md prints) is what is asserted."""
    outcome, check = outcomes[cell], cell_check(dict(zip(matrix.AXES, cell.split("-"))))
    references = outcome.group_references or [outcome.reference] * len(outcome.losses)
    if check.reference == "the groups emulated in one process":
        a, b = outcome.model_digests
        assert a == b, f"{cell}: the groups' weights differ after the last sync"
    first, last = (sum(r[i] for r in references) / len(references) for i in (0, -1))
    assert first - last >= TRAINS_BY, f"{cell}: its reference does not train ({first:.4f} -> {last:.4f})"
    for losses, reference in zip(outcome.losses, references, strict=True):
        assert len(losses) == len(reference) == check.steps
        diff = max(abs(x - y) for x, y in zip(losses, reference, strict=True))
        print(f"{cell}: max |dloss| {diff:.2e} (bound {check.tolerance:g}); reference falls {first - last:.3f}")
        assert diff <= check.tolerance, f"{cell}: max |dloss| {diff:.2e} > {check.tolerance:g}\n{losses}\n{reference}"


def test_every_float8_cell_has_its_measured_bound() -> None:
    """Each Float8 cell's spread bound is 2x the spread benchmarks/float8_spread.py measured for it, rounded up; a cell
    of several ranks adds the bf16 bound, one of one process does not."""
    float8 = {float8_spread_key(c) for c in CELLS if c["float8"] == "float8"}
    assert set(FLOAT8_SPREAD_BOUND) == float8, sorted(set(FLOAT8_SPREAD_BOUND) ^ float8)
    measured = json.loads((Path(__file__).resolve().parents[1] / FLOAT8_SPREAD).read_text())["cells"]
    for cell, bound in FLOAT8_SPREAD_BOUND.items():
        spread = measured[cell]["spread"]
        assert 2 * spread <= bound < 4 * spread, (cell, spread, bound)
    for cell in CELLS:
        if cell["float8"] == "float8":
            several = cell["layout"] != "1proc"
            assert cell_check(dict(cell)).tolerance == FLOAT8_SPREAD_BOUND[float8_spread_key(cell)] + (BF16_TOLERANCE if several else 0)


def test_a_kill_restart_cell_of_every_layout_class_is_killed_for_real() -> None:
    classes = {layout_class(c) for c in CELLS if c["resume"] == "kill_restart" and c["ft"] == "ft_off"}
    killed = {layout_class(c) for c in CELLS if matrix.cell_id(c) in KILLED}
    assert classes == killed == set(LAYOUT_CLASSES), (classes, killed)
