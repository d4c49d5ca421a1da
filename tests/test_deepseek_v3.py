"""DeepSeek-V3 on one process: MLA against a naive reference, YaRN against transformers, multi-token prediction
against a hand-written loss, DeepSeek routing, Hugging Face import/export of MoE models (logits against
transformers, bit-exact round trips), parameter counts, every shape and layout error by message, and a training run.
Multi-rank parity and the dry runs are in tests/test_deepseek_v3_parallel.py."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshloom.config.loader import ConfigError, load_config
from meshloom.models.common.mla import MultiHeadLatentAttention
from meshloom.models.common.moe import MoE
from meshloom.models.common.rope import YarnScaling, rope_tables
from meshloom.models.deepseek_v3 import hf as deepseek_hf
from meshloom.models.deepseek_v3.model import DeepSeekV3, build_moe
from meshloom.models.registry import get_model_args, get_model_spec
from meshloom.parallel.apply import carve_stage
from meshloom.parallel.dims import ParallelDims
from meshloom.planning.run_plan import RunPlan

SPEC = get_model_spec("deepseek_v3")


def tiny(**changes) -> object:
    return dataclasses.replace(get_model_args("deepseek_v3", "tiny"), **changes)


# --------------------------------------------------------------------------- MLA and YaRN


def rotate_pairs(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Adjacent channel pairs as complex numbers, turned by `angles` [s, d/2] (x: [s, d])."""
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


def naive_mla(mla: MultiHeadLatentAttention, x: torch.Tensor, angles: torch.Tensor, scale: float) -> torch.Tensor:
    """MLA written out per batch row and head in float64, from the DeepSeek-V2 equations."""
    w = {n: p.detach().double() for n, p in mla.named_parameters()}
    nope, rope, vd = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    heads = w["wkv_b.weight"].shape[0] // (nope + vd)
    rms = lambda t, g: t / torch.sqrt((t * t).mean(-1, keepdim=True) + 1e-6) * g
    out = []
    for row in x.double():
        s = row.shape[0]
        q = row @ w["wq.weight"].T if mla.wq is not None else rms(row @ w["wq_a.weight"].T, w["q_norm.weight"]) @ w["wq_b.weight"].T
        latent_rope = row @ w["wkv_a.weight"].T
        kv = rms(latent_rope[:, : mla.kv_lora_rank], w["kv_norm.weight"]) @ w["wkv_b.weight"].T
        k_rope = rotate_pairs(latent_rope[:, mla.kv_lora_rank :], angles)
        head_outputs = []
        for h in range(heads):
            qh = q[:, h * (nope + rope) : (h + 1) * (nope + rope)]
            qh = torch.cat((qh[:, :nope], rotate_pairs(qh[:, nope:], angles)), dim=-1)
            kvh = kv[:, h * (nope + vd) : (h + 1) * (nope + vd)]
            kh = torch.cat((kvh[:, :nope], k_rope), dim=-1)
            scores = (qh @ kh.T) * scale + torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1)
            head_outputs.append(scores.softmax(-1) @ kvh[:, nope:])
        out.append(torch.cat(head_outputs, dim=-1) @ w["wo.weight"].T)
    return torch.stack(out)


@pytest.mark.parametrize("q_lora_rank", [0, 12])
def test_mla_matches_a_naive_reference(q_lora_rank):
    torch.manual_seed(0)
    mla = MultiHeadLatentAttention(32, 4, q_lora_rank, 10, 8, 6, 5, softmax_scale=0.37)
    with torch.no_grad():
        for p in mla.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 24, 32)
    freqs = 1.0 / 10000 ** (torch.arange(0, 6, 2, dtype=torch.float64) / 6)
    angles = torch.outer(torch.arange(24, dtype=torch.float64), freqs)
    cos, sin = rope_tables(6, 64, 10000.0, None)
    ours = mla(x, cos, sin)
    reference = naive_mla(mla, x, angles, 0.37)
    assert ours.shape == (2, 24, 32)
    assert (ours.double() - reference).abs().max() < 1e-5
    # The softmax scale is part of the result, not absorbed anywhere else.
    assert (naive_mla(mla, x, angles, 0.3) - reference).abs().max() > 1e-3


