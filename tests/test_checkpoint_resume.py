"""Exact resume, resharding on resume, data position, seed checkpoints and HF initial loads across layouts.

Every run is deterministic fp32 training of the `tiny` model on CPU (gloo). A "stop" run saves at step 5
and ends there; its "resume" run continues to step 10 from the run folder. Multi-rank runs share one
launch per world size.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hf_fixtures import llama_config, save_random_llama

from meshloom.checkpoint import folders
from meshloom.cli.checkpoint_commands import seed_checkpoint
from meshloom.data.builtin_corpus import load_documents
from meshloom.testing.resume_parity import Case, CaseResult, launch, run_case

TOLERANCE = 1e-5
SAVE = ["--checkpoint.enable", "true", "--checkpoint.interval", "5"]
ASYNC = SAVE + ["--checkpoint.async_mode", "async"]
RESUME = SAVE + ["--checkpoint.resume", "true"]
# Pipeline layouts take two microbatches, not one per sequence: each costs every rank the same fixed overhead.
TWO_MICROBATCHES = ",pipeline.microbatches=2"
EXACT_LAYOUTS = {"1proc": "", "fsdp2": "dp_shard=2", "fsdp2_tp2": "dp_shard=2,tp=2", "pp2_fsdp2": "pp=2,dp_shard=2" + TWO_MICROBATCHES}


def _write_stream(path: Path) -> Path:
    """About 300 kB of built-in corpus documents as json lines."""
    lines = [json.dumps({"text": text}) for _, text in load_documents(None, "", 300_000)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> dict[str, CaseResult]:
    w = tmp_path_factory.mktemp("resume")
    (w / "cache").symlink_to(data_cache)  # the session's tokenizer and token caches
    out: dict[str, CaseResult] = {}

    def local(case: Case) -> None:
        out[case.name] = run_case(case, w)

    local(Case("ref", str(w / "ref")))
    local(Case("1proc_stop", str(w / "1proc"), stop_after=5, overrides=SAVE))
    local(Case("1proc_resume", str(w / "1proc"), overrides=RESUME))

    # Initial weights written by one process with another seed, and a Hugging Face folder of the tiny shape.
    seed = seed_checkpoint(Case("seed", str(w / "seed")).argv(w) + ["--training.seed", "11"])
    save_random_llama(w / "hf", llama_config(), seed=5)
    from_seed = ["--checkpoint.initial_load_path", str(seed)]
    from_hf = ["--checkpoint.initial_load_path", str(w / "hf"), "--checkpoint.initial_load_format", "hf"]
    sharded_init = ["--parallelism.init", "sharded"]  # layout-dependent weights unless something is loaded
    local(Case("seed_ref", str(w / "seed_ref"), steps=3, overrides=from_seed))
    local(Case("hf_ref", str(w / "hf_ref"), steps=3, overrides=from_hf))

    cases = []
    for name, layout in EXACT_LAYOUTS.items():
        if layout:
            run_dir = str(w / name)
            cases += [
                Case(f"{name}_ref", str(w / f"{name}_ref"), layout),
                Case(f"{name}_stop", run_dir, layout, stop_after=5, overrides=ASYNC),
                Case(f"{name}_resume", run_dir, layout, overrides=RESUME),
            ]
    # A stream's position is per data-parallel rank: each rank must get its own back.
    streaming = ["--data.dataset", "streaming", "--data.stream", str(_write_stream(w / "stream.jsonl"))]
    cases += [
        Case("stream_ref", str(w / "stream_ref"), "dp_shard=2", overrides=streaming),
        Case("stream_stop", str(w / "stream"), "dp_shard=2", stop_after=5, overrides=streaming + ASYNC),
        Case("stream_resume", str(w / "stream"), "dp_shard=2", overrides=streaming + RESUME),
    ]
    cases += [
        Case("tp2_stop", str(w / "tp2"), "tp=2", stop_after=5, overrides=SAVE),
        Case("pp2_stop", str(w / "pp2"), "pp=2" + TWO_MICROBATCHES, stop_after=5, overrides=SAVE),
        Case("pp2_to_fsdp2", str(w / "pp2"), "dp_shard=2", overrides=RESUME),
        Case("fsdp4_stop", str(w / "fsdp4"), "dp_shard=4", stop_after=5, overrides=SAVE),
        Case("fsdp4_to_fsdp2_tp2", str(w / "fsdp4"), "dp_shard=2,tp=2", overrides=RESUME),
        Case("seed_fsdp2_tp2", str(w / "seed_fsdp2_tp2"), "dp_shard=2,tp=2", steps=3, overrides=from_seed + sharded_init),
        Case("hf_fsdp2_tp2", str(w / "hf_fsdp2_tp2"), "dp_shard=2,tp=2", steps=3, overrides=from_hf + sharded_init),
    ]
    out.update(launch(cases, w))
    local(Case("tp2_to_1proc", str(w / "tp2"), overrides=RESUME))
    out["_markers"] = {  # type: ignore[assignment]
        name: folders.read_marker(Path(w / name / "checkpoint" / "step-5")) for name in ("fsdp2", "fsdp2_tp2", "fsdp4")
    }
    return out


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", [*EXACT_LAYOUTS, "stream"])
def test_stop_and_resume_is_bitwise_equal_to_training_straight(runs, layout: str) -> None:
    straight = runs["ref"] if layout == "1proc" else runs[f"{layout}_ref"]
    stop, resume = runs[f"{layout}_stop"], runs[f"{layout}_resume"]
    assert len(straight.losses) == 10
    assert stop.losses == straight.losses[:5]
    assert resume.losses == straight.losses[5:]
    assert stop.sample_ids + resume.sample_ids == straight.sample_ids
    # Not only the losses: every weight and optimizer moment ends bitwise equal.
    assert resume.final_state and resume.final_state == straight.final_state
    assert any(key.startswith("optimizer.") for key in straight.final_state)
    assert stop.final_state != straight.final_state


def test_async_saves_of_multi_rank_runs_were_committed(runs) -> None:
    for name in ("fsdp2", "fsdp2_tp2"):
        marker = runs["_markers"][name]
        assert marker["async"] and marker["world_size"] in (2, 4)
        assert 0 < marker["blocking_seconds"] <= marker["total_seconds"]
    layout = runs["_markers"]["fsdp2_tp2"]["layout"]
    assert (layout["dp_shard"], layout["tp"]) == (2, 2)
    assert len([f for f in runs["_markers"]["fsdp4"]["checksums"] if f.endswith(".distcp")]) == 4


@pytest.mark.parametrize(
    ("stop", "resume"),
    [("fsdp4_stop", "fsdp4_to_fsdp2_tp2"), ("tp2_stop", "tp2_to_1proc"), ("pp2_stop", "pp2_to_fsdp2")],
)
def test_resume_under_another_layout_continues_the_reference(runs, stop: str, resume: str) -> None:
    reference = runs["ref"].losses
    assert _max_diff(runs[stop].losses, reference[:5]) <= TOLERANCE
    assert _max_diff(runs[resume].losses, reference[5:]) <= TOLERANCE


def test_no_sample_is_repeated_or_skipped_when_the_data_parallel_degree_changes(runs) -> None:
    # dp 4 for steps 1-5, dp 2 for steps 6-10; the 1-process reference consumed each global batch whole.
    consumed = runs["fsdp4_stop"].sample_ids + runs["fsdp4_to_fsdp2_tp2"].sample_ids
    assert consumed == runs["ref"].sample_ids
    flat = [i for step in consumed for i in step]
    assert len(flat) == 80 and len(set(flat)) == 80


def test_seed_checkpoint_gives_every_layout_the_same_start(runs) -> None:
    assert _max_diff(runs["seed_fsdp2_tp2"].losses, runs["seed_ref"].losses) <= TOLERANCE
    # The seed checkpoint (training.seed 11) really replaced the run's own initialisation (seed 7).
    assert abs(runs["seed_ref"].losses[0] - runs["ref"].losses[0]) > 1e-3


def test_hugging_face_initial_load_in_any_layout(runs) -> None:
    assert _max_diff(runs["hf_fsdp2_tp2"].losses, runs["hf_ref"].losses) <= TOLERANCE
    assert abs(runs["hf_ref"].losses[0] - runs["ref"].losses[0]) > 1e-3
