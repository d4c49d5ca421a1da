"""Streaming over `datasets` (local json files through the json builder): packing, bad input, exact resume."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshloom.data.streaming import ReplayedLoader, StreamingLoader, is_held_out
from shard_fixtures import Numbered, numbered_texts, write_jsonl

SEQ = 16
TEXTS = numbered_texts(45)


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    """Three json-lines files; the first also holds one record of each bad kind."""
    root = tmp_path_factory.mktemp("stream")
    lines = [json.dumps({"text": t}).encode() for t in TEXTS[:15]]
    bad = [b'{"text": "7 4 caf\xe9"}', b'{"title": "no text"}', b'{"text": ""}']
    (root / "part0.jsonl").write_bytes(b"\n".join(lines[:10] + bad + lines[10:]) + b"\n")
    write_jsonl(root / "part1.jsonl", TEXTS[15:30])
    write_jsonl(root / "part2.jsonl", TEXTS[30:])
    return root


def loader(stream, local: int = 2, rank: int = 0, dp: int = 1, **kwargs) -> StreamingLoader:
    kwargs.setdefault("bad_input", "skip")
    return StreamingLoader(str(stream / "*.jsonl"), Numbered(), SEQ, local, rank, dp, **kwargs)


def packed(texts: list[str]) -> np.ndarray:
    tok = Numbered()
    return np.concatenate([[0, *tok.encode(t), 1] for t in texts])


def rows(batches) -> list[list[int]]:
    return [row for b in batches for row in b.inputs.tolist()]


def test_documents_are_packed_in_stream_order_and_bad_ones_counted(stream):
    stream_loader = loader(stream, local=4, document_mask=True)
    batches = [stream_loader.next_batch() for _ in range(2)]
    expected = packed(TEXTS)
    for i, row in enumerate(rows(batches)):
        assert row == expected[i * SEQ:(i + 1) * SEQ].tolist()
    assert stream_loader.skipped == {"non_utf8": 0, "invalid_json": 0, "missing_text": 0, "empty": 0, "too_long": 0}
    ids = batches[0].document_ids[0].tolist()
    assert ids[0] == 0 and ids == sorted(ids) and batches[0].document_ids.shape == (4, SEQ)

    # Reading on past the bad records: each is counted once, by kind, and nothing else is lost.
    everything = [stream_loader.next_batch() for _ in range(10)]
    assert stream_loader.skipped == {"non_utf8": 1, "invalid_json": 0, "missing_text": 1, "empty": 1, "too_long": 0}
    assert rows(batches + everything)[: len(expected) // SEQ] == [
        expected[i * SEQ:(i + 1) * SEQ].tolist() for i in range(len(expected) // SEQ)
    ]

    assert len(packed(TEXTS[:10])) > 2 * 4 * SEQ  # so the first two batches ended before the bad records
    strict = loader(stream, local=4, bad_input="error")
    with pytest.raises(ValueError, match=r"record 10 of rank 0's part, epoch 0: holds undecodable bytes .*data\.bad_input = \"skip\""):
        for _ in range(20):
            strict.next_batch()


def test_a_file_with_new_fields_is_a_clear_error(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", TEXTS[:3])
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": TEXTS[3], "source": "web"}) + "\n")
    reader = loader(tmp_path)
    with pytest.raises(ValueError, match=r"(?s)failed after record 3 .*needs the fields of the first file in every file"):
        for _ in range(5):
            reader.next_batch()


def test_resume_continues_at_the_exact_token_also_across_epochs(stream):
    first = loader(stream, local=3)
    for _ in range(5):
        first.next_batch()
    state = first.state_dict()
    assert state["offset"] > 0  # mid-document, so the resume point is a real test
    expected = [first.next_batch() for _ in range(12)]  # runs past the end of the stream into epoch 1
    assert first.state_dict()["epoch"] == 1

    resumed = loader(stream, local=3)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # the state survives a JSON round trip
    assert rows(resumed.next_batch() for _ in range(12)) == rows(expected)
    assert resumed.skipped == first.skipped

    with pytest.raises(ValueError, match=r"saved with dp_size=1, this run has 2; .*seq_len and data-parallel degree"):
        loader(stream, local=3, rank=0, dp=2).load_state_dict(state)


def test_ranks_read_disjoint_parts_and_validation_is_held_out(stream):
    tokens = [set() for _ in range(2)]
    for rank in range(2):
        part = loader(stream, local=4, rank=rank, dp=2)
        for row in rows(part.next_batch() for _ in range(2)):
            tokens[rank] |= {t for t in row if t > 1}
    assert tokens[0] and tokens[1] and not tokens[0] & tokens[1]

    held = [t for t in TEXTS if is_held_out(t, 0.3)]
    assert 0 < len(held) < len(TEXTS)
    validation = ReplayedLoader(loader(stream, local=2, validation_fraction=0.3, validation=True))
    first = validation.next_batch()
    assert {t for row in first.inputs.tolist() for t in row if t > 1} <= {int(t.split()[0]) for t in held}
    validation.next_batch()
    validation.rewind()
    assert validation.next_batch().inputs.tolist() == first.inputs.tolist()
    training = loader(stream, local=4, validation_fraction=0.3)
    seen = {t for row in rows(training.next_batch() for _ in range(2)) for t in row if t > 1}
    assert not seen & {int(t.split()[0]) for t in held}


def _write_formats(root, texts: list[str]) -> dict[str, str]:
    """The same documents as json lines, Parquet and Arrow (IPC stream) files, two files each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    halves = [texts[: len(texts) // 2], texts[len(texts) // 2:]]
    for i, half in enumerate(halves):
        write_jsonl(root / "jsonl" / f"p{i}.jsonl", half)
        table = pa.table({"text": half})
        (root / "parquet").mkdir(exist_ok=True)
        pq.write_table(table, root / "parquet" / f"p{i}.parquet")
        (root / "arrow").mkdir(exist_ok=True)
        with pa.OSFile(str(root / "arrow" / f"p{i}.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    return {kind: str(root / kind) for kind in ("jsonl", "parquet", "arrow")}


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # a reader thread must end quietly
@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrow"])
def test_formats_and_prefetch_workers_give_the_same_batches_and_resume_exactly(tmp_path, kind):
    spec = _write_formats(tmp_path, TEXTS)[kind]
    expected = packed(TEXTS)

    def make(workers: int) -> StreamingLoader:
        return StreamingLoader(spec, Numbered(), SEQ, 3, 0, 1, workers=workers, document_mask=True)

    plain, prefetched = make(0), make(2)
    for _ in range(4):
        a, b = plain.next_batch(), prefetched.next_batch()
        assert a.inputs.tolist() == b.inputs.tolist() and a.document_ids.tolist() == b.document_ids.tolist()
    assert rows([a])[0] == expected[9 * SEQ:10 * SEQ].tolist()
    state = prefetched.state_dict()
    assert state == plain.state_dict() and state["offset"] > 0  # mid-document although the reader ran ahead
    later = [plain.next_batch() for _ in range(15)]  # into the next epoch
    for workers in (0, 3):  # a state resumes at the same document and token with or without workers
        resumed = make(workers)
        resumed.load_state_dict(json.loads(json.dumps(state)))
        assert rows(resumed.next_batch() for _ in range(15)) == rows(later)


def test_prefetch_hands_a_bad_record_over_where_it_was_read(stream):
    strict = loader(stream, local=4, bad_input="error", workers=2)
    batches = [strict.next_batch() for _ in range(2)]  # the documents before the bad record still arrive
    assert rows(batches)[0] == packed(TEXTS)[:SEQ].tolist()
    with pytest.raises(ValueError, match=r"record 10 of rank 0's part, epoch 0: holds undecodable bytes"):
        for _ in range(20):
            strict.next_batch()
