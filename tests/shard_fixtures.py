"""Helpers shared by the prepare / shards / streaming tests: a small real tokenizer and input files."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from meshloom.config.schema import DataConfig
from meshloom.data.prepare import PrepareOptions, prepare
from meshloom.data.tokenizer import Tokenizer, build_tokenizer

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def document(i: int, words: int = 0) -> str:
    """A deterministic document of varying length (about 20..120 words unless `words` is given)."""
    n = words or 20 + (i * 37) % 100
    return " ".join(WORDS[(i * 7 + j * j) % len(WORDS)] for j in range(n)) + f" #{i}"


class Numbered(Tokenizer):
    """Encodes "N L" as L copies of N, so every token tells which document it came from."""

    vocab_size, bos_id, eos_id, identity = 60_000, 0, 1, "numbered"

    def encode(self, text: str) -> list[int]:
        number, length = map(int, text.split()[:2])
        return [number] * length


def numbered_texts(count: int, first: int = 2) -> list[str]:
    """Documents "N L" of 3 to 25 tokens, numbered from `first`."""
    return [f"{first + i} {3 + (i * 7) % 23}" for i in range(count)]


def tokenizer_json(folder: Path) -> Path:
    """A byte-level BPE tokenizer.json with <s> / </s>, trained in well under a second."""
    path = folder / "tokenizer.json"
    if not path.exists():
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=320, special_tokens=["<s>", "</s>"], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator([document(i) for i in range(50)], trainer=trainer)
        folder.mkdir(parents=True, exist_ok=True)
        tok.save(str(path))
    return path


def load_tokenizer(path: Path) -> Tokenizer:
    return build_tokenizer(str(path), [], 0, path.parent)


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))
    return path


def prepared(folder: Path, tokenizer: Tokenizer, texts: list[str], shard_tokens: int = 4000, **options) -> Path:
    """A shard folder holding `texts` (one .jsonl input), made with one worker."""
    source = write_jsonl(folder.parent / f"{folder.name}-input.jsonl", texts)
    prepare(PrepareOptions([str(source)], folder, shard_tokens=shard_tokens, progress=False, **options), DataConfig(), tokenizer)
    return folder
