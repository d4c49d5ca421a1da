"""The gpt-oss family: published sizes, FlexAttention's masks and sinks, Hugging Face interop, generation with the
window and the sinks, refused settings and the dry runs of 20B and 120B."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import meshloom
from meshloom.checkpoint.hf import HFFolder, write_hf_folder
from meshloom.cli.checkpoint_commands import convert_main
from meshloom.inference.generate import generate
from meshloom.models.common.flex_attention import MaskSpec, flex_attention, masked_attention_with_sinks
from meshloom.models.registry import get_model_args, get_model_spec

transformers = pytest.importorskip("transformers")
SPEC = get_model_spec("gpt_oss")


# --------------------------------------------------------------------------- sizes


def test_every_flavour_builds_and_its_shape_model_counts_the_same_parameters():
    for flavor, args in SPEC.flavors.items():
        with torch.device("meta"):
            model = SPEC.model_cls(args)
        assert SPEC.shape_model(args).num_params() == model.num_params(), flavor


@pytest.mark.parametrize(("flavor", "total", "released_active"), [("20B", 20.91e9, 3.61e9), ("120B", 116.83e9, 5.13e9)])
def test_published_sizes(flavor, total, released_active):
    """OpenAI's model card: 20.91B (3.61B active) and 116.83B (5.13B active). Its active count leaves out the
    embedding table (a lookup), as matmul_params_per_token does; active_params counts the table too."""
    shape = SPEC.shape_model(get_model_args("gpt_oss", flavor))
    assert shape.num_params() == pytest.approx(total, rel=1e-3)
    assert shape.matmul_params_per_token() == pytest.approx(released_active, rel=2e-3)
    assert shape.active_params() - shape.matmul_params_per_token() == pytest.approx(201088 * 2880, rel=1e-4)


def test_muon_leaves_the_expert_biases_and_the_sinks_to_adamw():
    """The expert biases are 2-D ([experts, width]) but hold one vector per expert: Muon must not orthogonalise them."""
    from meshloom.train.muon import parameter_kinds

    with torch.device("meta"):
        model = SPEC.model_cls(get_model_args("gpt_oss", "tiny"))
    kinds = parameter_kinds(model, SPEC.adamw_only)
    assert kinds["layers.0.moe.experts.w13"] == kinds["layers.0.attention.wq.weight"] == "muon"
    for name in ("moe.experts.b13", "moe.experts.b2", "moe.router.weight", "moe.router.bias", "attention.sinks"):
        assert kinds[f"layers.1.{name}"] == "adamw", name


# --------------------------------------------------------------------------- FlexAttention


def _dense_reference(q, k, v, mask, sinks):
    n_rep = q.shape[1] // k.shape[1]
    return masked_attention_with_sinks(q, k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1), mask, sinks)


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_flex_attention_trains_on_cpu_like_the_dense_softmax(window, documents, with_sinks):
    """Windows, documents and sinks alone and together: outputs and every gradient (sinks included) equal an explicit
    mask with the sink as an extra softmax column."""
    gen = torch.Generator().manual_seed(0)
    b, s = 2, 40
    q, k, v = (torch.randn(b, h, s, 16, generator=gen, requires_grad=True) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=gen, requires_grad=True) if with_sinks else None
    document_ids = torch.tensor([[0] * 13 + [1] * 27, [0] * 30 + [1] * 10]) if documents else None
    spec = MaskSpec(window=window)
    ours = flex_attention(q, k, v, spec, document_ids, sinks)
    mask = spec.dense(s, s, q.device)[None, None]
    if documents:
        mask = mask & (document_ids[:, None, :, None] == document_ids[:, None, None, :])
    reference = _dense_reference(q, k, v, mask, sinks)
    assert (ours - reference).abs().max() <= 1e-5
    inputs = [t for t in (q, k, v, sinks) if t is not None]
    grad = torch.randn(ours.shape, generator=gen)
    for a, b_ in zip(torch.autograd.grad(ours, inputs, grad), torch.autograd.grad(reference, inputs, grad), strict=True):
        assert (a - b_).abs().max() <= 1e-5


@pytest.mark.cuda
def test_compiled_flex_attention_on_cuda_trains_like_eager():
    """CUDA: the blocks compiled (FlexAttention fused by inductor, windows, documents and sinks in play) give the
    logits and gradients of the eager model."""
    args = get_model_args("gpt_oss", "tiny")
    torch.manual_seed(0)
    eager = SPEC.model_cls(args).cuda()
    with torch.no_grad():
        for block in eager.layers.values():
            block.attention.sinks.normal_(0.0, 1.0)
    compiled = SPEC.model_cls(args).cuda()
    compiled.load_state_dict(eager.state_dict())
    for block in compiled.layers.values():
        block.compile(fullgraph=True)
    tokens = torch.randint(0, 512, (2, 128), device="cuda")
    documents = torch.cat([torch.zeros(2, 50), torch.ones(2, 78)], dim=1).long().cuda()
    losses = [model(tokens, document_ids=documents).logsumexp(-1).mean() for model in (eager, compiled)]
    assert (losses[0] - losses[1]).abs() <= 1e-4
    for loss in losses:
        loss.backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert (a.grad - b.grad).abs().max() <= 1e-4, name


def test_the_ring_skips_key_chunks_behind_the_window():
    """Context parallel: rank 1 of 2 holds head-tail chunks 1 and 2 of 4 (16 tokens each). Under a window of 16,
    chunk 0 (on rank 0) is wholly behind chunk 2's window and only its last 15 keys reach chunk 1's first 15 queries; chunk 2 sees the
    band of chunk 1 and its own diagonal."""
    from meshloom.parallel.ring_blocks import RingBlocks
    from meshloom.parallel.sequence_layout import SequenceLayout

    layout = SequenceLayout(2)
    blocks = RingBlocks(layout, 1, 32, None, window=16)
    # Rank 0's chunks 0 and 3: queries 16..30 of chunk 1 on keys 1..15 of chunk 0 (query 31 is 16 past key 15).
    (from_rank0,) = blocks(0)
    assert (from_rank0.rows, from_rank0.keys, from_rank0.causal) == (slice(0, 15), slice(1, 16), False)
    assert len(RingBlocks(layout, 1, 32, None)(0)) == 2  # without the window chunk 0 is visible to both
    own = blocks(1)  # chunk 1 on itself, chunk 2 on chunk 1 (band), chunk 2 on itself
    assert [(b.rows, b.keys, b.causal) for b in own] == [
        (slice(0, 16), slice(0, 16), True), (slice(16, 31), slice(1, 16), False), (slice(16, 32), slice(16, 32), True)
    ]  # fmt: skip
    # Query at position 32 + i sees key 17 + j when they are less than 16 apart.
    i, j = torch.arange(15)[:, None], torch.arange(15)[None, :]
    assert torch.equal(own[1].mask[0], (32 + i) - (17 + j) < 16)


# --------------------------------------------------------------------------- Hugging Face

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
WINDOW = 16


def hf_gpt_oss(tmp: Path, seed: int = 0, window: int = WINDOW, layer_types=LAYER_TYPES):
    """A random GptOssForCausalLM saved with save_pretrained: windows of 16, YaRN over an original 64 tokens, every
    sink, bias and norm scale random and a decisive router and head, so a misplaced tensor would show."""
    config = transformers.GptOssConfig(
        vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=len(layer_types), num_attention_heads=8,
        num_key_value_heads=4, head_dim=16, num_local_experts=8, num_experts_per_tok=4, sliding_window=window,
        max_position_embeddings=256, layer_types=list(layer_types), attn_implementation="eager",
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0},
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith("router.weight"):
                p.normal_(0.0, 0.5)
            elif name.endswith("lm_head.weight"):  # logits of a few units: greedy choices are clear-cut
                p.normal_(0.0, 0.2)
    model.save_pretrained(tmp)
    return model


TOKENS = torch.randint(0, 512, (2, 80), generator=torch.Generator().manual_seed(0))


def test_hf_logits_export_and_round_trip(tmp_path: Path):
    """80 tokens, windows of 16 on two of four layers, random sinks: logits equal transformers' within 1e-5, and the
    window and the sinks both matter (changing either moves the logits far beyond that)."""
    theirs = hf_gpt_oss(tmp_path / "hf")
    ours = meshloom.from_hf(tmp_path / "hf")
    assert ours.args.layer_types == tuple(LAYER_TYPES) and ours.args.sliding_window == WINDOW
    with torch.no_grad():
        expected = theirs(TOKENS).logits
        logits = ours(TOKENS)
        diff = (logits - expected).abs().max().item()
        print(f"hf logits: max |diff| {diff:.2e} (logits up to {expected.abs().max().item():.1f})")
        assert diff <= 1e-5
        for block in ours.layers.values():
            block.attention.sinks.add_(1.0)
        assert (ours(TOKENS) - expected).abs().max() > 1e-2
    wider = hf_gpt_oss(tmp_path / "wide", window=32)
    with torch.no_grad():
        assert (wider(TOKENS).logits - expected).abs().max() > 1e-2

    # meshloom -> HF (from our own weights), read back by transformers.
    ours = meshloom.from_hf(tmp_path / "hf")
    write_hf_folder(ours.state_dict(), SPEC, ours.args, tmp_path / "exported", torch.float32)
    reloaded = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (reloaded(TOKENS).logits - logits).abs().max().item() <= 1e-5

    # HF -> meshloom checkpoint -> HF: the same tensors, bit for bit.
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    assert convert_main([str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    assert convert_main([str(tmp_path / "ckpt"), str(tmp_path / "back"), "--dtype", "float32"]) == 0
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(saved)
    assert all(torch.equal(back[k], v) for k, v in saved.items())
    assert HFFolder(tmp_path / "back").args == HFFolder(tmp_path / "hf").args
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "gpt_oss"


def test_greedy_generation_past_the_window_matches_transformers(tmp_path: Path):
    """64 new tokens after prompts of 5 to 12 (windows of 16, so most steps attend through the window), batched and
    left-padded with the KV cache: the same tokens as transformers' greedy search."""
    theirs = hf_gpt_oss(tmp_path)
    ours = meshloom.from_hf(tmp_path)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (12, 5)]
    batched = generate(ours, prompts, 64)
    for prompt, tokens in zip(prompts, batched.tokens, strict=True):
        expected = theirs.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=64,
            do_sample=False, pad_token_id=0,
        )[0, len(prompt):].tolist()  # fmt: skip
        assert len(tokens) == 64 and tokens == expected
    uncached = generate(ours, prompts[:1], 24, use_cache=False)
    assert uncached.tokens[0] == batched.tokens[0][:24]