@pytest.mark.parametrize(
    "scaling",
    [
        {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0},  # DeepSeek-V3
        {"factor": 4.0, "original_max_position_embeddings": 32, "mscale": 0.8, "mscale_all_dim": 1.0, "beta_fast": 16},
        {"factor": 8.0, "original_max_position_embeddings": 64, "mscale_all_dim": 0.707},  # no mscale: plain temperature
        {"factor": 16.0, "original_max_position_embeddings": 128, "truncate": False, "attention_factor": 1.2},
    ],
)
def test_yarn_tables_and_scales_match_transformers(scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    config = transformers.DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, qk_rope_head_dim=16, qk_nope_head_dim=8, v_head_dim=8, kv_lora_rank=8,
        q_lora_rank=None, max_position_embeddings=8192, rope_scaling={"rope_type": "yarn", "rope_theta": 10000.0, **scaling},
    )  # fmt: skip
    hf_freqs, hf_attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    args = deepseek_hf.args_from_hf_config(config.to_dict())
    ours = args.rope_scaling
    freqs = ours.scale_frequencies(1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    assert torch.allclose(freqs, hf_freqs.double(), rtol=1e-6, atol=0)
    assert ours.rope_attention_factor == pytest.approx(hf_attention_factor, rel=1e-12)
    assert args.softmax_scale == pytest.approx(DeepseekV3Attention(config, 0).scaling, rel=1e-12)
    # The scaled tables are what the model rotates with (cos/sin carry the temperature).
    model = DeepSeekV3(dataclasses.replace(tiny(), qk_rope_head_dim=16, rope_scaling=ours, max_seq_len=32))
    angles = torch.outer(torch.arange(32, dtype=torch.float64), hf_freqs.double())
    assert torch.allclose(model.rope_cos.double(), angles.cos() * hf_attention_factor, atol=1e-5)


def test_yarn_rejects_bad_settings():
    with pytest.raises(ValueError, match="beta_fast >= beta_slow"):
        YarnScaling(factor=4.0, original_max_seq_len=32, beta_fast=1.0, beta_slow=2.0)
    with pytest.raises(ValueError, match="factor must be > 0"):
        YarnScaling(factor=0.0, original_max_seq_len=32)


# --------------------------------------------------------------------------- multi-token prediction


def reference_mtp_loss(model: DeepSeekV3, sequence: torch.Tensor) -> torch.Tensor:
    """The report's loss written out: sequence [b, s + 1] holds tokens t_0 .. t_s; the model reads t_0 .. t_(s-1).
    Depth k at position i reads h^(k-1)_i and Emb(t_(i+k)) and predicts t_(i+k+1); each depth's loss sums the
    positions whose target exists and divides by all b * s positions; the result is the mean over depths."""
    b, s = sequence.shape[0], sequence.shape[1] - 1
    cos, sin = model.rope_cos, model.rope_sin
    hidden = model.tok_embeddings(sequence[:, :s])
    for layer in model.layers.values():
        hidden = layer(hidden, cos, sin)
    losses = []
    for k, module in enumerate(model.mtp.values(), start=1):
        ahead = torch.zeros(b, s, dtype=torch.long)
        ahead[:, : s + 1 - k] = sequence[:, k:]
        hidden, normed = module(hidden, model.tok_embeddings(ahead), cos, sin)
        log_probs = F.log_softmax(model.output(normed).float(), dim=-1)
        total = sum(-log_probs[r, i, sequence[r, i + k + 1]] for r in range(b) for i in range(s - k))
        losses.append(total / (b * s))
    return torch.stack(losses).mean()


def test_mtp_loss_matches_a_hand_written_reference():
    torch.manual_seed(0)
    model = DeepSeekV3(tiny(mtp_depth=3)).train()
    sequence = torch.randint(0, 512, (2, 17))
    logits, mtp = model(sequence[:, :-1], labels=sequence[:, 1:])
    assert logits.shape == (2, 16, 512)
    assert mtp.item() == pytest.approx(reference_mtp_loss(model, sequence).item(), abs=1e-5)
    # It reaches every prediction module and the shared embedding and head.
    mtp.backward()
    for name in ("mtp.2.proj.weight", "mtp.0.block.attention.wkv_b.weight", "tok_embeddings.weight", "output.weight"):
        assert model.get_parameter(name).grad.abs().sum() > 0, name


def test_mtp_runs_only_in_training_with_labels():
    model = DeepSeekV3(tiny())
    tokens = torch.randint(0, 512, (1, 8))
    model.eval()
    assert isinstance(model(tokens, labels=tokens), torch.Tensor)
    model.train()
    assert isinstance(model(tokens), torch.Tensor)
    assert isinstance(model(tokens, labels=tokens), tuple)
    assert SPEC.aux_losses(tiny()) == {"mtp_loss": 0.3} and SPEC.aux_losses(tiny(mtp_depth=0)) == {}


def test_kv_cache_decoding_equals_the_full_forward():
    from meshloom.inference.kv_cache import KVCache

    torch.manual_seed(0)
    model = DeepSeekV3(tiny()).eval()
    tokens = torch.randint(0, 512, (2, 12))
    with torch.no_grad():
        full = model(tokens)
        with KVCache(model, [0, 0], max_len=12) as cache:
            prefill = model(tokens[:, :8], positions=cache.positions(8))
            cache.advance(8)
            steps = []
            for t in range(8, 12):
                steps.append(model(tokens[:, t : t + 1], positions=cache.positions(1)))
                cache.advance(1)
            # MLA caches the latent and the shared rotary key, not every head's keys and values.
            layer_cache = model.layers["0"].attention.kv_cache
            assert [tuple(b.shape) for b in layer_cache.buffers] == [(2, 1, 12, 32), (2, 1, 12, 8)]
    assert (prefill - full[:, :8]).abs().max() < 1e-5
    assert (torch.cat(steps, dim=1) - full[:, 8:]).abs().max() < 1e-5


def test_training_run_logs_mtp_loss_and_learns(tiny_args):
    from meshloom.train.trainer import Trainer

    trainer = Trainer(load_config([*tiny_args, "--model.name", "deepseek_v3", "--training.steps", "12", "--optimizer.lr", "1e-2"]))
    losses = trainer.train()
    rows = [json.loads(line) for line in (Path(trainer.run_dir) / "metrics.jsonl").read_text().splitlines()]
    mtp = [row["mtp_loss"] for row in rows if "loss" in row]
    assert len(mtp) == 12 and all(math.isfinite(v) for v in mtp)
    assert losses[-1] < losses[0] - 0.1 and mtp[-1] < mtp[0] - 0.1
    # Routing metrics of every MoE layer, the prediction modules' included; the balancing bias moved (12 steps of
    # -0.001, 0 or +0.001 each).
    last = rows[-1]
    assert 1.0 <= last["moe_load_max"] <= 4.0 and 0 < last["moe_entropy"] <= math.log(8)
    assert last["moe/layers.1/bias_spread"] > 0 and "moe/mtp.1.block/load_max_mean" in last
    bias = trainer.model.layers["1"].moe.expert_bias
    assert torch.allclose(bias / 0.001, (bias / 0.001).round(), atol=1e-3) and 0 < bias.abs().max() <= 0.012 + 1e-6


def test_training_loss_adds_weighted_aux_losses_and_reports_them_apart():
    from meshloom.train.loss import TrainingLoss, cross_entropy_loss

    logits, labels, mtp = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5)), torch.tensor(4.0)
    loss_fn = TrainingLoss(cross_entropy_loss, {"mtp_loss": 0.3})
    total, parts = loss_fn((logits, mtp), labels)
    main = cross_entropy_loss(logits, labels)
    assert loss_fn.names == ["loss", "mtp_loss"]
    assert total.item() == pytest.approx(main.item() + 1.2) and parts.tolist() == pytest.approx([main.item(), 4.0])
    # Evaluation: logits alone, the auxiliary part reads 0.
    total, parts = loss_fn(logits, labels)
    assert total.item() == pytest.approx(main.item()) and parts.tolist() == pytest.approx([main.item(), 0.0])
    with pytest.raises(ValueError, match="returned 2 auxiliary losses"):
        loss_fn((logits, mtp, mtp), labels)




