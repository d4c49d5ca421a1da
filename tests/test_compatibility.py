"""docs/compatibility.md agrees with the code: it is what meshloom.testing.compatibility generates from the declaration
and the matrix, every pair of its features is proven or refused, and every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

from meshloom.testing import compatibility

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


def test_the_readme_links_the_page() -> None:
    assert "docs/compatibility.md" in (REPO / "README.md").read_text()
