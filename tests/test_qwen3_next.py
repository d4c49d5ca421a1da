"""The Qwen3-Next family: the 80B-A3B sizes, Hugging Face parity (logits, packed documents, import and export),
greedy generation with the recurrent-state cache against transformers, training and the dry run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import meshloom
from meshloom.checkpoint.hf import write_hf_folder
from meshloom.inference.generate import generate
from meshloom.models.registry import get_model_args, get_model_spec

transformers = pytest.importorskip("transformers")
SPEC = get_model_spec("qwen3_next")


# --------------------------------------------------------------------------- sizes


def test_every_flavour_builds_and_its_shape_model_counts_the_same_parameters():
    for flavor, args in SPEC.flavors.items():
        with torch.device("meta"):
            model = SPEC.model_cls(args)
        assert SPEC.shape_model(args).num_params() == model.num_params(), flavor
    tiny = get_model_args("qwen3_next", "tiny")
    assert [tiny.layer_type(i) for i in range(4)] == ["linear_attention"] * 3 + ["full_attention"]


def test_80b_a3b_sizes():
    """Qwen: "80B in total and 3B activated". The architecture transformers models holds 79.67B (its MTP block, in
    the released checkpoint only, adds about 1.65B: 512 more experts of 3 x 512 x 2048, one gated-attention layer and
    the 4096 -> 2048 projection). Per token 3.87B are active with both 0.31B vocabulary tables, 3.25B without them
    (Qwen's 3B)."""
    args = get_model_args("qwen3_next", "80B-A3B")
    shape = SPEC.shape_model(args)
    assert shape.num_params() == 79_674_391_296
    table = args.vocab_size * args.dim
    assert shape.active_params() == pytest.approx(3.875e9, rel=1e-3)
    assert shape.active_params() - 2 * table == pytest.approx(3.25e9, rel=2e-3)
    mtp = 512 * 3 * 512 * 2048 + 2 * 2048 * 2048 + (2 * 16 * 256 + 2 * 2 * 256 + 16 * 256) * 2048
    assert 80e9 < shape.num_params() + mtp < 81.5e9


# --------------------------------------------------------------------------- Hugging Face


def hf_config(**overrides):
    values = dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[2], tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        attn_implementation="eager",
    )  # fmt: skip
    values.update(overrides)
    return transformers.Qwen3NextConfig(**values)


def hf_qwen3_next(tmp: Path, seed: int = 0, **overrides):
    """A random Qwen3NextForCausalLM saved with save_pretrained: zero-centred norms, GDN norms, decays and the router
    all randomised, so a swapped or mis-split tensor would show."""
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(hf_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5) if "linear_attn" not in name else p.uniform_(0.5, 1.5)
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0.0, 0.5)
            elif name.endswith("dt_bias"):
                p.uniform_(-3.0, 0.0)
            elif name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
    model.save_pretrained(tmp)
    return model


