"""Document masks under context parallel: training equals one process with the same mask (fp32, 1e-5, 6 steps).

The data is a shards dataset of short documents (a few long ones among them), packed into 64-token sequences with
data.document_mask, so most sequences hold several documents and the masks change the losses. Every family is
covered: Llama 3 and Qwen3 (grouped-query attention, Qwen3's MoE under expert parallel) and DeepSeek-V3 (MLA, whose
v head size differs from q/k's, and multi-token prediction, whose labels cross shards). Layouts: CP 2, CP 4,
CP 2 x TP 2, CP 2 x PP 2 and CP 2 x EP 2, some with head-tail balancing and some with the document-aware one
(parallelism.cp_document_balance), whose layout changes every batch. QK-clip under CP 2 clips the heads one process
clips: its maxima take only the logits the document mask allows. All cases of one world size share one launch
(testing/resume_parity.py): one launch of 4 ranks and one of 2.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from shard_fixtures import document, load_tokenizer, prepared, tokenizer_json

from meshloom.testing.layout_parity import FP32_TOLERANCE, clip_mismatches
from meshloom.testing.resume_parity import Case, CaseResult, launch, run_case

LLAMA = ["--model.name", "llama3"]
QWEN = ["--model.name", "qwen3"]
QWEN_MOE = ["--model.name", "qwen3", "--model.flavor", "tiny_moe", "--moe.z_loss_coef", "1e-3"]
DEEPSEEK = ["--model.name", "deepseek_v3"]
BALANCE = ",cp_document_balance=true"
# Not one microbatch per sequence: each costs every rank the same fixed overhead (the schedules are test_pipeline.py's).
TWO_MICROBATCHES = ",pipeline.microbatches=2"
STEPS = 6
# A threshold that clips some of the tiny model's 16 heads at every step, not all (2, 2, 5, 9, 13, 12 in one process);
# with the cross-document logits counted, CP 2 clipped 2, 5, 3, 10, 14, 13.
QK_CLIP = LLAMA + ["--optimizer.lr", "3e-3", "--optimizer.qk_clip_threshold", "0.12"]

# name -> (layout, family overrides, reference)
CASES = {
    "llama3_cp4": ("cp=4", LLAMA, "llama3"),
    "deepseek_cp4_doc": ("cp=4" + BALANCE, DEEPSEEK, "deepseek"),
    "qwen3_cp2_tp2_doc": ("cp=2,tp=2" + BALANCE, QWEN, "qwen3"),
    "deepseek_cp2_tp2": ("cp=2,tp=2", DEEPSEEK, "deepseek"),
    "llama3_cp2_pp2_doc": ("cp=2,pp=2" + BALANCE + TWO_MICROBATCHES, LLAMA, "llama3"),
    "deepseek_cp2_pp2_doc": ("cp=2,pp=2" + BALANCE + TWO_MICROBATCHES, DEEPSEEK, "deepseek"),
    "qwen3_cp2": ("cp=2", QWEN, "qwen3"),
    "llama3_cp2_doc": ("cp=2" + BALANCE, LLAMA, "llama3"),
    "qwen3moe_cp2_ep2_doc": ("cp=2,ep=2" + BALANCE, QWEN_MOE, "qwen3moe"),
    "deepseek_cp2_ep2": ("cp=2,ep=2", DEEPSEEK, "deepseek"),
    "llama3_cp2_qk_clip": ("cp=2", QK_CLIP, "qk_clip"),
    "llama3_cp2_doc_qk_clip": ("cp=2" + BALANCE, QK_CLIP, "qk_clip"),
}
REFERENCES = {"llama3": LLAMA, "qwen3": QWEN, "qwen3moe": QWEN_MOE, "deepseek": DEEPSEEK, "qk_clip": QK_CLIP}


def _texts() -> list[str]:
    """Mostly short documents (3 to 40 words) and every 16th a long one (300 words)."""
    return [document(i, 300 if i % 16 == 5 else 3 + (i * 13) % 38) for i in range(240)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, CaseResult]]:
    os.environ.pop("WORLD_SIZE", None)
    w = tmp_path_factory.mktemp("cp-documents")
    tok_path = tokenizer_json(w / "tok")
    folder = prepared(w / "shards", load_tokenizer(tok_path), _texts(), shard_tokens=4000)
    data = ["--data.dataset", "shards", "--data.shards", str(folder), "--data.tokenizer", str(tok_path)]
    masked = data + ["--data.document_mask", "true"]
    out: dict[str, CaseResult] = {}
    for name, family in REFERENCES.items():
        out[f"ref_{name}"] = run_case(Case(f"ref_{name}", str(w / f"ref_{name}"), steps=STEPS, overrides=family + masked), w)
    out["unmasked"] = run_case(Case("unmasked", str(w / "unmasked"), steps=STEPS, overrides=LLAMA + data), w)
    cases = [Case(name, str(w / name), layout, STEPS, overrides=family + masked) for name, (layout, family, _) in CASES.items()]
    out.update(launch(cases, w))
    return w, out


def test_the_masks_change_the_losses(runs):
    _, out = runs
    assert max(abs(a - b) for a, b in zip(out["ref_llama3"].losses, out["unmasked"].losses)) > 1e-3


@pytest.mark.parametrize("name", list(CASES))
def test_document_masked_context_parallel_matches_one_process(runs, name):
    _, out = runs
    reference, result = out[f"ref_{CASES[name][2]}"], out[name]
    diffs = [abs(a - b) for a, b in zip(reference.losses, result.losses, strict=True)]
    assert len(diffs) == STEPS
    print(f"{name}: max |dloss| {max(diffs):.2e}, |dgrad_norm| {abs(reference.grad_norms[-1] - result.grad_norms[-1]):.2e}")
    assert max(diffs) <= FP32_TOLERANCE, (name, reference.losses, result.losses)
    assert abs(reference.grad_norms[-1] - result.grad_norms[-1]) <= FP32_TOLERANCE
    for aux, values in reference.aux.items():  # multi-token prediction, MoE balance losses
        assert max(abs(a - b) for a, b in zip(values, result.aux[aux], strict=True)) <= FP32_TOLERANCE, aux


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case[2] == "qk_clip"])
def test_qk_clip_under_context_parallel_clips_the_heads_of_one_process(runs, name):
    _, out = runs
    reference, result = out["ref_qk_clip"], out[name]
    assert all(0 < len(heads) < 16 for heads in reference.clipped_heads), reference.clipped_heads
    counts = [len(heads) for heads in result.clipped_heads]
    mismatches = clip_mismatches(
        result.clipped_heads, reference.clipped_heads, result.near_tau_heads, reference.near_tau_heads
    )
    assert not mismatches, (counts, [len(heads) for heads in reference.clipped_heads], mismatches)


def test_attention_imbalance_is_reported(runs):
    w, _ = runs
    for name in ("llama3_cp4", "deepseek_cp4_doc"):
        lines = [json.loads(line) for line in (w / name / "metrics.jsonl").read_text().splitlines()]
        values = [line["cp_attention_imbalance"] for line in lines if "cp_attention_imbalance" in line]
        assert values and all(v >= 1.0 for v in values), (name, lines[-1])