# --------------------------------------------------------------------------- routing


def naive_moe(moe: MoE, x: torch.Tensor, score_func: str, renormalize: bool, scale: float, groups: int, limited: int) -> torch.Tensor:
    """The DeepSeek-V3 report's MoE (eqs. 12-16 with the bias of section 2.1.2) token by token, in float64: sigmoid
    (or softmax) affinities, the top-k of affinity + bias among the `limited` groups with the largest sum of their two
    best biased affinities, gates from the unbiased affinities (renormalised over the chosen, then scaled), plus the
    shared experts."""
    w = {n: p.detach().double() for n, p in moe.named_parameters()}
    bias = moe.expert_bias.double()
    n_experts, top_k = w["router.weight"].shape[0], moe.router.top_k
    out = []
    for token in x.reshape(-1, x.shape[-1]).double():
        logits = w["router.weight"] @ token
        s = logits.sigmoid() if score_func == "sigmoid" else logits.softmax(-1)
        biased = (s + bias).view(groups, -1)
        best_groups = biased.topk(2, dim=-1).values.sum(-1).topk(limited).indices.tolist()
        allowed = [e for e in range(n_experts) if e // (n_experts // groups) in best_groups]
        chosen = sorted(allowed, key=lambda e: -(s[e] + bias[e]).item())[:top_k]
        gates = s[chosen] / (s[chosen].sum() if renormalize else 1.0) * scale
        y = sum(
            g * (w["experts.w2"][e] @ (F.silu(w["experts.w1"][e] @ token) * (w["experts.w3"][e] @ token)))
            for g, e in zip(gates, chosen, strict=True)
        )
        if moe.shared_experts is not None:
            y = y + w["shared_experts.w2.weight"] @ (F.silu(w["shared_experts.w1.weight"] @ token) * (w["shared_experts.w3.weight"] @ token))
        out.append(y)
    return torch.stack(out).view(x.shape)


@pytest.mark.parametrize(
    "changes",
    [
        {},  # tiny: sigmoid, 4 groups of 2 experts, 2 of them per token, renormalised, scale 2.5, one shared expert
        {"score_func": "softmax", "route_norm": False, "route_scale": 1.0, "n_expert_groups": 1, "n_limited_groups": 1,
         "n_shared_experts": 2},  # the 16B flavour's routing
        {"n_activated_experts": 3, "n_expert_groups": 2, "n_limited_groups": 2, "n_shared_experts": 0},
    ],
)  # fmt: skip
def test_moe_blocks_route_as_deepseek_v3(changes):
    args = tiny(**changes)
    torch.manual_seed(0)
    moe = build_moe(args)
    moe.init_weights(0.3, 0.1)
    with torch.no_grad():
        moe.expert_bias.uniform_(-0.2, 0.2)  # large enough to change choices, so the bias is exercised
    x = torch.randn(2, 7, args.dim)
    expected = naive_moe(moe, x, args.score_func, args.route_norm, args.route_scale, args.n_expert_groups, args.n_limited_groups)
    assert (moe(x).double() - expected).abs().max() < 1e-5
    with torch.no_grad():
        moe.expert_bias.zero_()
    assert (moe(x).double() - expected).abs().max() > 1e-3
    model = DeepSeekV3(args)
    kinds = [type(block.mlp).__name__ for block in [*model.layers.values(), *(m.block for m in model.mtp.values())]]
    assert kinds == ["FeedForward", "MoE", "MoE", "MoE"]  # n_dense_layers = 1; prediction blocks are MoE like the last


# --------------------------------------------------------------------------- shapes and counts


def test_published_flavours_have_the_published_parameter_counts():
    v3 = get_model_args("deepseek_v3", "671B")
    main, with_mtp = SPEC.shape_model(dataclasses.replace(v3, mtp_depth=0)), SPEC.shape_model(v3)
    assert main.num_params() == pytest.approx(671.0e9, rel=1e-3)
    # Activated per token: DeepSeek's 37B, of which 36.6B "including 0.9B for the output head" without the table.
    assert main.active_params() == pytest.approx(37.5e9, rel=2e-3)
    assert main.matmul_params_per_token() - v3.dim == pytest.approx(36.6e9, rel=2e-3)
    # One prediction module: DeepSeek's 11.5B unique parameters (its eh_proj is 0.1B more here) over a shared embedding and head.
    assert with_mtp.num_params() - main.num_params() == pytest.approx(11.6e9, rel=5e-3)
    lite = SPEC.shape_model(get_model_args("deepseek_v3", "16B"))
    assert lite.num_params() == pytest.approx(15.7e9, rel=2e-3)
    assert lite.matmul_params_per_token() - 2048 == pytest.approx(2.45e9, rel=1e-2)  # DeepSeek-V2-Lite: 2.4B active


@pytest.mark.parametrize("flavor", ["tiny", "debug", "16B", "671B"])
def test_shape_model_counts_what_the_meta_model_holds(flavor):
    args = get_model_args("deepseek_v3", flavor)
    with torch.device("meta"):
        model = DeepSeekV3(args)
    shape = SPEC.shape_model(args)
    assert model.num_params() == shape.num_params()
    routed = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
    assert routed == sum(p.numel for i in range(args.n_layers + args.mtp_depth) for p in shape.block_params(i) if p.expert)
    with torch.device("meta"):  # a pipeline's last stage: its blocks, the output, the prediction modules, the embedding copy
        last = carve_stage(DeepSeekV3(args), SPEC.parallel, [args.n_layers - 1], first=False, last=True)
    assert sum(p.numel() for p in last.parameters()) == sum(
        p.numel for p in [*shape.block_params(args.n_layers - 1), *shape.root_params(first=False, last=True)]
    )


# --------------------------------------------------------------------------- errors

DS = ["--model.name", "deepseek_v3", "--training.local_batch_size", "8"]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"n_expert_groups": 3}, r"n_expert_groups=3 must divide n_routed_experts=8"),
        ({"n_limited_groups": 5}, r"n_limited_groups=5 must be <= n_expert_groups=4"),
        ({"n_activated_experts": 5}, r"n_activated_experts=5 exceeds the 4 experts a token may reach \(n_limited_groups=2 groups of 2\)"),
        ({"n_expert_groups": 1, "n_limited_groups": 1, "n_activated_experts": 9}, r"n_activated_experts=9 exceeds the 8 experts a token may reach"),
        ({"n_dense_layers": 3}, r"n_dense_layers=3 exceeds n_layers=2 .* set model.n_layers >= 3"),
        ({"mtp_depth": -1}, r"mtp_depth must be >= 0, got -1"),
        ({"qk_rope_head_dim": 7}, r"qk_rope_head_dim must be even"),
        ({"score_func": "relu"}, r"score_func must be 'softmax' or 'sigmoid'"),
        ({"route_scale": 0.0}, r"route_scale must be > 0"),
        ({"moe_inter_dim": 0}, r"moe_inter_dim must be > 0 when some blocks are MoE"),
        ({"n_shared_experts": -1}, r"n_shared_experts must be >= 0"),
    ],
)
def test_shape_mistakes_are_named_config_errors(changes, message):
    with pytest.raises(ConfigError, match=message):
        tiny(**changes)


