"""Rules between two settings live in the declaration (meshloom/planning/features.py and setting_scopes.py).

The sources are walked for refusals (ConfigError, UserError, validate.py's _require) whose words name two or more
settings of the schema. Outside the declaration each such refusal must be listed below with why it is not a pair rule
of features: a new one fails here until it moves into the declaration or is listed with its reason."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from meshloom.config.schema import Config

REPO = Path(__file__).resolve().parents[1]
DECLARATION = {"meshloom/planning/features.py", "meshloom/planning/setting_scopes.py"}

# Arithmetic between values: one number must divide or bound another (the declaration holds which features may train
# together; these hold which sizes fit together).
ARITHMETIC = {
    ("meshloom/config/validate.py", ("parallelism.cp", "parallelism.cp_load_balance", "training.seq_len")),
    ("meshloom/config/validate.py", ("parallelism.cp", "parallelism.cp_document_chunks", "training.seq_len")),
    ("meshloom/parallel/pipeline.py", ("model.n_layers", "parallelism.pp", "pipeline.split_points", "pipeline.stages_per_rank")),
    ("meshloom/parallel/pipeline.py", ("pipeline.microbatches", "training.local_batch_size")),
    ("meshloom/parallel/pipeline.py", ("pipeline.microbatches", "pipeline.schedule", "training.local_batch_size")),
    ("meshloom/parallel/pipeline.py", ("pipeline.microbatches", "pipeline.schedule")),
    ("meshloom/parallel/pipeline.py", ("pipeline.schedule", "pipeline.stages_per_rank")),
    ("meshloom/parallel/float8.py", ("float8.enable", "parallelism.tp")),  # no linear's dims divide by 16 x tp
    ("meshloom/data/mixed_loader.py", ("data.sampling", "data.validation_fraction", "training.seq_len")),
    ("meshloom/data/shards.py", ("data.shards", "training.seq_len")),
}
# What the files on disk hold, known when they are read: checkpoints, corpora, shards, tokenizers, run folders.
FILES = {
    # A resume against the checkpoint on disk: the refusal names the resume, the checkpoint and the way to start anew.
    ("meshloom/checkpoint/resume_settings.py", ("checkpoint.initial_load_path", "checkpoint.resume", "job.dump_folder")),
    ("meshloom/checkpoint/dcp.py", ("checkpoint.folder", "checkpoint.resume", "job.dump_folder")),
    ("meshloom/checkpoint/dcp.py", ("checkpoint.resume", "job.dump_folder")),
    ("meshloom/checkpoint/dcp.py", ("checkpoint.initial_load_path", "checkpoint.resume", "job.dump_folder", "optimizer.name")),
    ("meshloom/checkpoint/dcp.py", ("checkpoint.resume", "training.steps")),
    ("meshloom/checkpoint/dcp.py", ("checkpoint.initial_load_path", "model.flavor", "model.name")),
    ("meshloom/checkpoint/dcp.py", ("checkpoint.initial_load_path", "model.flavor")),
    ("meshloom/train/run_folder.py", ("checkpoint.resume", "job.dump_folder")),
    ("meshloom/inference/loading.py", ("data.cache_dir", "data.tokenizer")),
    ("meshloom/inference/loading.py", ("checkpoint.enable", "checkpoint.interval")),
    ("meshloom/data/build.py", ("data.max_bytes", "data.path", "training.seq_len")),
    ("meshloom/data/build.py", ("data.dataset", "data.stream")),  # data.stream names no readable input
    ("meshloom/data/builtin_corpus.py", ("data.glob", "data.path")),
    ("meshloom/data/loader.py", ("data.max_bytes", "data.path", "training.seq_len")),
    ("meshloom/data/shard_format.py", ("data.shards", "data.tokenizer")),
    ("meshloom/data/build.py", ("data.max_epochs", "data.on_exhausted", "training.steps")),  # sources' sizes
    ("meshloom/data/schedule.py", ("data.max_epochs", "data.on_exhausted")),
    ("meshloom/data/mixed_loader.py", ("data.allow_mixture_change", "data.max_epochs", "data.on_exhausted", "data.shards", "data.stages")),
}
# Needed to compute the degrees themselves, which the declaration's conditions read.
DEGREES = {
    ("meshloom/parallel/resize.py", ("parallelism.dp_shard", "parallelism.resize")),
    ("meshloom/launch/cluster.py", ("parallelism.dp_shard", "parallelism.resize")),  # per node count of a launch
}
EXPLAINED = ARITHMETIC | FILES | DEGREES
_KEY = re.compile(r"\b([a-z_0-9]+\.[a-z_0-9]+)\b")


def _schema_keys() -> set[str]:
    config = Config()
    return {f"{s.name}.{f.name}" for s in dataclasses.fields(config) for f in dataclasses.fields(getattr(config, s.name))}


def _refusals_naming_two_settings(root: Path = REPO) -> set[tuple[str, tuple[str, ...]]]:
    keys, found = _schema_keys(), set()
    for path in sorted((root / "meshloom").rglob("*.py")):
        name = str(path.relative_to(root))
        for node in ast.walk(ast.parse(path.read_text())):
            callee = node.func if isinstance(node, ast.Call) else None
            if getattr(callee, "id", getattr(callee, "attr", "")) not in ("ConfigError", "UserError", "_require"):
                continue
            words = " ".join(n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str))
            named = tuple(sorted({k for k in _KEY.findall(words) if k in keys}))
            if len(named) >= 2 and name not in DECLARATION:
                found.add((name, named))
    return found


def test_no_refusal_about_two_settings_outside_the_declaration() -> None:
    scattered = _refusals_naming_two_settings() - EXPLAINED
    assert not scattered, f"declare these in meshloom/planning/features.py (or list why they are no pair rule): {sorted(scattered)}"


def test_every_listed_exception_still_exists() -> None:
    assert not EXPLAINED - _refusals_naming_two_settings(), "drop the entries that no longer match a refusal"


def test_the_walk_sees_a_scattered_pair_rule(tmp_path: Path) -> None:
    """A new module's refusal of two settings, in an f-string or through an attribute, is found."""
    module = tmp_path / "meshloom" / "train" / "new_rule.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "def check(config):\n"
        "    if config.float8.enable and config.compile.enable:\n"
        "        raise errors.ConfigError(f\"float8.enable = {config.float8.enable} with compile.enable: refused\")\n"
    )
    assert _refusals_naming_two_settings(tmp_path) == {("meshloom/train/new_rule.py", ("compile.enable", "float8.enable"))}
