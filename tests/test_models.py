"""Tests for meshloom.models: Llama 3 shapes, numerics, initialisation and the registry."""

from __future__ import annotations

import ast
import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshloom.models.llama3 import LLAMA3_FLAVORS, Llama3Args, RopeScaling, Transformer
from meshloom.models.llama3.model import apply_rope, rope_tables, scale_rope_frequencies
from meshloom.models.registry import get_model_args, get_model_spec

TINY = LLAMA3_FLAVORS["tiny"]
MODELS_DIR = Path(__file__).resolve().parents[1] / "meshloom" / "models"


def build_tiny(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(dataclasses.replace(TINY, **overrides))


def materialise(args: Llama3Args, seed: int) -> Transformer:
    """The meta-device build path: allocate nothing, then to_empty + init_weights."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


# --------------------------------------------------------------------------- sizes

# Published parameter counts of the Llama 3.1 / 3.2 checkpoints.
EXPECTED_PARAMS = {
    "debug": 6_163_712,
    "1B": 1_235_814_400,
    "3B": 3_212_749_824,
    "8B": 8_030_261_248,
    "70B": 70_553_706_496,
    "405B": 405_853_388_800,
}
ROUNDED = {"1B": "1.24B", "3B": "3.21B", "8B": "8.03B", "70B": "70.6B", "405B": "405.9B"}


def hand_count(a: Llama3Args) -> int:
    kv = a.n_kv_heads or a.n_heads
    hd = a.dim // a.n_heads
    attn = a.dim * a.n_heads * hd * 2 + a.dim * kv * hd * 2
    ffn = 3 * a.dim * a.ffn_hidden_dim
    per_layer = attn + ffn + 2 * a.dim
    tables = 1 if a.tie_embeddings else 2
    return tables * a.vocab_size * a.dim + a.n_layers * per_layer + a.dim


@pytest.mark.parametrize("flavor", list(LLAMA3_FLAVORS))
def test_flavor_builds_on_meta_with_expected_param_count(flavor: str) -> None:
    args = LLAMA3_FLAVORS[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    n = model.num_params()
    assert n == hand_count(args)
    if flavor in EXPECTED_PARAMS:
        assert n == EXPECTED_PARAMS[flavor]
    if flavor in ROUNDED:
        digits = 1 if n >= 10**10 else 2
        assert f"{n / 1e9:.{digits}f}B" == ROUNDED[flavor]


def test_published_hidden_sizes() -> None:
    hidden = {f: LLAMA3_FLAVORS[f].ffn_hidden_dim for f in ("debug", "1B", "3B", "8B", "70B", "405B")}
    assert hidden == {
        "debug": 768,
        "1B": 8192,
        "3B": 8192,
        "8B": 14336,
        "70B": 28672,
        "405B": 53248,
    }


def test_num_params_exclude_embedding() -> None:
    with torch.device("meta"):
        debug = Transformer(LLAMA3_FLAVORS["debug"])
        one_b = Transformer(LLAMA3_FLAVORS["1B"])
    assert debug.num_params(exclude_embedding=True) == 6_163_712 - 2048 * 256
    # A tied table is also the output projection, which does matmul work.
    assert one_b.num_params(exclude_embedding=True) == one_b.num_params()


# --------------------------------------------------------------------------- forward


def test_forward_shape_and_dtype() -> None:
    model = build_tiny()
    tokens = torch.randint(0, TINY.vocab_size, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, TINY.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_forward_rejects_sequences_longer_than_max_seq_len() -> None:
    model = build_tiny(max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_initial_loss_is_close_to_uniform() -> None:
    # Logits of at most unit variance at init give a loss within ~0.5 nat of ln(vocab);
    # a too-large tied table would make each token predict itself (loss >> ln(vocab)).
    tokens = torch.randint(0, TINY.vocab_size, (4, 64))
    for tie in (False, True):
        model = build_tiny(tie_embeddings=tie)
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.8, (tie, loss.item())


def test_causal_future_tokens_do_not_change_past_logits() -> None:
    model = build_tiny()
    tokens = torch.randint(0, TINY.vocab_size, (2, 24))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % TINY.vocab_size
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert (a[:, 10:] - b[:, 10:]).abs().amax() > 1e-3


def test_tied_embeddings_share_storage() -> None:
    model = build_tiny(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    assert model.num_params() == hand_count(dataclasses.replace(TINY, tie_embeddings=True))
    assert model.num_params() == build_tiny().num_params() - TINY.vocab_size * TINY.dim
    # to_empty() replaces parameters one by one; init_weights must restore the tie.
    rebuilt = materialise(dataclasses.replace(TINY, tie_embeddings=True), seed=0)
    assert rebuilt.output.weight is rebuilt.tok_embeddings.weight
    # Gradients from the lookup and the projection land in one tensor.
    rebuilt(torch.randint(0, TINY.vocab_size, (1, 8))).sum().backward()
    assert rebuilt.output.weight.grad is rebuilt.tok_embeddings.weight.grad


def naive_attention(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_kv: int) -> torch.Tensor:
    """Loop-over-heads reference: query head h uses kv head h // (n_heads // n_kv)."""
    b, s, _ = x.shape
    hd = attn.head_dim
    q = apply_rope(attn.wq(x).view(b, s, -1, hd), cos, sin)
    k = apply_rope(attn.wk(x).view(b, s, -1, hd), cos, sin)
    v = attn.wv(x).view(b, s, -1, hd)
    n_heads = q.shape[2]
    group = n_heads // n_kv
    future = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
    heads = []
    for h in range(n_heads):
        kv = h // group
        scores = q[:, :, h] @ k[:, :, kv].transpose(-1, -2) / math.sqrt(hd)
        scores = scores.masked_fill(future, float("-inf"))
        heads.append(scores.softmax(-1) @ v[:, :, kv])
    return attn.wo(torch.cat(heads, dim=-1))


def test_grouped_query_attention_matches_naive_reference() -> None:
    assert TINY.n_heads // TINY.n_kv_heads == 2  # the test needs real sharing
    model = build_tiny()
    attn = model.layers["0"].attention
    x = torch.randn(2, 12, TINY.dim)
    cos, sin = model.rope_cos[:12], model.rope_sin[:12]
    with torch.no_grad():
        torch.testing.assert_close(
            attn(x, cos, sin), naive_attention(attn, x, cos, sin, TINY.n_kv_heads), rtol=1e-5, atol=1e-5
        )


def test_pipeline_style_split_matches_full_model() -> None:
    model = build_tiny()
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    del first.layers["1"]
    first.norm = None
    first.output = None
    last.tok_embeddings = None
    del last.layers["0"]
    tokens = torch.randint(0, TINY.vocab_size, (2, 10))
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 10, TINY.dim)
        torch.testing.assert_close(last(hidden), model(tokens))