@pytest.mark.parametrize(
    "world, settings, message",
    [
        (2, ["--model.flavor", "671B", "--model.n_layers", "2"], r"n_dense_layers=3 exceeds n_layers=2"),
        (3, ["--model.flavor", "tiny", "--parallelism.tp", "3"], r"parallelism.tp=3 does not divide the model's n_heads=4"),
        (8, ["--model.flavor", "tiny", "--parallelism.tp", "8"], r"tp=8 does not divide the model's n_heads=4"),
        (4, ["--model.flavor", "tiny", "--parallelism.tp", "2", "--parallelism.ep", "4"], r"parallelism.ep=4 must divide dp_shard x cp = 2 x 1 = 2"),
        (3, ["--model.flavor", "tiny", "--parallelism.ep", "3"], r"parallelism.ep=3 does not divide the model's 8 routed experts"),
        (2, ["--model.flavor", "tiny", "--model.n_layers", "1", "--parallelism.ep", "2"], r"with parallelism.ep > 1 \(EP\): expert parallel splits the routed experts"),
    ],
)
def test_layout_mistakes_are_named_config_errors(world, settings, message):
    with pytest.raises(ConfigError, match=message):
        RunPlan.build(load_config([*DS, "--training.local_batch_size", "24", *settings]), world)


