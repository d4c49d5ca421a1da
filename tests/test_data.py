"""Data pipeline: corpus reading, tokenizers, token cache, packing, resumable sharded loading."""

from __future__ import annotations

import base64
import threading
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import torch

from meshloom.data.builtin_corpus import (
    Document,
    corpus_identity,
    load_documents,
    read_corpus,
    split_documents,
    stdlib_corpus_dir,
)
from meshloom.data.loader import PackedDataset, StatefulLoader, token_cache_path, tokenize_corpus
from meshloom.data.tokenizer import Tokenizer, build_tokenizer, hash_texts

SAMPLE_TEXT = "def f(x):\n    return x ** 2  # squares\n\n\tcafé naïve 日本語 🙂 <|eos|> end\n"


# ---------------------------------------------------------------- corpus


def test_builtin_corpus_is_sorted_capped_stdlib_prefix():
    root = stdlib_corpus_dir()
    assert (root / "os.py").is_file()

    small = load_documents(None, "ignored", 60_000)
    large = load_documents("", "ignored", 150_000)
    ids = [d.doc_id for d in large]
    assert ids == sorted(ids)
    assert all(d.doc_id.endswith(".py") and "site-packages" not in d.doc_id for d in large)
    assert sum(len(d.text.encode()) for d in small) <= 60_000
    assert sum(len(d.text.encode()) for d in large) <= 150_000
    # A smaller cap reads a prefix of the same order: whole files only.
    assert large[: len(small)] == small and len(large) > len(small)
    assert large[0].text == (root / large[0].doc_id).read_text(encoding="utf-8")


def test_folder_corpus_glob_skips_undecodable_and_empty(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("bravo")
    (tmp_path / "sub" / "a.txt").write_text("alpha")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\xfa not utf-8")
    (tmp_path / "c.md").write_text("not matched")
    docs, note = read_corpus(str(tmp_path), "**/*.txt", None)
    assert docs == [Document("a.txt", "first"), Document("b.txt", "bravo"), Document("sub/a.txt", "alpha")]
    assert note == f"skipped 1 unreadable or non-UTF-8 file(s) in data.path={str(tmp_path)!r} (glob '**/*.txt')"
    assert load_documents(str(tmp_path), "**/*.txt", None) == docs
    # max_bytes keeps whole files in sorted order: a.txt (5) + b.txt (5) fit, sub/a.txt would not.
    assert [d.doc_id for d in load_documents(str(tmp_path), "**/*.txt", 12)] == ["a.txt", "b.txt"]


def test_corpus_errors_name_the_setting(tmp_path):
    with pytest.raises(ValueError, match=r"data\.path='.*missing'.*not an existing folder"):
        load_documents(str(tmp_path / "missing"), "**/*.txt", None)
    with pytest.raises(ValueError, match=r"data\.path: no files match"):
        load_documents(str(tmp_path), "**/*.txt", None)
    (tmp_path / "bad.txt").write_bytes(b"\xc3\x28")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"data\.path: no readable.*2 matched, 1 unreadable"):
        load_documents(str(tmp_path), "*.txt", None)
    (tmp_path / "good.txt").write_text("x" * 100)
    with pytest.raises(ValueError, match=r"data\.max_bytes=50 is smaller"):
        load_documents(str(tmp_path), "*.txt", 50)


def test_corpus_identity_tracks_ids_and_contents():
    docs = [Document("a", "hello"), Document("b", "world")]
    ident = corpus_identity(docs)
    assert ident == corpus_identity([Document("a", "hello"), Document("b", "world")])
    assert ident != corpus_identity([Document("a", "hellp"), Document("b", "world")])  # same size, edited
    assert ident != corpus_identity([Document("a", "hellowo"), Document("b", "rld")])  # boundary moved
    assert ident != corpus_identity([Document("c", "hello"), Document("b", "world")])
    assert ident != corpus_identity(docs[:1])


def test_split_is_deterministic_by_doc_id():
    docs = [Document(f"doc{i}.txt", str(i)) for i in range(400)]
    train, val = split_documents(docs, 0.1)
    assert len(train) + len(val) == 400 and not set(train) & set(val)
    assert train == [d for d in docs if d in set(train)]  # order kept
    assert 20 <= len(val) <= 60
    # Membership depends only on the doc's id, not on which other documents exist.
    sub_train, sub_val = split_documents(docs[::3], 0.1)
    assert set(sub_val) == set(val) & set(docs[::3])
    assert split_documents(docs, 0.0) == (docs, [])
    tiny_train, tiny_val = split_documents(docs[:2], 0.01)
    assert len(tiny_train) == 1 and len(tiny_val) == 1
    with pytest.raises(ValueError, match=r"data\.validation_fraction"):
        split_documents(docs, 1.0)