def test_quantised_release_folders_and_a_balancing_bias_are_refused(tmp_path: Path):
    hf_gpt_oss(tmp_path / "hf", layer_types=LAYER_TYPES[:2])
    model = meshloom.from_hf(tmp_path / "hf")
    state = model.state_dict()
    state["layers.1.moe.expert_bias"][3] = 0.01
    with pytest.raises(ValueError, match=r"1 MoE layers \(first layers.1.moe.expert_bias\) route with a non-zero"):
        write_hf_folder(state, SPEC, model.args, tmp_path / "out")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="the weights are quantised \\(mxfp4\\)"):
        HFFolder(tmp_path / "hf")


# --------------------------------------------------------------------------- planning

GIB = 2**30
TRAIN = ["--training.seq_len", "4096", "--training.local_batch_size", "1", "--training.mixed_precision", "bf16",
         "--activation_checkpoint.mode", "full", "--training.device", "cuda"]  # fmt: skip


def _inference_weight_bytes(flavor: str) -> float:
    """The released checkpoints' weights: expert stacks in MXFP4 (4-bit values plus one 8-bit scale per 32: 4.25
    bits), everything else in bf16."""
    shape = SPEC.shape_model(get_model_args("gpt_oss", flavor))
    params = [p for layer in range(shape.n_layers) for p in shape.block_params(layer)] + shape.root_params(True, True)
    return sum(p.numel * (4.25 / 8 if p.expert else 2) for p in params)


