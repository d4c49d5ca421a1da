"""The pairwise matrix (meshloom/testing/matrix.py): every pair of values of its eleven axes is in a cell that trains and
matches its reference, or the declaration (meshloom/planning/features.py) refuses that pair with one line.

Each training cell runs the tiny fp32 run of the parity harness for matrix.STEPS = 4 steps (two of warm-up, two of
decay; a wrong layout shows from its second step), and its losses must equal its reference's within the harness's
tolerance (fp32: 1e-5; a cell with Float8 in it trains in bf16 on sequences of 32 tokens and takes the Float8 bound, as
its reference does too):
- a synchronous layout: one process with the same settings (streaming under several data-parallel ranks: pure
  replication of that degree, since each rank reads its own share of the stream);
- replica groups (2 groups, each the cell's layout): the same one process; the groups average gradients every step, as
  HSDP over the groups would, and HSDP equals one process within 1e-5 (tests/test_parity.py);
- DiLoCo and LocalSGD (a sync every 2 steps): the two groups end with bit-equal weights, and the last loss within 10%
  of one process's (each group steps alone between syncs, so no run of one process is the same computation);
- a kill (the job stops right after its step-2 checkpoint, as a SIGKILL after a save would leave it) and the restart,
  or the resume under another layout of the same data-parallel degree: the same run without the stop, which is the
  one-process reference's (within 1e-5).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from meshloom.config.schema import DataConfig
from meshloom.data.build import run_tokenizer
from meshloom.testing import matrix
from meshloom.testing.matrix_cells import CELLS
from meshloom.testing.matrix_run import Outcome, run_cells
from tests.shard_fixtures import document, prepared, write_jsonl

pytest.importorskip("torchft", reason='replica-group cells need torchft: pip install -e ".[ft]"')

SEMI_SYNC_LOSS_BOUND = 0.10


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
    outcome = outcomes[cell]
    ft = dict(zip(matrix.AXES, cell.split("-")))["ft"]
    if ft in ("diloco", "local_sgd"):
        a, b = outcome.model_digests
        assert a == b, f"{cell}: the groups' weights differ after the last sync"
        for losses in outcome.losses:
            assert abs(losses[-1] - outcome.reference[-1]) <= SEMI_SYNC_LOSS_BOUND * outcome.reference[-1], (losses, outcome.reference)
        return
    for losses in outcome.losses:
        assert len(losses) == matrix.STEPS
        diff = max(abs(x - y) for x, y in zip(losses, outcome.reference, strict=True))
        assert diff <= outcome.tolerance, f"{cell}: max |dloss| {diff:.2e} > {outcome.tolerance:g}\n{losses}\n{outcome.reference}"
