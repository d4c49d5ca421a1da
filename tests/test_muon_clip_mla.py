"""MuonClip on multi-head latent attention (DeepSeek-V3's MLA, as Kimi K2 trained it), q-LoRA on and off.

The unit tests clip one MLA layer and run the same batch again: every head ends at most at tau, the heads above it
exactly at tau, and the shared rotary key (wkv_a), the value rows and the heads below tau are untouched. The parity
test trains DeepSeek-V3 `tiny` (q-LoRA) and `tiny_no_q_lora` (2 blocks: one dense, one MoE; 2 prediction modules,
whose blocks are clipped too) with Muon and QK-clip for 10 steps in one process and under TP 2, FSDP 2, CP 2, PP 2 and
FSDP 2 x EP 2 (EP borrows the FSDP ranks), all ten layouts in one 2-rank launch: per-step losses within 1e-5
of one process and the same number of heads clipped at every step. Tau sits inside the spread of the heads' maxima, so
some heads are clipped at a step and others are not.
"""

from __future__ import annotations

import os

import pytest
import torch

from meshloom.models.common.mla import MultiHeadLatentAttention
from meshloom.models.common.qk_clip import MLAClipTarget, mla_clip_target
from meshloom.models.common.rope import rope_tables
from meshloom.testing.layout_parity import (
    FP32_TOLERANCE,
    ParityCase,
    base_overrides,
    clip_mismatches,
    launch,
    run_steps,
)
from meshloom.train.qk_clip import QKClip

STEPS = 10
COMMON = "model.name=deepseek_v3,model.n_layers=2,training.seq_len=32,optimizer.name=Muon"
# Inside the heads' range of largest logits during these 10 steps (about 0.06-0.1 with q-LoRA, 0.1-0.13 without).
TAUS = {"tiny": 0.08, "tiny_no_q_lora": 0.118}
LAYOUTS = ["tp=2", "dp_shard=2", "cp=2", "pp=2", "dp_shard=2,ep=2"]


def _mla(q_lora_rank: int) -> MultiHeadLatentAttention:
    torch.manual_seed(0)
    attention = MultiHeadLatentAttention(dim=48, n_heads=6, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8,
                                         qk_rope_head_dim=4, v_head_dim=6, softmax_scale=0.3)  # fmt: skip
    attention.init_weights(std=0.3, out_std=0.02)
    return attention.train()


def _max_logits(attention: MultiHeadLatentAttention, x: torch.Tensor) -> torch.Tensor:
    cos, sin = rope_tables(attention.qk_rope_head_dim, x.shape[1], 10000.0, None)
    attention.max_logits = None
    attention(x, cos, sin)
    return attention.max_logits


@pytest.mark.parametrize("q_lora_rank", [12, 0], ids=["q_lora", "no_q_lora"])
def test_clipped_mla_heads_end_at_tau_and_the_shared_rotary_key_is_untouched(q_lora_rank):
    attention = _mla(q_lora_rank)
    target = mla_clip_target("attention", attention)
    assert isinstance(target, MLAClipTarget) and target.n_heads == 6
    assert target.wq is (attention.wq_b if q_lora_rank else attention.wq).weight
    clip = QKClip([target], tau=0.0, dims=None)  # enabled below: the tau comes from the batch
    x = torch.randn(3, 20, 48)
    attention.track_max_logits = True
    before = _max_logits(attention, x)
    tau = float(before.median())  # half the heads above it
    clip.tau, clip.enabled = tau, True
    weights = {name: p.detach().clone() for name, p in attention.named_parameters()}
    attention.max_logits = before
    assert clip.after_update() == int((before > tau).sum()) == 3
    after = _max_logits(attention, x)
    assert (after <= tau * (1 + 1e-5)).all(), (before, after)
    above = before > tau
    assert torch.allclose(after[above], torch.full((3,), tau), rtol=1e-5)
    assert torch.allclose(after[~above], before[~above], rtol=1e-6)
    # The shared rotary key (and the latent) come from wkv_a: bit for bit the same. So are the value rows of wkv_b,
    # the output projection and, with q-LoRA, the down-projection.
    assert torch.equal(attention.wkv_a.weight, weights["wkv_a.weight"])
    assert torch.equal(attention.wo.weight, weights["wo.weight"])
    if q_lora_rank:
        assert torch.equal(attention.wq_a.weight, weights["wq_a.weight"])
    nope, rope, v = attention.qk_nope_head_dim, attention.qk_rope_head_dim, attention.v_head_dim
    kv_new, kv_old = attention.wkv_b.weight.view(6, nope + v, -1), weights["wkv_b.weight"].view(6, nope + v, -1)
    assert torch.equal(kv_new[:, nope:], kv_old[:, nope:])
    # Per clipped head: q_C and k_C by sqrt(gamma), q_R by gamma; heads below tau untouched.
    gamma = torch.where(above, tau / before, torch.ones_like(before))
    q_name = "wq_b.weight" if q_lora_rank else "wq.weight"
    q_new, q_old = target.wq.view(6, nope + rope, -1), weights[q_name].view(6, nope + rope, -1)
    assert torch.allclose(q_new[:, :nope], q_old[:, :nope] * gamma.sqrt()[:, None, None], rtol=1e-6)
    assert torch.allclose(q_new[:, nope:], q_old[:, nope:] * gamma[:, None, None], rtol=1e-6)
    assert torch.allclose(kv_new[:, :nope], kv_old[:, :nope] * gamma.sqrt()[:, None, None], rtol=1e-6)
    assert torch.equal(q_new[~above], q_old[~above])


