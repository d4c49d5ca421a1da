"""DeepSeek-V3: MLA against a naive reference, YaRN against transformers, multi-token prediction against a hand-written
loss, Hugging Face import/export, parameter counts, layout errors, a training run, and loss parity of FSDP, TP, PP
(1F1B and ZBVZeroBubble) and CP against one process (fp32, 10 steps, MTP on)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import meshloom
from meshloom.checkpoint.hf import write_hf_folder
from meshloom.config.loader import ConfigError, load_config
from meshloom.models.common.mla import MultiHeadLatentAttention
from meshloom.models.common.rope import YarnScaling, rope_tables
from meshloom.models.deepseek_v3 import hf as deepseek_hf
from meshloom.models.deepseek_v3.model import DeepSeekV3
from meshloom.models.registry import get_model_args, get_model_spec
from meshloom.parallel.dims import ParallelDims
from meshloom.planning.dry_run import dry_run
from meshloom.planning.run_plan import RunPlan
from meshloom.tools.parity import FP32_TOLERANCE, compare

SPEC = get_model_spec("deepseek_v3")
MOE_AVAILABLE = importlib.util.find_spec("meshloom.models.common.moe") is not None
needs_moe = pytest.mark.skipif(not MOE_AVAILABLE, reason="MoE blocks need meshloom.models.common.moe")


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
    rms = lambda t, g: t / torch.sqrt((t * t).mean(-1, keepdim=True) + 1e-6) * g  # noqa: E731
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
    with pytest.raises(ValueError, match="beta_fast > beta_slow"):
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


# --------------------------------------------------------------------------- Hugging Face


def random_hf_folder(path: Path, q_lora_rank: int | None, rope_interleave: bool, yarn: bool) -> object:
    transformers = pytest.importorskip("transformers")
    values = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, first_k_dense_replace=2, kv_lora_rank=24, q_lora_rank=q_lora_rank, qk_rope_head_dim=8,
        v_head_dim=12, qk_nope_head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.1,
        rope_interleave=rope_interleave, attn_implementation="eager",
    )  # fmt: skip
    if yarn:  # mscale != mscale_all_dim, so both YaRN temperatures act
        values["rope_scaling"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "mscale": 0.8,
                                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 16}  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**values)).eval()
    with torch.no_grad():  # random norm scales too, so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize(
    "q_lora_rank, rope_interleave, yarn", [(16, True, True), (None, True, True), (16, False, True), (16, True, False)]
)
def test_hf_logits_match_transformers_both_ways(tmp_path, q_lora_rank, rope_interleave, yarn):
    import transformers

    reference = random_hf_folder(tmp_path / "hf", q_lora_rank, rope_interleave, yarn)
    ours = meshloom.from_hf(tmp_path / "hf")
    assert ours.args.mtp_depth == 0 and ours.args.q_lora_rank == (q_lora_rank or 0)
    tokens = torch.randint(0, 128, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        assert expected.std() > 0.5  # large enough logits for the comparison to mean something
        assert (ours(tokens) - expected).abs().max() <= 1e-5

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    write_hf_folder(ours.state_dict(), SPEC, ours.args, tmp_path / "back", dtype=torch.float32, base_config=config)
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (back(tokens).logits - expected).abs().max() <= 1e-5
    assert deepseek_hf.args_from_hf_config(json.loads((tmp_path / "back" / "config.json").read_text())) == ours.args


def test_hf_export_leaves_out_prediction_modules_and_import_keeps_them_initialised(tmp_path):
    from meshloom.checkpoint.hf import HFFolder, load_into_model_parts

    model = DeepSeekV3(tiny())
    names = list(model.state_dict())
    exported = SPEC.hf.exported_names(names, model.args)
    assert any(n.startswith("mtp.") for n in names) and not any(n.startswith("mtp.") for n in exported)
    write_hf_folder(model.state_dict(), SPEC, model.args, tmp_path / "hf", dtype=torch.float32)
    fresh = DeepSeekV3(tiny())
    before = fresh.mtp["0"].proj.weight.clone()
    load_into_model_parts([fresh], HFFolder(tmp_path / "hf"))
    assert torch.equal(fresh.layers["1"].attention.wkv_b.weight, model.layers["1"].attention.wkv_b.weight)
    assert torch.equal(fresh.mtp["0"].proj.weight, before)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_key_value_heads": 2}, "num_key_value_heads=2 is not supported"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type='llama3' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ],
)
def test_unsupported_hf_configs_are_named(changes, message):
    base = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128,
            "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        deepseek_hf.args_from_hf_config({**base, **changes})


# --------------------------------------------------------------------------- shapes, counts and errors


def test_published_flavours_have_the_published_parameter_counts():
    v3 = get_model_args("deepseek_v3", "671B")
    main, with_mtp = SPEC.shape_model(dataclasses.replace(v3, mtp_depth=0)), SPEC.shape_model(v3)
    assert main.num_params() == pytest.approx(671.0e9, rel=1e-3)
    # Active per token without the embedding table: DeepSeek's 36.6B "including 0.9B for the output head".
    assert main.matmul_params_per_token() - v3.dim == pytest.approx(36.6e9, rel=2e-3)
    # One prediction module: DeepSeek's 11.5B unique parameters (its eh_proj is 0.1B more here) over a shared embedding and head.
    assert with_mtp.num_params() - main.num_params() == pytest.approx(11.6e9, rel=5e-3)
    lite = SPEC.shape_model(get_model_args("deepseek_v3", "16B"))
    assert lite.num_params() == pytest.approx(15.7e9, rel=2e-3)
    assert lite.matmul_params_per_token() - 2048 == pytest.approx(2.45e9, rel=1e-2)


@pytest.mark.parametrize("flavor", ["tiny", "debug", "16B", "671B"])
def test_shape_model_counts_what_the_meta_model_holds(flavor):
    args = get_model_args("deepseek_v3", flavor)
    if args.has_moe and not MOE_AVAILABLE:
        pytest.skip("MoE blocks need meshloom.models.common.moe")
    with torch.device("meta"):
        model = DeepSeekV3(args)
    assert model.num_params() == SPEC.shape_model(args).num_params()
    with torch.device("meta"):  # a pipeline's last stage: its blocks, the output, the prediction modules, the embedding copy
        last = SPEC.carve_stage(DeepSeekV3(args), [args.n_layers - 1], first=False, last=True)
    shape = SPEC.shape_model(args)
    assert sum(p.numel() for p in last.parameters()) == sum(
        p.numel for p in [*shape.block_params(args.n_layers - 1), *shape.root_params(first=False, last=True)]
    )


def _dims(**degrees) -> ParallelDims:
    values = {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1, **degrees}
    return ParallelDims(**values, world_size=math.prod(values.values()))


def test_layout_mistakes_are_named_config_errors():
    with pytest.raises(ConfigError, match="parallelism.tp=3 does not divide the model's n_heads=4"):
        SPEC.check_layout(tiny(), _dims(tp=3))
    with pytest.raises(ConfigError, match="vocab_size=510"):
        SPEC.check_layout(tiny(vocab_size=510), _dims(tp=4))
    base = ["--model.name", "deepseek_v3", "--model.flavor", "tiny", "--training.local_batch_size", "8"]
    with pytest.raises(ConfigError, match="parallelism.ep > 1 needs a mixture-of-experts model"):
        RunPlan.build(load_config([*base, "--parallelism.ep", "2", "--parallelism.dp_shard", "2"]), 2)
    with pytest.raises(ConfigError, match="multi-token prediction looks 2 tokens ahead"):
        from meshloom.models.deepseek_v3.parallelize import check_context_parallel
        from meshloom.parallel.context import SequenceLayout

        check_context_parallel(tiny(), SequenceLayout(4), seq_len=8)
    with pytest.raises(ValueError, match="n_limited_groups \\(3\\) must be <= n_expert_groups \\(2\\)"):
        tiny(n_dense_layers=1, n_limited_groups=3)


@pytest.mark.skipif(MOE_AVAILABLE, reason="only while the shared MoE layer is missing")
def test_moe_flavours_say_what_they_need_before_anything_is_built():
    with pytest.raises(ConfigError, match="need the shared MoE layer"):
        RunPlan.build(load_config(["--model.name", "deepseek_v3", "--model.flavor", "debug"]), 1)
    with pytest.raises(ValueError, match="need the shared MoE layer"):
        DeepSeekV3(get_model_args("deepseek_v3", "debug"))


@pytest.mark.parametrize(
    "overrides",
    [
        ["--parallelism.tp", "2"],  # FSDP 4 x TP 2: rank 0 holds the whole model, prediction modules included
        ["--parallelism.tp", "2", "--parallelism.pp", "2"],  # PP 2 x FSDP 2 x TP 2: rank 0 holds the first stage
    ],
)
def test_dry_run_of_tiny_matches_its_estimate(overrides):
    config = load_config([
        "--model.name", "deepseek_v3", "--model.flavor", "tiny", "--model.n_layers", "4", "--training.seq_len", "64",
        "--training.local_batch_size", "4", "--training.mixed_precision", "bf16", *overrides,
    ])  # fmt: skip
    report = dry_run(config, 8)
    assert report.built_param_bytes == report.rank_params
    assert report.memory.peak > report.memory.params > 0 and report.comm_bytes["tp"] > 0


@needs_moe
def test_dry_run_of_671b_on_1024_ranks():
    config = load_config([
        "--model.name", "deepseek_v3", "--model.flavor", "671B", "--training.seq_len", "4096",
        "--training.local_batch_size", "16", "--pipeline.microbatches", "16", "--parallelism.pp", "16",
        "--training.mixed_precision", "bf16", "--activation_checkpoint.mode", "full",
    ])  # fmt: skip
    report = dry_run(config, 1024)
    assert report.seconds < 120
    assert report.built_param_bytes == report.rank_params


# --------------------------------------------------------------------------- parity


PARITY_LAYOUTS = ["dp_shard=2", "tp=2", "cp=2", "pp=2", "pp=2,pipeline.schedule=ZBVZeroBubble"]


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    os.environ.pop("WORLD_SIZE", None)
    # 4 blocks, so that the V schedule gets one per stage; tiny has two prediction depths (MTP on).
    reference, comparisons = compare(
        PARITY_LAYOUTS, steps=10, workdir=tmp_path_factory.mktemp("deepseek-parity"),
        common="model.name=deepseek_v3,model.n_layers=4",
    )  # fmt: skip
    return reference, {c.layout.spec: c for c in comparisons}


@pytest.mark.parametrize("spec", PARITY_LAYOUTS)
def test_layout_matches_one_process_with_mtp(parity, spec):
    reference, comparisons = parity
    c = comparisons[spec]
    assert len(c.curve.losses) == 10 and len(reference.aux["mtp_loss"]) == 10
    assert c.max_loss_diff <= FP32_TOLERANCE, (spec, reference.losses, c.curve.losses)
    assert c.max_aux_diff <= FP32_TOLERANCE, (spec, reference.aux, c.curve.aux)
    assert c.grad_norm_diff <= FP32_TOLERANCE