# --------------------------------------------------------------------------- RoPE


def llama31_reference(freq: float, s: RopeScaling) -> float:
    """The published Llama 3.1 rule, one frequency at a time."""
    low_freq_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_freq_wavelen = s.original_max_seq_len / s.high_freq_factor
    wavelen = 2 * math.pi / freq
    if wavelen < high_freq_wavelen:
        return freq
    if wavelen > low_freq_wavelen:
        return freq / s.factor
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    return (1 - smooth) * freq / s.factor + smooth * freq


@pytest.mark.parametrize("flavor", ["1B", "8B"])
def test_rope_scaling_matches_llama31_formula(flavor: str) -> None:
    args = LLAMA3_FLAVORS[flavor]
    scaling = args.rope_scaling
    base = [1.0 / args.rope_theta ** (i / args.head_dim) for i in range(0, args.head_dim, 2)]
    expected = [llama31_reference(f, scaling) for f in base]
    got = scale_rope_frequencies(torch.tensor(base, dtype=torch.float64), scaling).tolist()
    assert got == pytest.approx(expected, rel=1e-12)
    # All three regimes occur: kept, divided by factor, interpolated.
    kept = sum(g == b for g, b in zip(got, base))
    divided = sum(math.isclose(g, b / scaling.factor, rel_tol=1e-12) for g, b in zip(got, base))
    assert kept > 0 and divided > 0 and kept + divided < len(base)

    # The tables hold cos/sin of position * scaled frequency, also far out.
    cos, sin = rope_tables(args.head_dim, 2**17, args.rope_theta, scaling)
    for pos in (1, 4097, 2**17 - 1):
        for i in (0, len(base) // 2, len(base) - 1):
            assert cos[pos, i].item() == pytest.approx(math.cos(pos * expected[i]), abs=1e-6)
            assert sin[pos, i].item() == pytest.approx(math.sin(pos * expected[i]), abs=1e-6)


def test_rope_without_scaling_is_plain_theta_powers() -> None:
    cos, sin = rope_tables(16, 4, 10000.0, None)
    freqs = [1.0 / 10000.0 ** (i / 16) for i in range(0, 16, 2)]
    expected = torch.tensor([[math.cos(3 * f) for f in freqs]])
    torch.testing.assert_close(cos[3:4], expected.float())


def test_rope_preserves_norm_and_depends_only_on_relative_position() -> None:
    hd = 16
    cos, sin = rope_tables(hd, 32, 10000.0, None)
    q = torch.randn(1, 1, 1, hd).expand(1, 32, 1, hd)
    k = torch.randn(1, 1, 1, hd).expand(1, 32, 1, hd)
    rq, rk = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    dot = lambda m, n: (rq[0, m, 0] * rk[0, n, 0]).sum().item()  # noqa: E731
    assert dot(5, 2) == pytest.approx(dot(20, 17), abs=1e-4)
    assert dot(5, 2) != pytest.approx(dot(5, 3), abs=1e-4)


# --------------------------------------------------------------------------- init


def test_init_weights_after_to_empty_is_finite_and_deterministic() -> None:
    a = materialise(TINY, seed=123)
    b = materialise(TINY, seed=123)
    c = materialise(TINY, seed=124)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    for name, tensor in sa.items():
        assert torch.isfinite(tensor).all(), name
        assert torch.equal(tensor, sb[name]), name
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sc["layers.0.attention.wq.weight"])

    # Buffers are recomputed, not left as to_empty() garbage.
    cos, sin = rope_tables(TINY.head_dim, TINY.max_seq_len, TINY.rope_theta, TINY.rope_scaling)
    assert torch.equal(a.rope_cos, cos) and torch.equal(a.rope_sin, sin)
    assert torch.equal(a.norm.weight, torch.ones(TINY.dim))
    assert torch.equal(a.layers["1"].ffn_norm.weight, torch.ones(TINY.dim))

    # Hidden projections: std 0.02; residual outputs: scaled down by depth; both truncated.
    wq = a.layers["0"].attention.wq.weight
    w2 = a.layers["1"].feed_forward.w2.weight
    out_std = 0.02 / math.sqrt(2 * TINY.n_layers)
    assert wq.std().item() == pytest.approx(0.02 * 0.986, rel=0.1)  # truncation trims ~1.4%
    assert w2.std().item() == pytest.approx(out_std * 0.986, rel=0.1)
    assert wq.abs().max().item() <= 3 * 0.02 + 1e-7
    # Identical weights and buffers give bit-identical logits.
    tokens = torch.randint(0, TINY.vocab_size, (1, 8))
    torch.testing.assert_close(a(tokens), b(tokens), rtol=0, atol=0)