def test_mla_forward_is_unchanged_by_tracking():
    attention = _mla(12)
    x = torch.randn(2, 16, 48)
    cos, sin = rope_tables(attention.qk_rope_head_dim, 16, 10000.0, None)
    plain = attention(x, cos, sin)
    attention.track_max_logits = True
    assert torch.equal(attention(x, cos, sin), plain) and attention.max_logits.shape == (6,)
    attention.eval()  # evaluation forwards are not tracked
    attention.max_logits = None
    attention(x, cos, sin)
    assert attention.max_logits is None


@pytest.fixture(scope="module")
def mla_parity(tmp_path_factory, data_cache):
    """Both references in this process, then the ten layouts in one 2-rank launch."""
    workdir = tmp_path_factory.mktemp("mla_clip")
    (workdir / "cache").symlink_to(data_cache)
    os.environ.pop("WORLD_SIZE", None)
    common = ParityCase.parse(COMMON).setting_args()
    references, layouts = {}, []
    for flavor, tau in TAUS.items():
        settings = f"model.flavor={flavor},optimizer.qk_clip_threshold={tau}"
        references[flavor] = run_steps(base_overrides(STEPS, workdir) + common + ParityCase.parse(settings).setting_args()
                                       + ["--job.dump_folder", str(workdir / f"reference_{flavor}")])  # fmt: skip
        layouts += [ParityCase.parse(f"{layout},{settings}") for layout in LAYOUTS]
    curves = launch(layouts, STEPS, workdir, common)
    assert {layout.world_size for layout in layouts} == {2}  # one launch
    return references, curves


@pytest.mark.parametrize("flavor", list(TAUS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_qk_clip_layout_matches_one_process(mla_parity, flavor, layout):
    references, curves = mla_parity
    reference = references[flavor]
    curve = curves[f"{layout},model.flavor={flavor},optimizer.qk_clip_threshold={TAUS[flavor]}"]
    diff = max(abs(a - b) for a, b in zip(curve.losses, reference.losses, strict=True))
    counts = [len(heads) for heads in curve.clipped_heads]
    print(f"MLA QK-clip {flavor} {layout}: max |dloss| {diff:.2e}, clipped per step {counts}")
    # The same heads clipped at every step, except any whose largest logit lay within rounding of tau in either run.
    mismatches = clip_mismatches(curve.clipped_heads, reference.clipped_heads, curve.near_tau_heads, reference.near_tau_heads)
    assert not mismatches, (counts, [len(heads) for heads in reference.clipped_heads], mismatches)
    assert diff <= FP32_TOLERANCE, (reference.losses, curve.losses)
    assert abs(curve.grad_norms[-1] - reference.grad_norms[-1]) <= FP32_TOLERANCE


@pytest.mark.parametrize("flavor", list(TAUS))
def test_mla_qk_clip_clips_some_heads_and_not_others(mla_parity, flavor):
    reference = mla_parity[0][flavor]
    heads = 4 * 4  # 2 blocks and 2 prediction modules' blocks of 4 heads
    counts = [len(step) for step in reference.clipped_heads]
    assert sum(counts) > STEPS
    assert any(0 < n < heads for n in counts), counts
    assert reference.losses[-1] < reference.losses[0] - 0.3