# ---------------------------------------------------------------- tokenizers


@pytest.fixture(scope="module")
def stdlib_texts() -> list[str]:
    return [d.text for d in load_documents(None, "", 300_000)]


def test_builtin_bpe_round_trip_cache_and_determinism(tmp_path, stdlib_texts):
    tok = build_tokenizer("builtin", stdlib_texts, 400, tmp_path / "c1")
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (400, 0, 1)
    ids = tok.encode(SAMPLE_TEXT)
    assert tok.decode(ids) == SAMPLE_TEXT
    assert tok.bos_id not in ids and tok.eos_id not in ids  # "<|eos|>" in text stays plain text
    assert len(ids) < len(SAMPLE_TEXT.encode())  # merges learned something
    assert tok.encode_batch([SAMPLE_TEXT, "x"]) == [ids, tok.encode("x")]
    assert tok.decode([tok.bos_id]) == "<|bos|>"
    assert len(list((tmp_path / "c1").glob("tokenizer-*.json"))) == 1

    def must_not_be_called() -> list[str]:
        raise AssertionError("a cached tokenizer must not re-read the texts")

    cached = build_tokenizer("builtin", must_not_be_called, 400, tmp_path / "c1",
                             texts_identity=hash_texts(stdlib_texts))
    assert cached.identity == tok.identity and cached.encode(SAMPLE_TEXT) == ids

    # Training is deterministic: a fresh cache dir gives the same vocabulary.
    again = build_tokenizer("builtin", lambda: stdlib_texts, 400, tmp_path / "c2")
    assert again.identity == tok.identity
    # A different vocabulary size is a different cache entry.
    other = build_tokenizer("builtin", stdlib_texts, 300, tmp_path / "c1")
    assert other.vocab_size == 300 and other.identity != tok.identity

    with pytest.raises(ValueError, match=r"data\.vocab_size=100"):
        build_tokenizer("builtin", stdlib_texts, 100, tmp_path / "c3")


def test_hf_tokenizer_json(tmp_path, stdlib_texts):
    from tokenizers import decoders, models, pre_tokenizers, trainers

    def save(specials: list[str], name: str) -> Path:
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(stdlib_texts[:20], trainer=trainer)
        path = tmp_path / name
        tok.save(str(path))
        return path

    path = save(["<unk>", "<s>", "</s>"], "tokenizer.json")
    tok = build_tokenizer(str(path), [], 0, tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 300)
    assert tok.decode(tok.encode(SAMPLE_TEXT)) == SAMPLE_TEXT
    assert tok.identity.startswith("hf-json:")

    no_specials = save([], "plain.json")
    with pytest.raises(ValueError, match=r"data\.tokenizer=.*plain\.json.*cannot find a BOS/EOS"):
        build_tokenizer(str(no_specials), [], 0, tmp_path)


def _write_tiktoken(path: Path, merges: list[bytes]) -> None:
    tokens = [bytes([b]) for b in range(256)] + merges
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(tokens)))


def test_tiktoken_file_reads_locally_and_appends_llama3_specials(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))
    path = tmp_path / "tiny.model"
    _write_tiktoken(path, [b"he", b"ll", b"hell", b"hello", b" w"])
    tok = build_tokenizer(str(path), [], 0, tmp_path)
    assert tok.vocab_size == 261 + 256  # 261 ranks + the 256 Llama 3 special tokens
    assert (tok.bos_id, tok.eos_id) == (261, 262)
    assert tok.encode("hello") == [259]
    assert tok.encode("hello world") == [259, 260, ord("o"), ord("r"), ord("l"), ord("d")]
    assert tok.decode(tok.encode(SAMPLE_TEXT)) == SAMPLE_TEXT
    assert tok.encode("<|begin_of_text|>") == list(b"<|begin_of_text|>")  # specials in text stay text
    assert tok.encode_batch(["hello", "he"]) == [[259], [256]]
    assert tok.decode([tok.bos_id, tok.eos_id]) == "<|begin_of_text|><|end_of_text|>"
    assert not (tmp_path / "tiktoken-cache").exists()  # nothing copied into tiktoken's download cache

    # Rewriting the file at the same path must be picked up (no stale path-keyed cache).
    _write_tiktoken(path, [b"lo"])
    edited = build_tokenizer(str(path), [], 0, tmp_path)
    assert edited.encode("hello") == [ord("h"), ord("e"), ord("l"), 256]
    assert edited.identity != tok.identity


