"""The tokenizer and token caches in data.cache_dir: damaged files are rebuilt with one line saying so, and the
note on unreadable corpus files is said once per corpus (when it is first cached), never by `prepare`."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from meshloom.config.loader import load_config
from meshloom.data import builtin_corpus
from meshloom.data.build import build_data
from meshloom.data.builtin_corpus import stdlib_corpus_dir
from meshloom.cli.prepare import main as prepare_main

SAMPLE = "def f(x):\n    return {'a': x ** 2}  # café\n"


# A slice of the built-in corpus with a held-out split big enough for one batch.
SETTINGS = ["--data.max_bytes", "300000", "--data.vocab_size", "512", "--data.validation_fraction", "0.2"]


def _data_config(cache: Path, *extra: str):
    return load_config([*SETTINGS, "--data.cache_dir", str(cache), *extra]).data


def _build(config) -> tuple[np.ndarray, np.ndarray, list[int]]:
    data = build_data(config, seq_len=64, local_batch_size=4, dp_rank=0, dp_size=1, seed=0)
    return np.array(data.train.dataset.tokens), np.array(data.validation.dataset.tokens), data.tokenizer.encode(SAMPLE)


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_truncated_tokenizer_and_token_caches_are_rebuilt_identically(tmp_path, caplog):
    config = _data_config(tmp_path / "cache")
    train, val, ids = _build(config)
    (tokenizer_file,) = (tmp_path / "cache").glob("tokenizer-*.json")
    token_files = sorted((tmp_path / "cache").glob("tokens-*.npy"))
    assert len(token_files) == 2
    sizes = {p: p.stat().st_size for p in [tokenizer_file, *token_files]}

    # Cut every file the run wrote: the tokenizer in the middle of its JSON, one token stream after its header,
    # the other inside its header.
    for path, keep in ((tokenizer_file, sizes[tokenizer_file] // 2), (token_files[0], 1000), (token_files[1], 40)):
        path.write_bytes(path.read_bytes()[:keep])
    with caplog.at_level(logging.WARNING):
        again = _build(config)
    assert again[0].tolist() == train.tolist() and again[1].tolist() == val.tolist() and again[2] == ids
    messages = [m for m in _messages(caplog) if " cache " in m]  # (not a note on unreadable corpus files)
    assert len(messages) == 3, messages
    assert f"tokenizer cache {tokenizer_file} cannot be read (" in messages[0]
    assert messages[0].endswith("; training the tokenizer again")
    rebuilt = [m for m in messages if m.startswith("token cache ")]
    assert any(f"{token_files[0]} has 1,000 bytes where its header promises" in m for m in rebuilt), rebuilt
    assert any(f"{token_files[1]} is not a readable .npy file" in m for m in rebuilt), rebuilt
    assert all(m.endswith("; rebuilding it") for m in rebuilt)
    assert {p: p.stat().st_size for p in sizes} == sizes  # whole again

    # Sound caches are read without a word.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _build(config)
    assert _messages(caplog) == []


def test_token_cache_with_foreign_contents_is_rebuilt(tmp_path, caplog):
    config = _data_config(tmp_path / "cache")
    train, _, _ = _build(config)
    token_file = next(p for p in (tmp_path / "cache").glob("tokens-*.npy") if len(np.load(p)) == len(train))
    with open(token_file, "wb") as f:  # the right length and dtype, but ids no 512-token vocabulary has
        np.save(f, np.full(len(train), 60000, dtype=np.uint16))
    with caplog.at_level(logging.WARNING):
        assert _build(config)[0].tolist() == train.tolist()
    assert [m for m in _messages(caplog) if "holds id 60000, outside the tokenizer's 512 ids; rebuilding it" in m]
    with open(token_file, "wb") as f:
        np.save(f, np.zeros((2, 3), dtype=np.int64))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert _build(config)[0].tolist() == train.tolist()
    assert any("holds int64 with shape (2, 3), not a 1-D uint16 token stream" in m for m in _messages(caplog))


@pytest.fixture
def corpus_with_a_bad_file(tmp_path, monkeypatch) -> Path:
    """A small built-in corpus (a few real stdlib files) with one file that is not UTF-8."""
    root = tmp_path / "stdlib"
    root.mkdir()
    for name in ("os.py", "argparse.py", "textwrap.py"):
        shutil.copy(stdlib_corpus_dir() / name, root / name)
    (root / "latin1.py").write_bytes("# caf\xe9\n".encode("latin-1"))
    monkeypatch.setattr(builtin_corpus, "stdlib_corpus_dir", lambda: root)
    return root


def test_unreadable_corpus_files_are_noted_once_when_the_corpus_is_first_cached(corpus_with_a_bad_file, tmp_path, caplog):
    note = f"skipped 1 unreadable or non-UTF-8 file(s) in the built-in corpus at {corpus_with_a_bad_file}"
    config = _data_config(tmp_path / "cache")
    with caplog.at_level(logging.WARNING):
        _build(config)  # the first run trains the tokenizer and caches both token streams: said once
    assert _messages(caplog) == [note]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _build(config)  # every later run reads the caches: nothing to say
    assert _messages(caplog) == []


def test_prepare_of_user_files_never_notes_the_builtin_corpus(corpus_with_a_bad_file, tmp_path, caplog, capsys):
    inputs = tmp_path / "docs.jsonl"
    inputs.write_text("".join(json.dumps({"text": f"document {i}: " + SAMPLE * 3}) + "\n" for i in range(20)))
    argv = [str(inputs), "--output", str(tmp_path / "shards"), "--workers", "1", "--no-progress",
            "--data.vocab_size", "512", "--data.cache_dir", str(tmp_path / "fresh-cache")]  # fmt: skip
    with caplog.at_level(logging.WARNING):
        assert prepare_main(argv) == 0  # trains the built-in tokenizer on the corpus above
    assert list((tmp_path / "fresh-cache").glob("tokenizer-*.json"))
    assert _messages(caplog) == [] and "unreadable" not in capsys.readouterr().err


def test_tokenizer_command_saves_the_builtin_tokenizer_for_data_tokenizer(tmp_path, capsys):
    from meshloom.cli import usage
    from meshloom.cli.save_tokenizer import main as tokenizer_main

    assert "tokenizer " in usage()
    settings = [*SETTINGS, "--data.cache_dir", str(tmp_path / "cache")]
    out = tmp_path / "tok.json"
    assert tokenizer_main(["--output", str(out), *settings]) == 0
    assert f"wrote {out}; use it with --data.tokenizer {out}" in capsys.readouterr().out
    assert out.stat().st_mode & 0o777 == 0o644

    builtin = build_data(_data_config(tmp_path / "cache"), 64, 4, 0, 1, 0)
    from_file = build_data(_data_config(tmp_path / "cache", "--data.tokenizer", str(out)), 64, 4, 0, 1, 0)
    for attr in ("vocab_size", "bos_id", "eos_id"):
        assert getattr(from_file.tokenizer, attr) == getattr(builtin.tokenizer, attr)
    assert from_file.tokenizer.encode(SAMPLE + "<|eos|>") == builtin.tokenizer.encode(SAMPLE + "<|eos|>")
    assert np.array_equal(from_file.train.dataset.tokens, builtin.train.dataset.tokens)  # the whole corpus

    # An existing file is kept unless asked; a folder gets tokenizer.json; a tokenizer file needs no saving.
    assert tokenizer_main(["--output", str(out), *settings]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert tokenizer_main(["-o", str(tmp_path), *settings]) == 0 and (tmp_path / "tokenizer.json").read_text() == out.read_text()
    # A missing folder is made, as by every command that writes a file.
    assert tokenizer_main(["-o", str(tmp_path / "new" / "t.json"), *settings]) == 0
    assert (tmp_path / "new" / "t.json").read_bytes() == out.read_bytes()
    assert tokenizer_main(["-o", str(tmp_path / "t2.json"), *settings, "--data.tokenizer", str(out)]) == 2
    assert "is already a file" in capsys.readouterr().err


def test_the_tokenizer_commands_suggestion_is_accepted_by_the_shipped_recipe(tmp_path, capsys):
    """`meshloom tokenizer --config R` names, beside --data.tokenizer, every setting of R that a run refuses next to a
    tokenizer file (llama3_debug.toml sets data.vocab_size); the run it suggests then passes RunPlan's checks, and
    the recipe as it is would not."""
    from meshloom.cli.save_tokenizer import main as tokenizer_main
    from meshloom.config.errors import ConfigError
    from meshloom.config.loader import load_config
    from meshloom.planning.run_plan import RunPlan

    recipe = Path(__file__).resolve().parents[1] / "configs" / "llama3_debug.toml"
    out = tmp_path / "tok.json"
    small = ["--data.max_bytes", "200000", "--data.cache_dir", str(tmp_path / "cache")]
    assert tokenizer_main(["--config", str(recipe), "--output", str(out), *small]) == 0
    line = capsys.readouterr().out.strip()
    assert line == (f"wrote {out}; use it with --data.tokenizer {out}, and drop data.vocab_size from the run's settings "
                    "(beside a tokenizer file a run refuses it)")  # fmt: skip
    with pytest.raises(ConfigError, match=r"^data.vocab_size = 2048 has no effect"):
        RunPlan.build(load_config(["--config", str(recipe), *small, "--data.tokenizer", str(out)]), 1)
    followed = tmp_path / "recipe.toml"
    followed.write_text("".join(l for l in recipe.read_text().splitlines(keepends=True) if not l.startswith("vocab_size")))
    RunPlan.build(load_config(["--config", str(followed), *small, "--data.tokenizer", str(out)]), 1)
    # Without such a setting the line names nothing to drop.
    assert tokenizer_main(["--config", str(followed), "--output", str(tmp_path / "t2.json"), *small]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 't2.json'}; use it with --data.tokenizer {tmp_path / 't2.json'}"

