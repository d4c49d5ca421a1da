"""docs/compatibility.md agrees with the code: it is what meshloom.testing.compatibility generates from the declaration
and the matrix, every pair of its features is proven or refused, and every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

from meshloom.testing import compatibility, matrix
from meshloom.testing.compatibility_proofs import LAYOUT_TEST_STEPS, NON_AXIS_PROOFS

REPO = Path(__file__).resolve().parents[1]


def test_the_committed_page_is_the_generated_one() -> None:
    committed = (REPO / "docs" / "compatibility.md").read_text()
    assert committed == compatibility.render(), "regenerate: python -m meshloom.testing.compatibility > docs/compatibility.md"


def test_every_pair_is_proven_or_refused() -> None:
    unproven = [pair for pair, status in compatibility.statuses().items() if status == "unproven"]
    assert not unproven, unproven


def test_every_named_test_exists_with_its_case() -> None:
    for status in compatibility.statuses().values():
        if isinstance(status, tuple) and status[0] == "P":
            node, case = status[1], status[2]
            path, _, function = node.partition("::")
            text = (REPO / path).read_text()
            assert re.search(rf"^def {function}\(", text, re.M), node
            assert f'"{case}' in text, (node, case)
            steps = LAYOUT_TEST_STEPS[node]
            assert f"steps={steps}" in text or f'_short": {steps}' in text, (node, steps)


def _test_exists(node: str) -> bool:
    path, _, function = node.partition("::")
    return bool(re.search(rf"^def {function}\(", (REPO / path).read_text(), re.M))


def test_every_declared_feature_is_a_matrix_value_or_has_its_own_proof() -> None:
    """A feature added to the declaration must join the matrix's axes or name what proves it."""
    from meshloom.planning.features import FEATURES

    on_axes = {f for values in matrix.AXES.values() for v in values for f in matrix.features_of(v.name)}
    assert not set(FEATURES) - on_axes - set(NON_AXIS_PROOFS), sorted(set(FEATURES) - on_axes - set(NON_AXIS_PROOFS))
    assert not set(NON_AXIS_PROOFS) & on_axes, sorted(set(NON_AXIS_PROOFS) & on_axes)
    for name, proofs in NON_AXIS_PROOFS.items():
        assert proofs and all(_test_exists(node) for node, _ in proofs), name


def test_each_matrix_note_states_the_check_of_its_cell() -> None:
    """The page prints, for each pair, the strongest cell holding it, with what test_matrix.py asserts of that cell."""
    from meshloom.testing.matrix_cells import CELLS
    from meshloom.testing.matrix_checks import cell_check

    page = compatibility.render()
    by_id = {matrix.cell_id(c): c for c in CELLS}
    for pair, status in compatibility.statuses().items():
        if isinstance(status, tuple) and status[0] == "M":
            check = cell_check(dict(by_id[status[1]]))
            assert f"[{status[1]}]`: {check.describe()}" in page
            holding = [cell_check(dict(c)).strength for c in CELLS if set(pair) <= set(c.values())]
            assert check.strength == min(holding), (pair, status[1])


def test_the_readme_links_the_page() -> None:
    assert "docs/compatibility.md" in (REPO / "README.md").read_text()