def test_tokenizer_file_errors(tmp_path):
    with pytest.raises(ValueError, match=r"data\.tokenizer='.*nope\.json': no such file"):
        build_tokenizer(str(tmp_path / "nope.json"), [], 0, tmp_path)
    with pytest.raises(ValueError, match=r"data\.tokenizer=.*no-such\.model"):
        build_tokenizer(str(tmp_path / "no-such.model"), [], 0, tmp_path)
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"aGk= 0\nnot-a-line\n")
    with pytest.raises(ValueError, match=r"line 2 is not 'base64token rank'"):
        build_tokenizer(str(bad), [], 0, tmp_path)
    partial = tmp_path / "partial.model"
    partial.write_bytes(b"".join(base64.b64encode(bytes([b])) + b" %d\n" % b for b in range(200)))
    with pytest.raises(ValueError, match=r"56 single-byte tokens missing"):
        build_tokenizer(str(partial), [], 0, tmp_path)


# ---------------------------------------------------------------- token stream


class CharTokenizer(Tokenizer):
    """Tiny deterministic tokenizer that counts its encode calls."""

    def __init__(self, vocab_size: int = 300):
        self.vocab_size, self.bos_id, self.eos_id = vocab_size, vocab_size - 2, vocab_size - 1
        self.identity = f"char-{vocab_size}"
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return [ord(c) % 200 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def test_tokenize_corpus_layout_and_cache(tmp_path):
    tok = CharTokenizer()
    docs = [Document("a", "hi"), Document("b", ""), Document("c", "xyz")]
    tokens = tokenize_corpus(tok, docs, tmp_path)
    b, e = tok.bos_id, tok.eos_id
    expected = [b, ord("h"), ord("i"), e, b, e, b, ord("x"), ord("y"), ord("z"), e]
    assert tokens.dtype == np.uint16 and tokens.tolist() == expected
    assert token_cache_path(tok, docs, tmp_path).is_file()

    calls = tok.calls
    cached = tokenize_corpus(tok, docs, tmp_path)
    assert tok.calls == calls and cached.tolist() == expected
    # Another tokenizer or corpus gets its own entry.
    assert tokenize_corpus(CharTokenizer(70_000), docs, tmp_path).dtype == np.uint32
    assert tokenize_corpus(tok, docs[:1], tmp_path).tolist() == expected[:4]
    assert len(list(tmp_path.glob("tokens-*.npy"))) == 3


def test_tokenize_corpus_concurrent_writers_are_safe(tmp_path):
    docs = [Document(str(i), "abc" * (i + 1)) for i in range(200)]
    expected = tokenize_corpus(CharTokenizer(), docs, tmp_path / "ref").tolist()
    results, errors = [], []

    def worker() -> None:
        try:
            results.append(tokenize_corpus(CharTokenizer(), docs, tmp_path / "race").tolist())
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [expected] * 6
    assert [p.name for p in (tmp_path / "race").iterdir()] == [token_cache_path(CharTokenizer(), docs, tmp_path).name]


def test_packed_dataset_windows():
    tokens = np.arange(23, dtype=np.uint16)
    ds = PackedDataset(tokens, seq_len=5)
    assert len(ds) == 4  # (23 - 1) // 5
    x, y = ds.sample(1)
    assert x.dtype == torch.int64 and x.tolist() == [5, 6, 7, 8, 9] and y.tolist() == [6, 7, 8, 9, 10]
    # Windows tile the stream: every token but the first is a label exactly once (up to the tail).
    labels = torch.cat([ds.sample(i)[1] for i in range(len(ds))])
    assert labels.tolist() == list(range(1, 21))
    with pytest.raises(IndexError):
        ds.sample(4)
    with pytest.raises(ValueError, match=r"fewer than seq_len\+1=24.*training\.seq_len"):
        PackedDataset(tokens, seq_len=23)


# ---------------------------------------------------------------- loader


def _dataset(num_samples: int = 10, seq_len: int = 4) -> PackedDataset:
    return PackedDataset(np.arange(num_samples * seq_len + 1, dtype=np.uint32) % 60_000, seq_len)


def _take(loader: StatefulLoader, steps: int) -> list[int]:
    return [i for _ in range(steps) for i in loader.next_batch().sample_ids.tolist()]


def test_loader_global_order_and_batch_contents():
    ds = _dataset()
    loader = StatefulLoader(ds, local_batch_size=3, dp_rank=0, dp_size=1, seed=7)
    ids = _take(loader, 7)  # 21 positions: epochs 0, 1 and the start of 2, blocks span the boundaries
    assert ids[:10] == np.random.default_rng(7).permutation(10).tolist()
    assert ids[10:20] == np.random.default_rng(8).permutation(10).tolist()
    assert ids[20] == np.random.default_rng(9).permutation(10)[0]
    assert loader.state_dict() == {"consumed": 21, "seed": 7, "num_samples": 10} and loader.epoch == 2

    batch = StatefulLoader(ds, 3, 0, 1, seed=7).next_batch()
    assert batch.inputs.shape == batch.labels.shape == (3, 4) and batch.inputs.dtype == torch.int64
    for row, sid in enumerate(batch.sample_ids.tolist()):
        x, y = ds.sample(sid)
        assert torch.equal(batch.inputs[row], x) and torch.equal(batch.labels[row], y)

    plain = StatefulLoader(ds, 4, 0, 1, seed=7, shuffle=False)
    assert _take(plain, 3) == list(range(10)) + [0, 1]


def test_loader_dp_ranks_cover_the_global_block_exactly():
    ds = _dataset(num_samples=37)
    reference = StatefulLoader(ds, local_batch_size=8, dp_rank=0, dp_size=1, seed=3)
    ranks = [StatefulLoader(ds, local_batch_size=2, dp_rank=r, dp_size=4, seed=3) for r in range(4)]
    for _ in range(6):  # crosses the epoch boundary at 37
        per_rank = [loader.next_batch().sample_ids.tolist() for loader in ranks]
        assert sum(per_rank, []) == reference.next_batch().sample_ids.tolist()
        assert len({loader.consumed for loader in ranks}) == 1
    assert ranks[0].consumed == reference.consumed == 48


def test_loader_resume_is_exact():
    ds = _dataset(num_samples=13)
    loader = StatefulLoader(ds, 2, 1, 2, seed=5)
    _take(loader, 4)
    state = loader.state_dict()
    expected = [loader.next_batch() for _ in range(5)]

    resumed = StatefulLoader(ds, 2, 1, 2, seed=999)  # seed comes from the checkpoint
    resumed.load_state_dict(state)
    for want in expected:
        got = resumed.next_batch()
        assert torch.equal(got.inputs, want.inputs) and torch.equal(got.labels, want.labels)
        assert torch.equal(got.sample_ids, want.sample_ids)


@pytest.mark.parametrize(("before", "after"), [((2, 3), (1, 6)), ((1, 2), (4, 2)), ((2, 2), (3, 1))])
def test_loader_resume_under_new_dp_size_repeats_and_skips_nothing(before, after):
    ds = _dataset(num_samples=50)
    stream = _take(StatefulLoader(ds, 1, 0, 1, seed=11), 50)  # one epoch, one sample at a time

    (dp_a, lb_a), (dp_b, lb_b) = before, after
    ranks = [StatefulLoader(ds, lb_a, r, dp_a, seed=11) for r in range(dp_a)]
    seen = []
    for _ in range(3):
        seen += sum((loader.next_batch().sample_ids.tolist() for loader in ranks), [])
    state = ranks[0].state_dict()

    resumed = [StatefulLoader(ds, lb_b, r, dp_b, seed=11) for r in range(dp_b)]
    for loader in resumed:
        loader.load_state_dict(state)
    while len(seen) + dp_b * lb_b <= 50:
        seen += sum((loader.next_batch().sample_ids.tolist() for loader in resumed), [])
    assert seen == stream[: len(seen)] and len(set(seen)) == len(seen)


def test_loader_rejects_bad_state_and_arguments():
    loader = StatefulLoader(_dataset(num_samples=10), 2, 0, 1, seed=0)
    with pytest.raises(ValueError, match=r"saved for 11 samples but the dataset has 10"):
        loader.load_state_dict({"consumed": 4, "seed": 0, "num_samples": 11})
    with pytest.raises(ValueError, match=r"missing \['seed'\]"):
        loader.load_state_dict({"consumed": 4, "num_samples": 10})
    with pytest.raises(ValueError, match=r"dp_rank=2, dp_size=2"):
        StatefulLoader(_dataset(), 2, 2, 2, seed=0)
