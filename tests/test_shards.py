"""Training over prepared shards: split, packing, seeded sampling, mixing, dp sharding, exact resume."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from meshloom.data.loader import PackedDataset, StatefulLoader, document_ids_between
from meshloom.data.mixing import MixSchedule, apportion
from meshloom.data.shard_format import ShardSet
from meshloom.data.shards import (
    PackedDocuments,
    ShardLoader,
    ShardSource,
    build_shard_loaders,
    check_shard_folders,
    held_out,
    parse_shards_setting,
)
from shard_fixtures import Numbered, load_tokenizer, numbered_texts, prepared, tokenizer_json

SEQ = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    return {
        "a": prepared(root / "a", Numbered(), numbered_texts(40), shard_tokens=100),
        "b": prepared(root / "b", Numbered(), numbered_texts(25, first=100), shard_tokens=100),
    }


def doc_of(shards: ShardSet, d: int) -> np.ndarray:
    return shards.piece(d, 0, int(shards.doc_len[d]))


def test_shard_set_reads_documents_across_shards(folders):
    shards = ShardSet(folders["a"])
    assert shards.num_documents == 40 and len(shards.meta["shards"]) > 3
    for d, text in enumerate(numbered_texts(40)):
        number, length = map(int, text.split())
        assert doc_of(shards, d).tolist() == [0] + [number] * length + [1]
    assert shards.num_tokens == int(shards.doc_len.sum())


def test_tokenizer_mismatch_names_both(folders, tmp_path):
    other = load_tokenizer(tokenizer_json(tmp_path))
    with pytest.raises(ValueError, match=rf"prepared with tokenizer numbered but this run's tokenizer \(data\.tokenizer='x\.json'\) is {other.identity}"):
        ShardSet(folders["a"]).check_tokenizer(other, "x.json")


def test_held_out_split_is_a_stable_hash_of_the_index():
    split = held_out(10_000, 0.1)
    assert 900 < split.sum() < 1100
    assert (held_out(5_000, 0.1) == split[:5_000]).all()  # appending documents moves none across
    assert held_out(100, 0.0).sum() == 0
    assert held_out(2, 0.001).tolist().count(True) == 1  # each side gets at least one


def test_packing_and_document_ids_follow_the_order(folders):
    shards = ShardSet(folders["a"])
    order = np.array([5, 2, 9, 0, 1, 3])
    stream = np.concatenate([doc_of(shards, d) for d in order])
    boundaries = np.concatenate([[0], np.cumsum(shards.doc_len[order])])
    packed = PackedDocuments(shards, order, SEQ)
    assert packed.num_samples == (len(stream) - 1) // SEQ
    for i in range(packed.num_samples):
        window = packed.window(i, with_ids=True)
        a = i * SEQ
        assert window.tokens.tolist() == stream[a:a + SEQ + 1].tolist()
        assert window.document_ids.tolist() == document_ids_between(boundaries[:-1], a, a + SEQ + 1).tolist()
        # Numbered documents: equal ids <=> same document number.
        inner = window.tokens > 1
        pairs = set(zip(window.document_ids[inner].tolist(), window.tokens[inner].tolist()))
        assert len(pairs) == len({p[0] for p in pairs})


def test_builtin_dataset_document_ids_from_starts():
    tokens = np.array([0, 5, 5, 1, 0, 6, 1, 0, 7, 7, 7, 1], dtype=np.uint16)
    ds = PackedDataset(tokens, 5, doc_starts=np.flatnonzero(tokens == 0))
    assert ds.document_ids(0).tolist() == [0, 0, 0, 0, 1, 1]
    assert ds.document_ids(1).tolist() == [0, 0, 1, 1, 1, 1]
    loader = StatefulLoader(ds, 2, 0, 1, seed=0, shuffle=False, document_mask=True)
    batch = loader.next_batch()
    assert batch.document_ids.tolist() == [[0, 0, 0, 0, 1], [0, 0, 1, 1, 1]]


@pytest.mark.parametrize("sampling", ["document", "chunk"])
def test_each_epoch_uses_every_token_once_in_a_seeded_order(folders, sampling):
    shards = ShardSet(folders["a"])
    docs = np.arange(shards.num_documents)
    source = ShardSource(shards, docs, SEQ, sampling, seed=3, index=0)
    n = source.num_samples
    stored = [source.stored.window(i, False).tokens for i in range(n)]

    def epoch(e: int, src: ShardSource) -> list[np.ndarray]:
        return [src.window(e * n + i).tokens for i in range(n)]

    first, second = epoch(0, source), epoch(1, source)
    again = epoch(0, ShardSource(shards, docs, SEQ, sampling, seed=3, index=0))
    reseeded = epoch(0, ShardSource(shards, docs, SEQ, sampling, seed=4, index=0))
    assert all((x == y).all() for x, y in zip(first, again))
    assert not all((x == y).all() for x, y in zip(first, second))
    assert not all((x == y).all() for x, y in zip(first, reseeded))
    if sampling == "chunk":  # the same windows, permuted
        assert sorted(w.tobytes() for w in first) == sorted(w.tobytes() for w in stored)
    else:  # whole documents back to back in a new order, each once
        stream = np.concatenate([w[:-1] for w in first])
        starts = np.flatnonzero(stream == 0)
        docs = [stream[a:b] for a, b in zip(starts, [*starts[1:], len(stream)])]
        lengths = {int(t.split()[0]): int(t.split()[1]) for t in numbered_texts(40)}
        numbers = [int(d[1]) for d in docs[:-1]]
        assert len(numbers) == len(set(numbers)) and numbers != sorted(numbers)
        assert all(d.tolist() == [0] + [k] * lengths[k] + [1] for d, k in zip(docs, numbers))


def test_mixing_realizes_weights_exactly_per_block():
    assert apportion([3, 1], 4096) == [3072, 1024]
    assert apportion([1, 1, 1], 10) == [4, 3, 3]
    schedule = MixSchedule([3.0, 1.0, 0.5], seed=1, block=900)
    located = [schedule.locate(p) for p in range(2 * 900)]
    per_block = Counter(k for k, _ in located[:900])
    assert per_block == {0: 600, 1: 200, 2: 100}
    for k in range(3):  # each source's own positions come in order, none skipped or repeated
        assert [q for s, q in located if s == k] == list(range(2 * per_block[k]))
    assert located == [MixSchedule([3.0, 1.0, 0.5], seed=1, block=900).locate(p) for p in range(1800)]
    assert located[:900] != [MixSchedule([3.0, 1.0, 0.5], seed=2, block=900).locate(p) for p in range(900)]
    with pytest.raises(ValueError, match=r"weight 0\.0001 of source 1 is below 1/4096"):
        MixSchedule([1.0, 0.0001], seed=0)


def test_missing_or_unfinished_folders_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"data\.shards: folder .*nope not found; make it with `meshloom prepare"):
        check_shard_folders(f"{tmp_path / 'nope'}:2")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty has no meta\.json; make the folder with `meshloom prepare"):
        check_shard_folders(str(tmp_path / "empty"))


def test_shards_setting_parses_weights():
    assert parse_shards_setting("a, b:3 ,c:0.5") == [("a", 1.0), ("b", 3.0), ("c", 0.5)]
    assert parse_shards_setting("dir:with:colons") == [("dir:with:colons", 1.0)]
    with pytest.raises(ValueError, match=r"weight of b must be positive, got -1"):
        parse_shards_setting("a,b:-1")
    with pytest.raises(ValueError, match=r"data\.shards is empty"):
        parse_shards_setting(" , ")


def _loaders(folders, dp: int, local: int, seed: int = 5, sampling: str = "document", mask: bool = False, held: float = 0.1):
    built = [
        build_shard_loaders(f"{folders['a']}:3,{folders['b']}", sampling, held, mask, SEQ, local, r, dp, seed, lambda s: None)
        for r in range(dp)
    ]
    return [t for t, _ in built], [v for _, v in built]


def _global_batch(ranks: list[ShardLoader]) -> list[bytes]:
    return [row.numpy().tobytes() for loader in ranks for row in loader.next_batch().inputs]


@pytest.mark.parametrize("sampling", ["document", "chunk"])
def test_dp_ranks_split_the_global_batch_and_resume_under_another_degree(folders, sampling):
    (reference,), _ = _loaders(folders, dp=1, local=1, sampling=sampling, held=0.0)
    total = 120  # about two epochs of the smaller source
    stream = [reference.next_batch().inputs[0].numpy().tobytes() for _ in range(total)]

    ranks, _ = _loaders(folders, dp=3, local=2, sampling=sampling, held=0.0)
    seen = []
    for _ in range(7):
        seen += _global_batch(ranks)
    state = ranks[0].state_dict()
    assert all(r.state_dict() == state for r in ranks) and state["consumed"] == 42

    resumed, _ = _loaders(folders, dp=2, local=4, seed=999, sampling=sampling, held=0.0)  # the seed comes from the state
    for loader in resumed:
        loader.load_state_dict(state)
    while len(seen) + 8 <= total:
        seen += _global_batch(resumed)
    # Exactly the single-process order: nothing repeated, nothing skipped, across the change of degree.
    assert seen == stream[: len(seen)] and len(seen) == 114


def test_mixed_loader_draws_sources_by_weight_and_checks_state(folders):
    (loader,), (validation,) = _loaders(folders, dp=1, local=8, mask=True, held=0.4)
    located = Counter(loader.locate(p)[0] for p in range(4096))
    assert located == {0: 3072, 1: 1024}
    batch = loader.next_batch()
    assert batch.document_ids.shape == batch.inputs.shape and batch.document_ids.dtype.is_signed
    # Validation reads the held-out documents in stored order, the same batches after a rewind.
    first = validation.next_batch().inputs.clone()
    validation.next_batch()
    validation.rewind()
    assert (validation.next_batch().inputs == first).all()

    state = loader.state_dict()
    (other,), _ = _loaders(folders, dp=1, local=8, sampling="chunk", held=0.4)
    with pytest.raises(ValueError, match=r"saved for other data \(sampling differ"):
        other.load_state_dict(state)
