"""`meshloom prepare`: sources, shard layout, metadata, determinism, resume/repair, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from meshloom.config.schema import DataConfig
from meshloom.cli.prepare import main
from meshloom.data.prepare import PrepareOptions, prepare
from meshloom.data.shard_format import ShardSet
from shard_fixtures import document, load_tokenizer, tokenizer_json, write_jsonl

TEXTS = [document(i) for i in range(60)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(tokenizer_json(tmp_path_factory.mktemp("tok")))


def run(inputs: list[Path], out: Path, tokenizer, bad_input: str = "error", text_field: str = "text", **options):
    data = DataConfig(bad_input=bad_input, text_field=text_field)
    options.setdefault("shard_tokens", 500)
    return prepare(PrepareOptions([str(p) for p in inputs], out, progress=False, **options), data, tokenizer)


def documents_in(folder: Path, tokenizer) -> list[str]:
    """Decode every document of a prepared folder, checking its bos/eos framing."""
    shards = ShardSet(folder)
    texts = []
    for d in range(shards.num_documents):
        ids = shards.piece(d, 0, int(shards.doc_len[d])).tolist()
        assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
        texts.append(tokenizer.decode(ids[1:-1]))
    return texts


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_every_source_kind_in_order_with_metadata(tmp_path, tokenizer):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "in"
    write_jsonl(folder / "b.jsonl", TEXTS[10:20])
    write_jsonl(folder / "a.jsonl", TEXTS[:10])  # a folder's files are read in sorted order
    (folder / "c.txt").write_text(TEXTS[20])  # one .txt file = one document
    pq.write_table(pa.table({"text": TEXTS[21:30], "n": list(range(9))}), tmp_path / "d.parquet", row_group_size=4)
    datasets.Dataset.from_dict({"body": TEXTS[30:40]}).save_to_disk(str(tmp_path / "saved"))
    out = tmp_path / "shards"

    data = DataConfig(text_field="body")
    with pytest.raises(ValueError, match=r"d\.parquet row 0: no text field 'body' \(data\.text_field\)"):
        prepare(PrepareOptions([str(tmp_path / "d.parquet")], out, shard_tokens=3000, progress=False), data, tokenizer)
    meta = run([folder, tmp_path / "d.parquet"], tmp_path / "shards2", tokenizer)
    assert documents_in(tmp_path / "shards2", tokenizer) == TEXTS[:30]
    saved = run([tmp_path / "saved"], tmp_path / "shards3", tokenizer, text_field="body")
    assert documents_in(tmp_path / "shards3", tokenizer) == TEXTS[30:40] and saved["sources"][0]["kind"] == "hf_disk"

    assert meta["tokenizer"] == {"identity": tokenizer.identity, "vocab_size": 320, "bos_id": 0, "eos_id": 1}
    assert meta["dtype"] == "uint16" and meta["documents"] == 30
    assert [(s["name"].split("/")[-1], s["kind"], s["documents"]) for s in meta["sources"]] == [
        ("a.jsonl", "jsonl", 10), ("b.jsonl", "jsonl", 10), ("c.txt", "txt", 1), ("d.parquet", "parquet", 9)
    ]
    shards = meta["shards"]
    assert len(shards) > 3 and all(s["tokens"] <= 500 for s in shards)
    assert meta["tokens"] == sum(s["tokens"] for s in shards) == sum(s["tokens"] for s in meta["sources"])
    # Raw files: little-endian tokens and int64 document offsets, no header.
    first = shards[0]
    raw = np.fromfile(tmp_path / "shards2" / "shard_00000.bin", dtype="<u2")
    offsets = np.fromfile(tmp_path / "shards2" / "shard_00000.idx", dtype="<i8")
    assert len(raw) == first["tokens"] and offsets[0] == 0 and offsets[-1] == len(raw) and len(offsets) == first["documents"] + 1
    assert raw[offsets[:-1]].tolist() == [0] * first["documents"]  # every document starts with bos


def test_byte_identical_for_any_number_of_workers(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "in.jsonl", TEXTS * 3)
    one = run([source], tmp_path / "one", tokenizer, workers=1)
    two = run([source], tmp_path / "two", tokenizer, workers=2)
    assert one == two and len(one["shards"]) > 5
    assert folder_bytes(tmp_path / "one") == folder_bytes(tmp_path / "two")


def test_resume_skips_finished_shards_and_repairs_a_damaged_one(tmp_path, tokenizer, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    run([source], tmp_path / "whole", tokenizer)
    expected = folder_bytes(tmp_path / "whole")

    out = tmp_path / "out"
    assert run([source], out, tokenizer, stop_after=2) is None
    assert sorted(p.name for p in out.glob("*.bin")) == ["shard_00000.bin", "shard_00001.bin"]
    assert not (out / "meta.json").exists()
    with pytest.raises(ValueError, match=r"no meta\.json \(prepare did not finish: rerun it to resume\)"):
        ShardSet(out)
    first = (out / "shard_00000.bin").stat()

    encoded: list[str] = []
    original = tokenizer.encode_batch
    tokenizer.encode_batch = lambda texts: (encoded.extend(texts), original(texts))[1]
    try:
        run([source], out, tokenizer)
    finally:
        del tokenizer.encode_batch
    assert folder_bytes(out) == expected
    assert (out / "shard_00000.bin").stat().st_ino == first.st_ino  # kept, not rewritten
    meta = json.loads((out / "meta.json").read_text())
    done_docs = sum(s["documents"] for s in meta["shards"][:2])
    assert encoded == TEXTS[done_docs:]  # only what the finished shards did not hold was tokenized

    run([source], out, tokenizer)
    assert "already complete" in capsys.readouterr().out

    # A truncated shard is found on open, and a rerun rewrites it (and those after it).
    damaged = out / "shard_00002.bin"
    damaged.write_bytes(damaged.read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"shard_00002\.bin is truncated \(\d+ bytes, expected \d+\); rerun `meshloom prepare`"):
        ShardSet(out)
    run([source], out, tokenizer)
    assert "shard_00002 is damaged or missing" in capsys.readouterr().err
    assert folder_bytes(out) == expected

    # Same size, other bytes: only --verify (sha256) sees it.
    damaged.write_bytes(bytes(len(damaged.read_bytes())))
    run([source], out, tokenizer, verify=True)
    assert folder_bytes(out) == expected

    with pytest.raises(ValueError, match=r"holds shards made from other inputs or settings"):
        run([source], out, tokenizer, shard_tokens=600)


def test_an_output_folder_inside_the_input_folder_is_not_read_back(tmp_path, tokenizer):
    write_jsonl(tmp_path / "in" / "a.jsonl", TEXTS[:5])
    first = run([tmp_path / "in"], tmp_path / "in" / "shards", tokenizer)
    assert first == run([tmp_path / "in"], tmp_path / "in" / "shards", tokenizer)  # meta.json is not an input
    assert [s["name"] for s in first["sources"]] == [str(tmp_path / "in" / "a.jsonl")]


BAD_LINES = {
    "non_utf8": (b'{"text": "caf\xe9"}\n', r"line 2: not valid UTF-8 \(invalid continuation byte at byte 13\)"),
    "invalid_json": (b'{"text": "unterminated\n', r"line 2: not valid JSON \(.*\)"),
    "missing_text": (b'{"title": "no text"}\n', r"line 2: no text field 'text' \(data\.text_field\)"),
    "empty": (b'{"text": ""}\n', r"line 2: empty document"),
    "too_long": (json.dumps({"text": document(99, words=900)}).encode() + b"\n", r"line 2: \d+ tokens, more than one shard holds \(--shard-tokens 500\)"),
}


@pytest.mark.parametrize("kind", list(BAD_LINES))
def test_bad_input_is_an_error_naming_the_line_or_a_counted_skip(tmp_path, tokenizer, kind):
    line, message = BAD_LINES[kind]
    good = [json.dumps({"text": t}).encode() + b"\n" for t in TEXTS[:6]]
    source = tmp_path / "in.jsonl"
    source.write_bytes(good[0] + line + b"".join(good[1:]))

    with pytest.raises(ValueError, match=rf"in\.jsonl {message}; fix the input, or set data\.bad_input = \"skip\""):
        run([source], tmp_path / "strict", tokenizer)
    meta = run([source], tmp_path / "lenient", tokenizer, bad_input="skip")
    assert meta["skipped"] == {k: int(k == kind) for k in BAD_LINES}
    assert meta["sources"][0]["skipped"] == meta["skipped"]
    assert documents_in(tmp_path / "lenient", tokenizer) == TEXTS[:6]  # nothing else lost


def test_command_line(tmp_path, capsys):
    tok = tokenizer_json(tmp_path)
    source = write_jsonl(tmp_path / "in.jsonl", TEXTS[:20])
    argv = [str(source), "--data.tokenizer", str(tok), "--output", str(tmp_path / "out"), "--workers=1", "--no-progress"]
    assert main(argv + ["--shard-tokens", "2000"]) == 0
    assert "prepare: 20 documents" in capsys.readouterr().out
    assert ShardSet(tmp_path / "out").num_documents == 20
    assert main([str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o2"), "--data.tokenizer", str(tok)]) == 2
    assert "missing.jsonl: no such file or folder" in capsys.readouterr().err
