"""Staged data mixtures over prepared shards: realised shares, exact resume mid-transition under another
data-parallel degree, sources running out (repeat / drop), accounting, and the one-line errors."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from cli_checks import one_line_error
from meshloom.config.loader import load_config
from meshloom.config.schema import DataConfig
from meshloom.data.schedule import Stage, StagedSchedule
from meshloom.data.shards import build_shard_loaders, check_shard_folders
from meshloom.data.stages import build_mixture
from shard_fixtures import Numbered, numbered_texts, prepared

SEQ = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    # Numbered documents: a token tells which document, hence which folder, it came from.
    return {
        "web": prepared(root / "web", Numbered(), numbered_texts(60), shard_tokens=200),
        "code": prepared(root / "code", Numbered(), numbered_texts(25, first=1000), shard_tokens=200),
        "math": prepared(root / "math", Numbered(), numbered_texts(30, first=3000), shard_tokens=200),
    }


def source_of_tokens(tokens: np.ndarray) -> str:
    number = int(tokens[(tokens > 1)][0])
    return "web" if number < 1000 else "code" if number < 3000 else "math"


def _config(folders, stages, **settings) -> DataConfig:
    shards = f"{folders['web']}:3,{folders['code']}:1"
    return DataConfig(dataset="shards", shards=shards + f",{folders['math']}:1", stages=stages, **settings)


def _loaders(folders, config: DataConfig, dp: int, local: int, samples_per_step: int = 1, seed: int = 7):
    mixture = build_mixture(config, samples_per_step, SEQ)
    return [
        build_shard_loaders(config.shards, "document", 0.0, False, SEQ, local, r, dp, seed, lambda s: None,
                            mixture, config.allow_mixture_change)[0]
        for r in range(dp)
    ]  # fmt: skip


STAGES = [
    # from sample 10,000: move linearly to 1:1:2 over 2,000 samples, then hold until 22,000
    {"start_tokens": 10_000 * SEQ, "weights": {"web": 1, "code": 1, "math": 2}, "transition": "linear", "transition_tokens": 2_000 * SEQ},
    {"start_step": 22_000, "weights": {"code": 1, "math": 3}},  # a step change; web leaves
]


def test_realised_shares_in_each_stage_are_within_one_percent(folders):
    (loader,) = _loaders(folders, _config(folders, STAGES), dp=1, local=1)
    located = [loader.locate(p) for p in range(32_000)]
    names = ["web", "code", "math"]
    for (a, b), weights in [((0, 10_000), [3, 1, 1]), ((12_000, 22_000), [1, 1, 2]), ((22_000, 32_000), [0, 1, 3])]:
        counts = Counter(k for k, _ in located[a:b])
        realised = np.array([counts[k] for k in range(3)]) / (b - a)
        expected = np.array(weights) / sum(weights)
        assert np.abs(realised - expected).max() < 0.01, (a, b, realised, expected)
    # Over the linear transition the shares average the two stages' shares.
    counts = Counter(k for k, _ in located[10_000:12_000])
    mean = (np.array([3, 1, 1]) / 5 + np.array([1, 1, 2]) / 4) / 2
    assert np.abs(np.array([counts[k] for k in range(3)]) / 2_000 - mean).max() < 0.01
    # Each source's own positions come in order, none skipped or repeated, and the O(1) lookup agrees with a count.
    for k in range(3):
        assert [q for s, q in located if s == k] == list(range(sum(1 for s, _ in located if s == k)))
    for p in (0, 9_999, 10_000, 11_111, 12_000, 21_999, 22_000, 31_999):
        assert loader.schedule.counts_before(p).tolist() == [sum(1 for s, _ in located[:p] if s == k) for k in range(3)]
    # The samples come from the folder the schedule names.
    for p in (0, 10_500, 23_000):
        assert source_of_tokens(loader.window(p).tokens) == names[located[p][0]]


def _global_batch(ranks) -> list[bytes]:
    return [row.numpy().tobytes() for loader in ranks for row in loader.next_batch().inputs]


@pytest.mark.parametrize("on_exhausted", ["repeat", "drop"])
def test_resume_in_a_transition_under_another_degree_is_exact(folders, on_exhausted):
    # Steps of 6 samples: the transition runs from step 50 (sample 300) over 150 steps (900 samples, four ramp
    # blocks); code may serve 3 epochs of its few samples, so it runs out (repeats or leaves) within the run.
    stages = [{"start_step": 50, "weights": {"web": 1, "code": 2, "math": 2}, "transition": "linear", "transition_steps": 150}]
    config = _config(folders, stages, max_epochs={"code": 3}, on_exhausted=on_exhausted)
    (reference,) = _loaders(folders, config, dp=1, local=1, samples_per_step=6)
    total = 1_400
    stream = [reference.next_batch().inputs[0].numpy().tobytes() for _ in range(total)]

    ranks = _loaders(folders, config, dp=3, local=2, samples_per_step=6)
    seen = []
    for _ in range(100):  # 600 samples: mid-transition
        seen += _global_batch(ranks)
    state = json.loads(json.dumps(ranks[0].state_dict()))  # as a checkpoint stores it
    assert all(r.state_dict() == ranks[0].state_dict() for r in ranks) and state["consumed"] == 600
    assert 300 < state["consumed"] < 1_200
    resumed = _loaders(folders, config, dp=2, local=4, samples_per_step=6, seed=999)  # the seed comes from the state
    for loader in resumed:
        loader.load_state_dict(state)
    while len(seen) + 8 <= total:
        seen += _global_batch(resumed)
    assert seen == stream[: len(seen)] and len(seen) == 1_400
    assert reference.schedule.exhausted and reference.schedule.exhausted[0][0] < 1_400  # code did run out


@pytest.mark.parametrize("on_exhausted", ["repeat", "drop"])
def test_a_source_running_out_repeats_or_leaves_and_is_logged(folders, on_exhausted):
    config = _config(folders, [], max_epochs={"code": 2}, on_exhausted=on_exhausted)
    (loader,) = _loaders(folders, config, dp=1, local=8)
    code = loader.sources[1]
    limit = 2 * code.num_samples
    out_at = loader.schedule.position_of(1, limit - 1) + 1  # just after code's last sample of epoch 2
    events = []
    tokens_by_source = Counter()
    while loader.consumed < out_at + 400:
        batch = loader.next_batch()
        for row in batch.inputs:
            tokens_by_source[source_of_tokens(row.numpy())] += 1
        events += loader.events()
    located = [loader.locate(p) for p in range(loader.consumed)]
    served = sum(1 for k, _ in located if k == 1)
    kind = "data_source_repeats" if on_exhausted == "repeat" else "data_source_dropped"
    assert events == [{"event": kind, "source": "code", "max_epochs": 2, "sample": out_at}]
    after = Counter(k for k, _ in located[out_at:])
    if on_exhausted == "repeat":
        # Another epoch, in a new seeded order.
        assert served > limit and after[1] > 0
        third = [code.window(q).tokens.tobytes() for q in range(limit, limit + 5)]
        assert third != [code.window(q).tokens.tobytes() for q in range(5)]
    else:
        # Exactly two epochs, then its share goes to the rest in their 3:1 ratio.
        assert served == limit and after[1] == 0
        assert abs(after[0] / (after[0] + after[2]) - 0.75) < 0.05
    metrics = loader.metrics()
    assert metrics["data/code/epochs"] == pytest.approx(served / code.num_samples)
    assert metrics["data/code/share"] == (0.0 if on_exhausted == "drop" else pytest.approx(0.2, abs=1e-3))
    # Accounting: tokens are seq_len per sample; documents are the document starts (bos) in the inputs served.
    for k, name in enumerate(["web", "code", "math"]):
        q = sum(1 for s, _ in located if s == k)
        assert metrics[f"data/{name}/tokens"] == q * SEQ
        bos = sum(int((loader.sources[k].window(i).tokens[:-1] == 0).sum()) for i in range(q))
        assert metrics[f"data/{name}/documents"] == bos
        assert tokens_by_source[name] == q


def test_changed_mixture_on_resume_needs_allow_mixture_change(folders):
    (loader,) = _loaders(folders, _config(folders, []), dp=1, local=10)
    for _ in range(50):
        loader.next_batch()
    state = loader.state_dict()
    cursors = state["cursors"]
    changed = _config(folders, [{"start_step": 0, "weights": {"web": 1, "math": 1}}])
    (other,) = _loaders(folders, changed, dp=1, local=10)
    with pytest.raises(ValueError, match=r"^data: the mixture differs from the checkpoint's .* set data\.allow_mixture_change = true"):
        other.load_state_dict(state)
    changed.allow_mixture_change = True
    other = _loaders(folders, changed, dp=2, local=5)[1]
    other.load_state_dict(state)
    assert other.events() == [{"event": "data_mixture_change", "sample": 500}]
    # Each source continues at its own position; code is no longer drawn.
    later = [other.locate(p) for p in range(500, 1_000)]
    for k in (0, 2):
        assert [q for s, q in later if s == k] == list(range(cursors[k], cursors[k] + sum(1 for s, _ in later if s == k)))
    assert not any(s == 1 for s, _ in later)
    # The rebased state resumes again, unchanged, under yet another degree.
    (again,) = _loaders(folders, changed, dp=1, local=3)
    again.load_state_dict(json.loads(json.dumps(other.state_dict())))
    assert [again.locate(p) for p in range(500, 1_000)] == later and again.events() == []


def test_bad_mixture_settings_name_the_setting(folders, tmp_path):
    def error(stages, **settings):
        with pytest.raises(ValueError) as info:
            build_mixture(_config(folders, stages, **settings), 4, SEQ)
        assert "\n" not in str(info.value)
        return str(info.value)

    assert error([{"start_step": 5, "weights": {"web": 0}}]).startswith("data.stages[0].weights.web must be a positive number, got 0")
    assert error([{"start_step": 5, "weights": {"web": -2}}]).startswith("data.stages[0].weights.web must be a positive number")
    assert error([{"start_step": 5, "weights": {"cod": 1}}]).startswith(
        "data.stages[0].weights names unknown source 'cod'; did you mean 'code'? the sources of data.shards are web, code, math"
    )
    assert error([{"start_step": 9, "weights": {"web": 1}}, {"start_step": 5, "weights": {"code": 1}}]).startswith(
        "data.stages[1] starts at sample 20, not after the previous stage's sample 36; list data.stages in order"
    )
    assert "inside data.stages[0]'s linear transition" in error(
        [{"start_step": 1, "weights": {"web": 1}, "transition": "linear", "transition_steps": 5}, {"start_step": 3, "weights": {"code": 1}}]
    )
    assert error([{"weights": {"web": 1}}]).startswith("data.stages[0] needs start_step (or start_tokens)")
    assert error([{"start_step": 1, "weights": {"web": 1}, "ramp": 3}]).startswith("data.stages[0] has unknown key 'ramp'")
    assert error([], max_epochs={"mth": 1}).startswith("data.max_epochs names unknown source 'mth'")

    # A source whose files disappear between runs: a missing shard file, or a missing folder.
    copy = shutil.copytree(folders["code"], tmp_path / "code")
    (copy / "shard_00000.bin").unlink()
    with pytest.raises(ValueError, match=r"^data\.shards: .*shard_00000\.bin is missing; rerun `meshloom prepare`"):
        build_shard_loaders(f"{folders['web']},{copy}", "document", 0.0, False, SEQ, 1, 0, 1, 0, lambda s: None)
    shutil.rmtree(copy)
    with pytest.raises(ValueError, match=r"^data\.shards: folder .*code not found"):
        check_shard_folders(f"{folders['web']},{copy}")


def test_a_stage_after_the_last_step_is_refused_before_training(folders, capsys):
    """A stage that starts at or after training.steps would never run: refused by RunPlan's check, in steps and in
    tokens, with one line; one that starts at the last step is kept."""
    from meshloom.data.stages import check_mixture_settings

    web = {"weights": {"web": 1}}
    for start in ({"start_step": 10}, {"start_step": 11}, {"start_tokens": 10 * 4 * SEQ}, {"start_tokens": 10 * 4 * SEQ + 1}):
        config = _config(folders, [{**start, **web}])
        with pytest.raises(ValueError, match=r"^data\.stages\[0\] starts at sample 4[0-4] \(step 1[12]\), after the last step "
                                             r"\(training.steps = 10\), so it would never run; start it earlier"):  # fmt: skip
            check_mixture_settings(config, 4, SEQ, 10)
    for start in ({"start_step": 9}, {"start_tokens": 9 * 4 * SEQ + 1}):
        check_mixture_settings(_config(folders, [{**start, **web}]), 4, SEQ, 10)
    # The second of two stages, from the command line: one line, before any process group.
    stages = json.dumps([{"start_step": 2, "weights": {"web": 1}}, {"start_step": 6, "weights": {"code": 1}}])
    from meshloom.cli import main as cli

    argv = ["train", "--data.dataset", "shards", "--data.shards", _config(folders, []).shards, "--data.stages", stages,
            "--training.steps", "6", "--training.seq_len", str(SEQ), "--data.vocab_size", "512"]  # fmt: skip
    line = one_line_error(cli(argv), capsys.readouterr().err, "data.stages[1] starts at sample")
    assert "(training.steps = 6), so it would never run" in line


def test_one_folder_listed_twice_is_refused(folders, tmp_path):
    """The same folder twice in data.shards, however spelt (as given, with ./ or a trailing /, absolute, through a
    link), is refused in one line: it would be one source drawn at the sum of two weights."""
    from meshloom.data.shards import parse_shards_setting

    web = folders["web"]
    link = tmp_path / "web-link"
    link.symlink_to(web)
    relative = Path(web).relative_to(Path.cwd(), walk_up=True) if hasattr(Path, "walk_up") else None
    spellings = [str(web), f"{web}/", f"{Path(web).parent}/./{Path(web).name}", str(link), *([f"./{relative}"] if relative else [])]
    for other in spellings:
        with pytest.raises(ValueError, match=rf"^data\.shards lists the folder {Path(web).resolve()} twice \(as {web} and {re.escape(other)}\)"):
            parse_shards_setting(f"{web}:3,{folders['code']}:1,{other}:1")
        with pytest.raises(ValueError, match=r"lists the folder .* twice"):
            build_mixture(DataConfig(dataset="shards", shards=f"{web},{other}"), 4, SEQ)
    # Two folders that share a last name are two sources, named by their paths.
    twin = prepared(tmp_path / "other" / "web", Numbered(), numbered_texts(5), shard_tokens=200)
    assert build_mixture(DataConfig(dataset="shards", shards=f"{web},{twin}"), 4, SEQ).names == [str(web), str(twin)]


def test_stages_read_the_same_from_toml_yaml_and_the_command_line(folders, tmp_path):
    toml = tmp_path / "mix.toml"
    toml.write_text(
        f'[data]\ndataset = "shards"\nshards = "{folders["web"]}:3,{folders["code"]}"\nmax_epochs = {{code = 2}}\n'
        '[[data.stages]]\nstart_step = 10\nweights = {web = 1, code = 1}\ntransition = "linear"\ntransition_steps = 4\n'
    )
    yaml = tmp_path / "mix.yaml"
    yaml.write_text(
        f'data:\n  dataset: shards\n  shards: "{folders["web"]}:3,{folders["code"]}"\n  max_epochs: {{code: 2}}\n  stages:\n'
        "    - {start_step: 10, weights: {web: 1, code: 1}, transition: linear, transition_steps: 4}\n"
    )
    from_toml, from_yaml = load_config(["--config", str(toml)]), load_config(["--config", str(yaml)])
    assert from_toml.data == from_yaml.data and from_toml.data.max_epochs == {"code": 2}
    cli = load_config(["--config", str(toml), "--data.stages", json.dumps(from_toml.data.stages)])
    assert cli.data == from_toml.data
    mixture = build_mixture(from_toml.data, 8, SEQ)
    assert mixture.stages == [Stage(0, (3.0, 1.0)), Stage(80, (1.0, 1.0), 32)]
    with pytest.raises(ValueError, match=r"data\.stages must be JSON on the command line"):
        load_config(["--data.stages", "{start_step"])
    # Through the command: one line, no traceback, before anything is built.
    bad = tmp_path / "bad.toml"
    bad.write_text(toml.read_text().replace("code = 1}", "code = 0}"))
    run = subprocess.run([sys.executable, "-m", "meshloom", "train", "--config", str(bad), "--dry-run", "--world-size", "2"],
                         capture_output=True, text=True)  # fmt: skip
    one_line_error(run.returncode, run.stderr, "")
    assert run.stderr.strip() == (
        "meshloom: error: data.stages[0].weights.code must be a positive number, got 0; leave a source out of a stage to draw nothing from it"
    )


def test_schedule_lookup_is_constant_time_in_the_position():
    """A far position costs what a near one does: no replay of the positions before it."""
    import time

    stages = [Stage(0, (1.0, 1.0)), Stage(10**6, (1.0, 3.0), 10**5), Stage(10**12, (5.0, 1.0))]
    schedule = StagedSchedule(stages, seed=0)
    for position in (5, 10**6 + 5 * 10**4, 10**12 + 123_456_789_012):
        start = time.perf_counter()
        k, q = schedule.locate(position)
        assert time.perf_counter() - start < 0.05
        assert q < position and schedule.counts_before(position)[k] == q


def test_training_logs_the_mixture_and_resumes_with_a_changed_one(tmp_path):
    """metrics.jsonl carries each source's cumulative tokens, documents and share; the report plots the mixture;
    a resume with another mixture is refused, then allowed and logged."""
    from meshloom.cli.report import load_mixture, write_report
    from meshloom.train.trainer import Trainer
    from shard_fixtures import document, load_tokenizer, tokenizer_json

    tok_path = tokenizer_json(tmp_path)
    tokenizer = load_tokenizer(tok_path)
    web = prepared(tmp_path / "web", tokenizer, [document(i) for i in range(60)])
    code = prepared(tmp_path / "code", tokenizer, [document(i, words=30) for i in range(100, 140)])
    recipe = tmp_path / "mix.toml"
    recipe.write_text(f'[data]\ndataset = "shards"\nshards = "{web}:3,{code}:1"\nvalidation_fraction = 0.0\n'
                      '[[data.stages]]\nstart_step = 2\nweights = {code = 1}\n')  # fmt: skip
    argv = [
        "--config", str(recipe), "--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "4",
        "--metrics.progress_bar", "false", "--metrics.peak_tflops", "1", "--metrics.log_freq", "1",
        "--data.tokenizer", str(tok_path), "--job.dump_folder", str(tmp_path / "run"), "--validation.enable", "false",
        "--checkpoint.enable", "true", "--checkpoint.interval", "2",
    ]  # fmt: skip
    Trainer(load_config([*argv, "--training.steps", "3"])).train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "loss" in r}
    assert steps[1]["data/web/tokens"] + steps[1]["data/code/tokens"] == 4 * 32
    assert steps[2]["data/web/tokens"] + steps[2]["data/code/tokens"] == 8 * 32
    # A share is the mixture at the next sample: the stage's from the end of step 2, and step 3 draws code only.
    assert steps[1]["data/web/share"] == 0.75 and steps[2]["data/code/share"] == 1.0
    assert steps[3]["data/web/tokens"] == steps[2]["data/web/tokens"] and steps[3]["data/code/tokens"] == steps[2]["data/code/tokens"] + 4 * 32
    assert steps[2]["data/web/documents"] >= steps[1]["data/web/documents"] > 0
    assert list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))
    assert load_mixture(tmp_path / "run")["web"] == ([1, 2, 3], [0.75, 0.0, 0.0])

    changed = [*argv, "--training.steps", "4", "--checkpoint.resume", "true", "--data.stages", "[]"]
    with pytest.raises(ValueError, match=r"data: the mixture differs from the checkpoint's"):
        Trainer(load_config(changed)).train()
    Trainer(load_config([*changed, "--data.allow_mixture_change", "true"])).train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 4, "event": "data_mixture_change", "sample": 12} in rows
    last = [r for r in rows if r.get("step") == 4 and "loss" in r][-1]
    assert last["data/web/share"] == 0.75 and last["data/web/tokens"] + last["data/code/tokens"] == 16 * 32
    assert write_report([tmp_path / "run"], tmp_path / "report.png").stat().st_size > 0
