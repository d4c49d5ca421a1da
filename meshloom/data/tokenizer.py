"""Tokenizers: a byte-level BPE trained on the corpus, HF tokenizer.json, or tiktoken files.

All three expose the same small surface (`Tokenizer`). Corpus text is always
encoded as plain text: a document that happens to contain "<|eos|>" is split
into ordinary tokens, and BOS/EOS ids are added only by the data pipeline.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import uuid
from pathlib import Path
from typing import Callable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from meshloom.config.errors import ConfigError, UserError
from meshloom.config.schema import DataConfig

logger = logging.getLogger(__name__)

BUILTIN_BOS = "<|bos|>"
BUILTIN_EOS = "<|eos|>"

# The pre-tokenizer of Meta's 128K-vocabulary tiktoken files (tokenizer.model): contractions, letter runs, digit groups of up to 3,
# punctuation runs, and whitespace handling that keeps a leading space with the word.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NUM_SPECIAL = 256

# Names used for BOS/EOS by common tokenizer.json files, most specific first.
_BOS_NAMES = ("<|begin_of_text|>", "<|bos|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>", "<|endoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "<|eos|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>")


def llama3_special_tokens() -> list[str]:
    """The 256 special tokens of Meta's 128K-vocabulary tiktoken files, in id order after the mergeable ranks."""
    named = [
        "<|begin_of_text|>", "<|end_of_text|>",
        "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>", "<|step_id|>",
        "<|start_header_id|>", "<|end_header_id|>",
        "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
    ]
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(2, 2 + LLAMA3_NUM_SPECIAL - len(named))]
    return named + reserved


class Tokenizer:
    """Common interface: ids are plain ints, BOS/EOS are never added implicitly."""

    vocab_size: int
    bos_id: int
    eos_id: int
    identity: str  # stable digest of the vocabulary, used in cache keys

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError


class HFTokenizer(Tokenizer):
    """Wraps a `tokenizers.Tokenizer` (the built-in BPE or a tokenizer.json)."""

    def __init__(self, tok: tokenizers.Tokenizer, bos_id: int, eos_id: int, identity: str):
        tok.encode_special_tokens = True  # special-token strings in text stay plain text
        self._tok = tok
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.identity = identity
        self.vocab_size = _hf_vocab_size(tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def to_json(self) -> str:
        """The tokenizer as a Hugging Face tokenizer.json, which data.tokenizer = PATH reads back to the same ids."""
        return self._tok.to_str(pretty=True)


def _hf_vocab_size(tok: tokenizers.Tokenizer) -> int:
    # Ids may be sparse in hand-made files; size the embedding to the largest id.
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE file with the pre-tokenizer regex and special tokens of Meta's 128K-vocabulary release."""

    def __init__(self, ranks: dict[bytes, int], name: str, identity: str):
        import tiktoken

        specials = llama3_special_tokens()
        base = max(ranks.values()) + 1 if ranks else 0
        self._enc = tiktoken.Encoding(
            name=name,
            pat_str=LLAMA3_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={s: base + i for i, s in enumerate(specials)},
        )
        self.bos_id = base
        self.eos_id = base + 1
        self.vocab_size = self._enc.n_vocab
        self.identity = identity

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids))


def _digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode("utf-8") if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()