# --------------------------------------------------------------------------- hygiene and registry


def test_models_package_does_not_import_torch_distributed() -> None:
    offenders = []
    files = sorted(MODELS_DIR.rglob("*.py"))
    assert any(f.name == "model.py" for f in files)
    for path in files:
        if path.name in ("parallelize.py", "tensor_plans.py"):  # a family's parallel plans, not model code
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                bad = any(alias.name.startswith("torch.distributed") for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                bad = module.startswith("torch.distributed") or (
                    module == "torch" and any(alias.name == "distributed" for alias in node.names)
                )
            elif isinstance(node, ast.Attribute):
                bad = node.attr == "distributed" and isinstance(node.value, ast.Name) and node.value.id == "torch"
            else:
                bad = False
            if bad:
                offenders.append(f"{path.relative_to(MODELS_DIR)}:{node.lineno}")
    assert offenders == []


def test_registry_returns_llama3() -> None:
    spec = get_model_spec("llama3")
    assert spec.name == "llama3"
    assert spec.model_cls is Transformer
    assert spec.args_cls is Llama3Args
    assert spec.flavors is LLAMA3_FLAVORS
    args = get_model_args("llama3", "debug")
    assert args == LLAMA3_FLAVORS["debug"]
    args.n_layers = 1  # a copy: editing it must not change the published flavour
    assert LLAMA3_FLAVORS["debug"].n_layers == 6


def test_registry_unknown_name_suggests_close_match() -> None:
    with pytest.raises(ValueError, match=r"model\.name 'lama3'.*choices: deepseek_v3, gpt_oss, llama3.*Did you mean 'llama3'"):
        get_model_spec("lama3")


@pytest.mark.parametrize(("typo", "suggestion"), [("debg", "debug"), ("8b", "8B"), ("70", "70B")])
def test_registry_unknown_flavor_suggests_close_match(typo: str, suggestion: str) -> None:
    with pytest.raises(ValueError, match=rf"model\.flavor '{typo}'.*Did you mean '{suggestion}'") as info:
        get_model_args("llama3", typo)
    assert "405B" in str(info.value)  # lists the choices


def test_invalid_shapes_are_rejected() -> None:
    with pytest.raises(ValueError, match="n_heads"):
        dataclasses.replace(TINY, dim=66)
    with pytest.raises(ValueError, match="n_kv_heads"):
        dataclasses.replace(TINY, n_kv_heads=3)
    with pytest.raises(ValueError, match="low_freq_factor"):
        RopeScaling(low_freq_factor=4.0, high_freq_factor=4.0)


# --------------------------------------------------------------------------- reference parity


def test_logits_match_hugging_face_llama() -> None:
    """Independent implementation check: RoPE (incl. Llama 3.1 scaling), GQA, norms, SwiGLU."""
    transformers = pytest.importorskip("transformers")
    args = Llama3Args(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=512,
        ffn_dim_multiplier=1.3,
        multiple_of=32,
        rope_theta=10000.0,
        # A short original context so positions used below cross every frequency regime.
        rope_scaling=RopeScaling(factor=8.0, original_max_seq_len=32),
        max_seq_len=128,
    )
    torch.manual_seed(0)
    ours = Transformer(args).eval()
    config = transformers.LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    theirs = transformers.LlamaForCausalLM(config).eval()

    def to_half_rotation(w: torch.Tensor, n_heads: int) -> torch.Tensor:
        # Their RoPE rotates (i, i + head_dim/2) pairs, ours adjacent (2i, 2i+1) pairs.
        rows, cols = w.shape
        return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)

    state = {
        "model.embed_tokens.weight": ours.tok_embeddings.weight,
        "model.norm.weight": ours.norm.weight,
        "lm_head.weight": ours.output.weight,
    }
    for i, layer in ours.layers.items():
        p = f"model.layers.{i}."
        state[p + "self_attn.q_proj.weight"] = to_half_rotation(layer.attention.wq.weight, args.n_heads)
        state[p + "self_attn.k_proj.weight"] = to_half_rotation(layer.attention.wk.weight, args.n_kv_heads)
        state[p + "self_attn.v_proj.weight"] = layer.attention.wv.weight
        state[p + "self_attn.o_proj.weight"] = layer.attention.wo.weight
        state[p + "mlp.gate_proj.weight"] = layer.feed_forward.w1.weight
        state[p + "mlp.down_proj.weight"] = layer.feed_forward.w2.weight
        state[p + "mlp.up_proj.weight"] = layer.feed_forward.w3.weight
        state[p + "input_layernorm.weight"] = layer.attention_norm.weight
        state[p + "post_attention_layernorm.weight"] = layer.ffn_norm.weight
    theirs.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=True)

    tokens = torch.randint(0, args.vocab_size, (2, 100))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama3", "qwen3", "deepseek_v3", "gpt_oss", "qwen3_next"])
def test_model_n_layers_overrides_the_depth_of_every_flavour(family: str) -> None:
    """model.n_layers works for every family and flavour, whatever per-block pattern (layer kinds) the flavour holds:
    the model builds with that many blocks, or the one line says which setting needs more (dense-first blocks)."""
    from meshloom.config.errors import ConfigError
    from meshloom.config.schema import ModelConfig
    from meshloom.models.registry import configured_model_args

    spec = get_model_spec(family)
    for flavor in spec.flavors:
        try:
            args = configured_model_args(ModelConfig(name=family, flavor=flavor, n_layers=2))
        except ConfigError as refused:
            assert "set model.n_layers >= " in str(refused), (family, flavor, str(refused))
            continue
        with torch.device("meta"):
            model = spec.model_cls(args)
        assert len(model.layers) == 2, (family, flavor)
