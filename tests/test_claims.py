"""What README.md and docs/ say about the pairwise matrix is what the code has.

Every sentence of README.md and of every page under docs/ (but docs/compatibility.md, which is generated from the
code) that speaks of the matrix is read clause by clause:
(A clause that cites another test file, or does not name the matrix in a sentence that does, speaks of that test and
is left out.)
- a step count ("4 steps") must be matrix.STEPS, or matrix.SYNC_EVERY after "sync every";
- a tolerance ("1e-5") must be one that some cell is held to (matrix_checks.cell_check), and no percentage may
  stand for a check (no cell has one);
- a clause that says the matrix trains features together ("trains ... with ...") may name only pairs that
  docs/compatibility.md proves (a cell, a layout parity test or one layout holding the other), unless it says the
  pair is refused.
"""

from __future__ import annotations

import functools
import itertools
import re
from pathlib import Path

import pytest

from meshloom.testing import compatibility, matrix
from meshloom.testing.matrix_cells import CELLS
from meshloom.testing.matrix_checks import cell_check

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "compatibility.md")]
ABOUT_THE_MATRIX = re.compile(r"pairwise matrix|test_matrix\.py|matrix cell|the matrix")

# How the pages name the matrix's values, longest first (so "FSDP × TP" is not read as FSDP and TP).
WORDS = {
    "FSDP × TP": "fsdp_tp", "FSDP×TP": "fsdp_tp", "Muon + QK-clip": "muon_qk_clip", "QK-clip": "muon_qk_clip",
    "Qwen3-Next": "qwen3_next", "Qwen3 MoE": "qwen3_moe", "DeepSeek-V3": "deepseek_v3", "gpt-oss": "gpt_oss",
    "Llama 3": "llama3", "Qwen3": "qwen3", "replica groups": "replica_groups", "DiLoCo": "diloco",
    "LocalSGD": "local_sgd", "HSDP": "hsdp", "FSDP": "fsdp", "TP": "tp", "PP": "pp", "CP": "cp", "EP": "ep",
    "Float8": "float8", "Muon": "muon", "document masks": "document_mask", "streaming": "streaming",
}  # fmt: skip


def _sentences(text: str) -> list[str]:
    """The page's prose (code blocks left out), one sentence each, line breaks joined."""
    prose = " ".join(text.split("```")[0::2])
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+(?=[A-Z`*(])", " ".join(prose.split()))]


def _clauses(sentence: str) -> list[str]:
    return [c for c in re.split(r"[;()]|\s-\s|: ", sentence) if c.strip()]


def _claims() -> list[tuple[str, str, str]]:
    out = []
    for page in PAGES:
        for sentence in _sentences(page.read_text()):
            if ABOUT_THE_MATRIX.search(sentence):
                out += [(page.relative_to(REPO).as_posix(), clause, sentence) for clause in _clauses(sentence)]
    return out


def _named(clause: str) -> list[str]:
    found = []
    for word, name in WORDS.items():
        if re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", clause):
            found.append(name)
            clause = re.sub(rf"(?<![\w-]){re.escape(word)}(?![\w-])", " ", clause)
    return found


@functools.cache
def _statuses() -> dict:
    return compatibility.statuses()


def _proven(a: str, b: str) -> bool:
    status = _statuses().get((a, b)) or _statuses().get((b, a))
    return status in ("—", "contains") or (isinstance(status, tuple) and status[0] in ("M", "P"))


OTHER_TEST = re.compile(r"tests/test_(?!matrix)\w+\.py")


def _problems(clause: str, sentence: str = "") -> list[str]:
    problems: list[str] = []
    if OTHER_TEST.search(clause) or (OTHER_TEST.search(sentence) and not ABOUT_THE_MATRIX.search(clause)):
        return problems  # the clause speaks of another test's steps and bounds
    for match in re.finditer(r"(sync every\s+)?(\d+)\s+(?:fp32\s+)?steps", clause):
        wanted = matrix.SYNC_EVERY if match.group(1) else matrix.STEPS
        if int(match.group(2)) != wanted:
            problems.append(f"{match.group(0)!r}: the code has {wanted}")
    tolerances = {cell_check(dict(c)).tolerance for c in CELLS}
    for match in re.finditer(r"\b\d(?:\.\d+)?e-\d+\b", clause):
        if float(match.group(0)) not in tolerances:
            problems.append(f"{match.group(0)}: no cell is held to it (the cells' bounds: {sorted(tolerances)})")
    for match in re.finditer(r"\b\d+(?:\.\d+)?%", clause):
        problems.append(f"{match.group(0)}: no cell checks a percentage")
    if re.search(r"\btrains?\b", clause) and " with" in clause and "refus" not in clause:
        names = _named(clause)
        axes = {name: next(axis for axis, values in matrix.AXES.items() if name in [v.name for v in values]) for name in names}
        for a, b in itertools.combinations(names, 2):
            if axes[a] != axes[b] and not _proven(a, b):
                problems.append(f"{a} with {b}: the table does not prove that pair")
    return problems


def test_the_claims_are_read() -> None:
    """The pages do speak of the matrix (the walk below would pass on nothing)."""
    pages = {page for page, _, _ in _claims()}
    assert {"docs/features.md", "docs/muon.md", "docs/fault-tolerance.md"} <= pages, pages


@pytest.mark.parametrize("page", [p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_claim_about_the_matrix_is_what_the_code_has(page: str) -> None:
    wrong = [(clause, problem) for where, clause, sentence in _claims() if where == page for problem in _problems(clause, sentence)]
    assert not wrong, "\n".join(f"{page}: {problem}\n    in: {clause}" for clause, problem in wrong)


@pytest.mark.parametrize(
    ("clause", "expected"),
    [
        ("the pairwise matrix runs 6 steps", "'6 steps': the code has 4"),
        ("its last loss within 10% of one process's", "10%: no cell checks a percentage"),
        ("the matrix trains DiLoCo and LocalSGD with TP, PP, CP and EP inside a group", "diloco with pp"),
        ("each cell matches one process within 1e-2", "1e-2: no cell is held to it"),
    ],
)
def test_the_old_wrong_claims_fail(clause: str, expected: str) -> None:
    assert any(expected in problem for problem in _problems(clause)), _problems(clause)