def hash_texts(texts: list[str]) -> str:
    """Digest of a list of texts (used when no corpus identity is supplied)."""
    h = hashlib.sha256(b"meshloom-texts-v1\0")
    for t in texts:
        data = t.encode("utf-8")
        h.update(str(len(data)).encode() + b"\0")
        h.update(data)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write via a private temp file and rename, so racing writers never leave a torn file."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def train_bpe(texts: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    """Train a byte-level BPE (GPT-2 style bytes-to-unicode) with <|bos|>, <|eos|> at ids 0, 1."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BUILTIN_BOS, BUILTIN_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def _builtin(
    train_texts: Callable[[], list[str]] | list[str],
    vocab_size: int,
    cache_dir: Path,
    texts_id: str | None,
    on_train: Callable[[], None] | None = None,
) -> Tokenizer:
    if vocab_size < 256 + 2:
        raise UserError(
            f"data.vocab_size={vocab_size} is too small for the built-in byte-level BPE: "
            "it needs at least 258 (256 bytes + <|bos|> + <|eos|>)"
        )
    if texts_id is None:
        # Without a supplied identity the texts must be read to key the cache.
        if callable(train_texts):
            train_texts = train_texts()
        texts_id = hash_texts(train_texts)
    key = _digest("builtin-bpe-v1", texts_id, str(vocab_size))[:20]
    cache_dir = Path(cache_dir)
    cached = cache_dir / f"tokenizer-{key}.json"
    tok = _read_cached_bpe(cached) if cached.exists() else None
    if tok is None:
        texts = train_texts() if callable(train_texts) else train_texts
        tok = train_bpe(list(texts), vocab_size)
        cache_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(cached, tok.to_str().encode("utf-8"))
        if on_train is not None:
            on_train()
    bos, eos = tok.token_to_id(BUILTIN_BOS), tok.token_to_id(BUILTIN_EOS)
    assert bos is not None and eos is not None, "built-in BPE lost its special tokens"
    return HFTokenizer(tok, bos, eos, identity=f"builtin-bpe:{_digest(tok.to_str())[:20]}")


def _read_cached_bpe(path: Path) -> tokenizers.Tokenizer | None:
    """A cached built-in BPE, or None (with one line saying so) when the file is damaged and must be trained again.

    The cache is ours and training is deterministic, so a truncated or edited file is simply replaced.
    """
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
        problem = None if tok.token_to_id(BUILTIN_BOS) == 0 and tok.token_to_id(BUILTIN_EOS) == 1 else "lacks <|bos|>/<|eos|>"
    except Exception as err:  # tokenizers raises a bare Exception on bad JSON
        problem = f"cannot be read ({str(err).splitlines()[0][:120] if str(err) else type(err).__name__})"
    if problem is None:
        return tok
    logger.warning("tokenizer cache %s %s; training the tokenizer again", path, problem)
    return None


def _find_id(tok: tokenizers.Tokenizer, names: tuple[str, ...]) -> int | None:
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    return None


def _hf_json(path: Path) -> Tokenizer:
    raw = path.read_bytes()
    try:
        tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise UserError(f"data.tokenizer={str(path)!r} is not a valid tokenizer.json: {e}") from e
    bos, eos = _find_id(tok, _BOS_NAMES), _find_id(tok, _EOS_NAMES)
    if bos is None or eos is None:
        raise UserError(
            f"data.tokenizer={str(path)!r}: cannot find a BOS/EOS token; looked for "
            f"BOS in {list(_BOS_NAMES)} and EOS in {list(_EOS_NAMES)}"
        )
    return HFTokenizer(tok, bos, eos, identity=f"hf-json:{_digest(raw)[:20]}")