TOKENS = torch.randint(0, 512, (2, 80), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' model, meshloom's import of it, the folder)."""
    folder = tmp_path_factory.mktemp("qwen3_next") / "hf"
    theirs = hf_qwen3_next(folder)
    return theirs, meshloom.from_hf(folder), folder


def test_hf_logits_equal_transformers(pair):
    theirs, ours, folder = pair
    saved = load_file(folder / "model.safetensors")
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in saved and "model.layers.0.mlp.experts.7.gate_proj.weight" in saved
    assert [b.attention.recurrent for b in ours.layers.values()] == [True, True, True, False]
    assert not ours.layers["2"].is_moe and ours.args.rotary_dim == 8
    with torch.no_grad():
        diff = (ours(TOKENS) - theirs(TOKENS).logits).abs().max().item()
    assert diff <= 1e-5


def test_packed_documents_equal_each_document_alone(pair):
    """document_ids: attention is block-diagonal, the GDN state and the convolution restart at every document."""
    theirs, ours, _ = pair
    cuts = [(0, 23), (23, 61), (61, 80)]
    document_ids = torch.zeros(1, 80, dtype=torch.long)
    for i, (start, end) in enumerate(cuts):
        document_ids[:, start:end] = i
    with torch.no_grad():
        packed = ours(TOKENS[:1], document_ids=document_ids)
        for start, end in cuts:
            alone = theirs(TOKENS[:1, start:end]).logits
            assert (packed[:, start:end] - alone).abs().max().item() <= 1e-5


def test_export_round_trip(pair, tmp_path: Path):
    """meshloom -> Hugging Face: transformers loads it and computes the same logits; the fused tensors come back
    exactly as imported."""
    _, ours, folder = pair
    write_hf_folder(ours.state_dict(), SPEC, ours.args, tmp_path / "exported", torch.float32)
    reloaded = transformers.Qwen3NextForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (reloaded(TOKENS).logits - ours(TOKENS)).abs().max().item() <= 1e-5
    original, exported = load_file(folder / "model.safetensors"), load_file(tmp_path / "exported" / "model.safetensors")
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def test_import_ignores_the_released_mtp_block(pair, tmp_path: Path):
    from safetensors.torch import save_file

    _, ours, folder = pair
    tensors = load_file(folder / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    (tmp_path / "mtp").mkdir()
    save_file(tensors, tmp_path / "mtp" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "mtp" / "config.json").write_text((folder / "config.json").read_text())
    with torch.no_grad():
        assert torch.equal(meshloom.from_hf(tmp_path / "mtp")(TOKENS), ours(TOKENS))


# --------------------------------------------------------------------------- generation


def test_greedy_generation_equals_transformers_and_the_uncached_path(pair):
    """64 new tokens: transformers' generate (its own cache), meshloom with the recurrent-state and convolution cache,
    and meshloom recomputing every step agree; a left-padded batch row generates what its prompt generates alone."""
    theirs, ours, _ = pair
    prompt = TOKENS[0, :19].tolist()
    with torch.no_grad():
        expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, min_new_tokens=64)
    reference = expected[0, len(prompt) :].tolist()
    cached = generate(ours, [prompt], 64)
    assert cached.tokens[0] == reference
    short = TOKENS[1, :7].tolist()
    both = generate(ours, [prompt, short], 64)
    uncached = generate(ours, [prompt, short], 64, use_cache=False)
    assert both.tokens == uncached.tokens
    assert both.tokens[0] == reference and both.tokens[1] == generate(ours, [short], 64).tokens[0]


# --------------------------------------------------------------------------- training, planning


def test_training_reduces_the_loss_with_packed_documents(tiny_args):
    from meshloom.config.loader import load_config
    from meshloom.train.trainer import Trainer

    settings = ["--model.name", "qwen3_next", "--training.steps", "8", "--optimizer.lr", "1e-2", "--data.document_mask", "true"]
    losses = Trainer(load_config(tiny_args + settings)).train()
    assert losses[-1] < losses[0] - 0.4, losses


def test_dry_run_80b_a3b_prints_a_plan():
    from meshloom.config.loader import load_config
    from meshloom.planning.dry_run import dry_run

    config = load_config([
        "--model.name", "qwen3_next", "--model.flavor", "80B-A3B", "--training.seq_len", "4096",
        "--training.local_batch_size", "2", "--parallelism.tp", "2", "--parallelism.dp_shard", "32", "--parallelism.ep", "16",
    ])  # fmt: skip
    report = dry_run(config, 64)
    text = report.format()
    print(text)
    assert "parameters (built shards)" in text and report.built_param_bytes == report.rank_params
    # Per rank: the routed experts (77.3B) split over ep 16 x the remaining FSDP 2, the rest over dp_shard 32 and tp 2.
    experts = 48 * 512 * 3 * 512 * 2048
    expected = 4 * (experts / 32 + (79_674_391_296 - experts) / 64)
    assert 0.8 < report.built_param_bytes / expected < 1.3


def test_tensor_parallel_needs_whole_gated_deltanet_heads():
    from meshloom.config.errors import ConfigError
    from meshloom.config.loader import load_config
    from meshloom.planning.run_plan import RunPlan

    config = load_config(["--model.name", "qwen3_next", "--model.flavor", "tiny", "--parallelism.tp", "4"])
    with pytest.raises(ConfigError, match=r"tp=4 does not divide the model's n_kv_heads=2"):
        RunPlan.build(config, 4)