@pytest.mark.parametrize(("flavor", "world", "layout", "params_gib"), [("120B", 8, ["--parallelism.dp_shard", "8", "--parallelism.ep", "8"], 54.4), ("20B", 1, [], 77.9)])
def test_dry_runs_against_the_published_single_gpu_fit(flavor, world, layout, params_gib):
    """OpenAI runs 120B on one 80 GB GPU and 20B in 16 GB: inference, experts in MXFP4 (about 61 GiB and 13 GiB of
    weights). Training keeps fp32 weights, fp32 gradients and two AdamW moments, 16 bytes per parameter: 120B over
    8 x 80 GiB holds 54.4 GiB of weights per rank and peaks far above 80 GiB, as does 20B on one GPU. The planner
    says so with the smallest peak, and finds the layouts that do fit (120B on 32 GPUs, 20B on 8)."""
    from meshloom.config.errors import UserError
    from meshloom.config.loader import load_config
    from meshloom.planning.dry_run import dry_run
    from meshloom.planning.planner import plan
    from meshloom.planning.step_time import Cluster

    assert _inference_weight_bytes(flavor) / GIB < {"120B": 80, "20B": 16 * 1e9 / GIB}[flavor]
    report = dry_run(load_config(["--model.name", "gpt_oss", "--model.flavor", flavor, *TRAIN, *layout]), world)
    print(report.format())
    assert report.built_param_bytes == report.rank_params
    assert report.rank_params / GIB == pytest.approx(params_gib, rel=2e-3)
    assert report.memory.optimizer == 2 * report.rank_params and report.memory.peak > 2.5 * 80 * GIB
    with pytest.raises(UserError, match=f"the {flavor} model does not fit on {world} x 80 GiB under any layout"):
        plan(flavor, Cluster(world, world, 80), 4096, 8, model="gpt_oss")
    gpus = {"120B": 32, "20B": 8}[flavor]
    best = plan(flavor, Cluster(gpus, 8, 80), 4096, gpus, model="gpt_oss")[0]
    assert best.memory.peak <= 0.9 * 80 * GIB