def load_tiktoken_ranks(data: bytes, source: str) -> dict[bytes, int]:
    """Parse "base64token rank" lines (read locally; tiktoken's loader keeps a /tmp cache keyed by path)."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise UserError(
                f"data.tokenizer={source!r}: line {lineno} is not 'base64token rank': {line[:80]!r}"
            ) from e
    if not ranks:
        raise UserError(f"data.tokenizer={source!r}: no token ranks in the file")
    if len(set(ranks.values())) != len(ranks):
        raise UserError(f"data.tokenizer={source!r}: duplicate ranks in the file")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        # tiktoken cannot encode a byte without a rank, so text with it would crash later.
        raise UserError(
            f"data.tokenizer={source!r}: {len(missing)} single-byte tokens missing "
            f"(e.g. byte {missing[0]}); a byte-level BPE file must rank all 256 bytes"
        )
    return ranks


def _tiktoken(path: Path) -> Tokenizer:
    raw = path.read_bytes()
    ranks = load_tiktoken_ranks(raw, str(path))
    return TiktokenTokenizer(ranks, name=path.stem, identity=f"tiktoken-llama3:{_digest(raw)[:20]}")


def build_tokenizer(
    spec: str,
    train_texts: Callable[[], list[str]] | list[str],
    vocab_size: int,
    cache_dir: Path,
    *,
    texts_identity: str | None = None,
    on_train: Callable[[], None] | None = None,
) -> Tokenizer:
    """Build the tokenizer named by `spec` (the `data.tokenizer` setting).

    spec "builtin": train a byte-level BPE of `vocab_size` on `train_texts`, cached
      in cache_dir under a key of (texts identity, vocab_size); a second call loads
      the cached file without training (and without calling `train_texts` when it
      is a callable, so pass `texts_identity`, e.g. corpus_identity(train_docs)).
      A damaged cache file is trained again; `on_train` is called after any training.
    spec "*.json": a Hugging Face tokenizer.json.
    any other path: a tiktoken BPE file (regex and special tokens of Meta's 128K-vocabulary release).
    `vocab_size` only applies to "builtin"; read `.vocab_size` of the result.
    """
    if spec == "builtin":
        return _builtin(train_texts, vocab_size, cache_dir, texts_identity, on_train)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise UserError(
            f"data.tokenizer={spec!r}: no such file; use 'builtin', a tokenizer.json path "
            "or a tiktoken BPE file path"
        )
    if path.suffix == ".json":
        return _hf_json(path)
    return _tiktoken(path)


def file_vocab_size(path: Path) -> int | None:
    """The vocabulary size of a tokenizer.json or tiktoken file, read without building the tokenizer (as
    `build_tokenizer` would size it); None when the file does not parse (building it names the problem)."""
    if path.suffix == ".json":
        try:
            return _hf_vocab_size(tokenizers.Tokenizer.from_file(str(path)))
        except Exception:  # tokenizers raises a bare Exception on bad JSON
            return None
    try:
        ranks = [int(line.split()[1]) for line in path.read_bytes().splitlines() if line.strip()]
    except (ValueError, IndexError):
        return None
    return max(ranks) + 1 + LLAMA3_NUM_SPECIAL if ranks else None


def tokenizer_file_shares_bos_eos(spec: str) -> bool:
    """Whether data.tokenizer is a tokenizer.json on this machine whose bos token is its eos token (e.g. GPT-2's
    <|endoftext|>); False for the built-in BPE, a tiktoken file (distinct specials) or a file not here."""
    path = Path(spec).expanduser()
    if spec == "builtin" or path.suffix != ".json" or not path.is_file():
        return False
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception:  # tokenizers raises a bare Exception on bad JSON; building the tokenizer names the problem
        return False
    bos = _find_id(tok, _BOS_NAMES)
    return bos is not None and bos == _find_id(tok, _EOS_NAMES)


def check_tokenizer_file_fits(data: DataConfig, model_vocab_size: int) -> None:
    """ConfigError when data.tokenizer is a file with more ids than the model's embedding. A file that is not on this
    machine is not read: a dry run plans a cluster's run whose paths may exist only there, and the run checks it."""
    if data.tokenizer == "builtin":
        return
    path = Path(data.tokenizer).expanduser()
    size = file_vocab_size(path) if path.is_file() else None
    if size is not None and size > model_vocab_size:
        raise ConfigError(
            f"data.tokenizer = {data.tokenizer!r} has {size} tokens, more than the model's vocab_size "
            f"{model_vocab_size}; use a tokenizer of at most {model_vocab_size} tokens or a model flavour with a larger "
            "vocabulary"
        )


def check_builtin_vocab_fits(data: DataConfig, model_vocab_size: int) -> None:
    """ConfigError when the built-in BPE a training run trains (up to data.vocab_size ids) may outgrow the model's
    embedding. Only a run that trains the tokenizer, or its dry run, asks: a plan of layouts, `eval` and `generate`
    use a tokenizer that exists."""
    if data.tokenizer == "builtin" and data.vocab_size > model_vocab_size:
        raise ConfigError(
            f"data.vocab_size = {data.vocab_size} exceeds the model's vocab_size {model_vocab_size}; lower "
            "data.vocab_size or pick a model flavour with a larger vocabulary"
        )