def test_shared_experts_must_split_over_tp():
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=4, pp=1, cp=1, ep=1, world_size=4)
    SPEC.check_layout(tiny(), load_config(DS), dims)
    with pytest.raises(ConfigError, match=r"parallelism.tp=4 does not divide the model's moe_inter_dim x n_shared_experts=30"):
        SPEC.check_layout(tiny(moe_inter_dim=30), load_config(DS), dims)


@pytest.mark.parametrize(
    "world, settings, message",
    [
        (2, ["--parallelism.cp", "2", "--moe.aux_loss_coef", "1e-3"], "the sequence-wise balance loss needs whole sequences"),
        (1, ["--compile.enable", "true", "--moe.grouped_mm", "off"], "fullgraph blocks cannot trace"),
        (1, ["--model.flavor", "16B", "--checkpoint.hf_export_interval", "10"], "always routes by sigmoid scores"),
        (4, ["--parallelism.cp", "4", "--training.seq_len", "8"], r"\(multi-token prediction\) with parallelism.cp > 1 \(CP\): .*\(it looks 2 tokens ahead; training.seq_len = 8 makes chunks of 1\)"),
    ],
)
def test_settings_the_model_cannot_honour_are_config_errors(world, settings, message):
    """Checked by the run plan, before any process group or weight exists."""
    with pytest.raises(ConfigError, match=message):
        RunPlan.build(load_config([*DS, "--model.flavor", "tiny", *settings]), world)
