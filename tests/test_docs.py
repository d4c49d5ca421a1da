"""README.md and every page under docs/ name only paths that exist; docs/layout.md's tree is the repository's; the
README is a front page that links every page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOP_DIRS = ("meshloom/", "configs/", "scripts/", "benchmarks/", "tests/", "docs/")


def _exists(token: str) -> bool:
    """A path relative to the repository or the package, or a file name found somewhere in the package."""
    token = token.rstrip("/").split("::", 1)[0]  # a test's node id names its file
    if (REPO / token).exists() or (REPO / "meshloom" / token).exists():
        return True
    return "/" not in token and any((REPO / "meshloom").rglob(token))


def _code_paths(text: str) -> list[str]:
    """Backticked paths, and folder/file.py paths inside fenced code blocks (the diagrams)."""
    tokens = re.findall(r"`([^`\s]+)`", text)
    for block in text.split("```")[1::2]:
        tokens += re.findall(r"\b[a-z_]+/[\w/]*\w\.py\b", block)
    return [t for t in tokens if ("/" in t or t.endswith(".py")) and "<" not in t and not t.startswith(("-", "http"))]


def test_architecture_doc_paths_exist():
    text = (REPO / "docs" / "architecture.md").read_text()
    missing = [t for t in _code_paths(text) if not _exists(t)]
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", [p.relative_to(REPO).as_posix() for p in PAGES])
def test_page_paths_exist(page: str):
    text = (REPO / page).read_text()
    named = [t for t in _code_paths(text) if t.startswith(TOP_DIRS)]
    missing = [t for t in named if not _exists(t)]
    assert not missing, f"{page} names paths that do not exist: {missing}"
    links = re.findall(r"\]\(([^)#\s]+)", text)
    broken = [link for link in links if not link.startswith("http") and not ((REPO / page).parent / link).exists()]
    assert not broken, f"{page} links pages that do not exist: {broken}"


def test_readme_is_a_front_page_linking_every_page():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150, "README.md is the front page: move a topic to its own page under docs/"
    assert text.splitlines()[2].startswith("PyTorch-native pretraining for five model families")
    assert "make train" in text and "make test" in text
    unlinked = [p.name for p in (REPO / "docs").glob("*.md") if f"(docs/{p.name})" not in text]
    assert not unlinked, f"README.md does not link {unlinked}"


def test_layout_page_matches_the_tree():
    text = (REPO / "docs" / "layout.md").read_text()
    block = text.split("```", 2)[1]
    missing, folder = [], None
    for line in block.splitlines():
        words = re.findall(r"[\w./]+", line)
        if line and not line[0].isspace() and words and words[0].endswith("/"):
            folder = REPO / words[0]
            if not folder.is_dir():
                missing.append(words[0])
        for word in words:
            if word.endswith("/") and line.startswith(word):
                continue
            if word.endswith("/") and folder is not None and "/" not in word.rstrip("/"):
                if not (folder / word).is_dir() and not (REPO / word).is_dir():
                    missing.append(word)
            elif word.endswith(".py") and folder is not None and not any(folder.rglob(word.split("/")[-1])):
                missing.append(f"{folder.relative_to(REPO)}/{word}")
    assert not missing, f"docs/layout.md names what does not exist: {missing}"
    assert len(block.splitlines()) > 8
