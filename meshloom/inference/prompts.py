"""Reading prompt files: .jsonl (one object per line, the text under "prompt" or "text") or plain text (one
prompt per line; blank lines skipped)."""

from __future__ import annotations

import json
from pathlib import Path

from meshloom.config.errors import UserError

PROMPT_FIELDS = ("prompt", "text")


def read_prompts(path: str | Path, setting: str) -> list[str]:
    """Prompts of a file; ValueError naming `setting`, the file and the line for anything unreadable."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{setting}: prompt file {path} not found")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise UserError(f"{setting}: {path} is not UTF-8 text: {err}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix not in (".jsonl", ".json"):
            prompts.append(line)
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{setting}: {path} line {number} is not valid JSON: {err}") from None
        text = next((record[f] for f in PROMPT_FIELDS if isinstance(record, dict) and isinstance(record.get(f), str)), None)
        if text is None:
            raise UserError(f"{setting}: {path} line {number} has no string field {' or '.join(map(repr, PROMPT_FIELDS))}")
        prompts.append(text)
    if not prompts:
        raise UserError(f"{setting}: {path} holds no prompts")
    return prompts
