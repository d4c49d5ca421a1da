"""The held-out text of `meshloom eval`: documents -> one token stream -> windows, and the bytes they hold.

Documents are tokenized as in training, `[bos] ids [eos]` each, concatenated, and cut into windows of seq_len
inputs; window i predicts stream positions i*seq_len+1 ... (i+1)*seq_len. The last window is padded and its
padding is ignored, so every token after the first is predicted exactly once and the evaluated bytes are all
the documents' bytes.

Bytes per token: a text token accounts for the UTF-8 bytes of the text it decodes to, and BOS/EOS for none;
summed over a document that is its UTF-8 size (for prepared shards, the size of the document's tokens
decoded). Bits per byte = total loss in nats / ln 2 / total bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from meshloom.config.errors import UserError
from meshloom.config.schema import DataConfig
from meshloom.data.tokenizer import Tokenizer

IGNORE = -100
VALIDATION = "validation"


@dataclass
class EvalSet:
    name: str
    tokens: np.ndarray  # int64 stream: [bos] ids [eos] per document
    bytes: int  # UTF-8 bytes of every document's text
    documents: int

    def windows(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) [n, seq_len]; labels of the last window's padding are IGNORE."""
        predicted = len(self.tokens) - 1
        n = -(-predicted // seq_len)
        inputs = np.zeros(n * seq_len, dtype=np.int64)
        labels = np.full(n * seq_len, IGNORE, dtype=np.int64)
        inputs[:predicted] = self.tokens[:-1]
        labels[:predicted] = self.tokens[1:]
        return torch.from_numpy(inputs).view(n, seq_len), torch.from_numpy(labels).view(n, seq_len)

    @property
    def predicted_tokens(self) -> int:
        return len(self.tokens) - 1


def _from_texts(name: str, texts: list[str], tokenizer: Tokenizer) -> EvalSet:
    if not texts:
        raise UserError(f"--data {name}: no documents to evaluate")
    pieces = [np.asarray([tokenizer.bos_id, *ids, tokenizer.eos_id], dtype=np.int64) for ids in tokenizer.encode_batch(texts)]
    return EvalSet(name, np.concatenate(pieces), sum(len(t.encode("utf-8")) for t in texts), len(texts))


def _shards(folder: Path, tokenizer: Tokenizer) -> EvalSet:
    from meshloom.data.shard_format import ShardSet  # noqa: PLC0415

    shards = ShardSet(folder)
    if tokenizer.identity != shards.tokenizer_identity:
        raise UserError(
            f"--data {folder}: the shards were prepared with tokenizer {shards.tokenizer_identity}, but the model's is "
            f"{tokenizer.identity}; evaluate text files instead, or prepare the shards with the model's tokenizer"
        )
    pieces, total_bytes = [], 0
    for doc in range(shards.num_documents):
        ids = np.asarray(shards.piece(doc, 0, int(shards.doc_len[doc])), dtype=np.int64)
        pieces.append(ids)
        total_bytes += len(tokenizer.decode([int(t) for t in ids[1:-1]]).encode("utf-8"))
    return EvalSet(str(folder), np.concatenate(pieces), total_bytes, shards.num_documents)


def load_eval_set(specs: list[str], tokenizer: Tokenizer, data: DataConfig, text_field: str = "text") -> EvalSet:
    """`validation` (the held-out split of the run's data.path, or of the built-in corpus), a folder made by
    `meshloom prepare`, or .txt / .jsonl / .json / .parquet files and folders of them."""
    if specs == [VALIDATION]:
        from meshloom.data.builtin_corpus import load_documents, split_documents  # noqa: PLC0415

        docs = load_documents(data.path or None, data.glob, data.max_bytes or None)
        held_out = split_documents(docs, data.validation_fraction or 0.02)[1]
        where = data.path or "the built-in corpus"
        return _from_texts(f"validation split of {where}", [text for _, text in held_out], tokenizer)
    if len(specs) == 1 and (Path(specs[0]) / "meta.json").is_file():
        return _shards(Path(specs[0]), tokenizer)
    from meshloom.data.documents import BadInputPolicy, empty_counts, expand_inputs  # noqa: PLC0415

    try:
        sources = expand_inputs(specs)
    except UserError as err:
        raise UserError(f"--data: {err}; or give '{VALIDATION}' or a `meshloom prepare` folder") from None
    texts, policy, counts = [], BadInputPolicy("error"), empty_counts()
    for source in sources:
        for record in source.records(text_field, "validation"):
            if record.problem is None:
                texts.append(record.text)
            elif record.problem != "empty":
                policy.handle(record, counts)
    return _from_texts(", ".join(specs), texts, tokenizer)
