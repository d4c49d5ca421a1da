"""DeepSeek-V3 and Hugging Face: logits against transformers' DeepseekV3ForCausalLM on random MoE configs (q low-rank
projection or not, YaRN, group-limited routing with a balancing bias), export read back by transformers, bit-exact
HF -> meshloom -> HF round trips, and the settings the format cannot hold."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import meshloom
from meshloom.checkpoint.hf import HFFolder, write_hf_folder
from meshloom.models.deepseek_v3 import hf as deepseek_hf
from meshloom.models.deepseek_v3.model import DeepSeekV3
from meshloom.models.registry import get_model_args, get_model_spec
from meshloom.cli.checkpoint_commands import convert_main

SPEC = get_model_spec("deepseek_v3")


def tiny(**changes) -> object:
    return dataclasses.replace(get_model_args("deepseek_v3", "tiny"), **changes)


# --------------------------------------------------------------------------- Hugging Face

HF_TOKENS = torch.randint(0, 128, (2, 100), generator=torch.Generator().manual_seed(1))


def random_hf_folder(path: Path, q_lora_rank: int | None, rope_interleave: bool, yarn: bool, norm_topk_prob: bool = True,
                     n_shared_experts: int = 2, **overrides: object) -> object:  # fmt: skip
    """A random DeepseekV3ForCausalLM (1 dense block, 2 MoE blocks of 8 experts in 4 groups, 3 per token from the best
    2 groups; `overrides` replace config values) saved with save_pretrained; random norm scales and balancing bias, so
    a swapped tensor would show."""
    transformers = pytest.importorskip("transformers")
    values = {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 4, "first_k_dense_replace": 1, "kv_lora_rank": 24, "q_lora_rank": q_lora_rank, "qk_rope_head_dim": 8,
        "v_head_dim": 12, "qk_nope_head_dim": 16, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "initializer_range": 0.1,
        "rope_interleave": rope_interleave, "attn_implementation": "eager", "moe_intermediate_size": 16, "n_routed_experts": 8,
        "n_shared_experts": n_shared_experts, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
        "norm_topk_prob": norm_topk_prob,
    }  # fmt: skip
    if yarn:  # mscale != mscale_all_dim, so both YaRN temperatures act
        values["rope_scaling"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "mscale": 0.8,
                                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 16}  # fmt: skip
    values.update(overrides)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**values)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize(
    "q_lora_rank, rope_interleave, yarn, norm_topk_prob",
    [(16, True, True, True), (None, True, True, False), (16, False, True, True), (16, True, False, True)],
)
def test_hf_logits_export_and_round_trip(tmp_path, q_lora_rank, rope_interleave, yarn, norm_topk_prob):
    import transformers

    reference = random_hf_folder(tmp_path / "hf", q_lora_rank, rope_interleave, yarn, norm_topk_prob)
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    # transformers fuses the experts in memory but saves one 2-D tensor per expert, as the released checkpoints.
    assert "model.layers.2.mlp.experts.7.gate_proj.weight" in saved and "model.layers.1.mlp.gate.e_score_correction_bias" in saved
    ours = meshloom.from_hf(tmp_path / "hf")
    assert ours.args.mtp_depth == 0 and ours.args.q_lora_rank == (q_lora_rank or 0) and ours.args.n_dense_layers == 1
    assert torch.equal(ours.layers["2"].moe.expert_bias, saved["model.layers.2.mlp.gate.e_score_correction_bias"])
    with torch.no_grad():
        expected = reference(HF_TOKENS).logits
        assert expected.std() > 0.5  # large enough logits for the comparison to mean something
        diff = (ours(HF_TOKENS) - expected).abs().max().item()
    print(f"hf logits q_lora={q_lora_rank} interleave={rope_interleave} yarn={yarn} norm={norm_topk_prob}: {diff:.2e}")
    assert diff <= 1e-5

    # meshloom -> HF from our own weights, read back by transformers.
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    write_hf_folder(ours.state_dict(), SPEC, ours.args, tmp_path / "exported", dtype=torch.float32, base_config=config)
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (back(HF_TOKENS).logits - expected).abs().max() <= 1e-5
    assert deepseek_hf.args_from_hf_config(json.loads((tmp_path / "exported" / "config.json").read_text())) == ours.args

    # HF -> meshloom checkpoint -> HF: the same tensors, bit for bit.
    assert convert_main([str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    assert convert_main([str(tmp_path / "ckpt"), str(tmp_path / "back"), "--dtype", "float32"]) == 0
    again = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(again) == sorted(saved) and all(torch.equal(again[k], v) for k, v in saved.items())
    assert HFFolder(tmp_path / "back").args == HFFolder(tmp_path / "hf").args


def test_hf_without_shared_experts_and_the_trained_bias_export(tmp_path):
    """transformers saves an empty shared MLP when n_shared_experts = 0; the import ignores it. A bias trained here
    is exported as e_score_correction_bias and routes the same there."""
    import transformers

    reference = random_hf_folder(tmp_path / "hf", 16, True, True, n_shared_experts=0)
    ours = meshloom.from_hf(tmp_path / "hf")
    assert ours.layers["1"].moe.shared_experts is None
    with torch.no_grad():
        assert (ours(HF_TOKENS) - reference(HF_TOKENS).logits).abs().max() <= 1e-5
        ours.layers["1"].moe.expert_bias.copy_(torch.linspace(-0.3, 0.3, 8))
        trained = ours(HF_TOKENS)
    write_hf_folder(ours.state_dict(), SPEC, ours.args, tmp_path / "out", dtype=torch.float32)
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (back(HF_TOKENS).logits - trained).abs().max() <= 1e-5


def test_hf_export_leaves_out_prediction_modules_and_import_keeps_them_initialised(tmp_path):
    from meshloom.checkpoint.hf import load_into_model_parts

    model = DeepSeekV3(tiny())
    names = list(model.state_dict())
    exported = SPEC.hf.exported_names(names, model.args)
    assert any(n.startswith("mtp.") for n in names) and not any(n.startswith("mtp.") for n in exported)
    write_hf_folder(model.state_dict(), SPEC, model.args, tmp_path / "hf", dtype=torch.float32)
    fresh = DeepSeekV3(tiny())
    before = fresh.mtp["0"].proj.weight.clone()
    load_into_model_parts([fresh], HFFolder(tmp_path / "hf"))
    assert torch.equal(fresh.layers["1"].moe.experts.w2, model.layers["1"].moe.experts.w2)
    assert torch.equal(fresh.mtp["0"].proj.weight, before)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_key_value_heads": 2}, "num_key_value_heads=2 is not supported"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type='llama3' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
        ({"n_group": 3}, "n_expert_groups=3 must divide n_routed_experts=8"),
    ],
)
def test_unsupported_hf_configs_are_named(changes, message):
    base = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128,
            "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "first_k_dense_replace": 1,
            "moe_intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2}  # fmt: skip
    deepseek_hf.args_from_hf_config(base)
    with pytest.raises(ValueError, match=message):
        deepseek_hf.args_from_hf_config({**base, **changes})


def test_softmax_routed_models_are_not_exported(tmp_path):
    args = get_model_args("deepseek_v3", "tiny")
    model = DeepSeekV3(dataclasses.replace(args, score_func="softmax"))
    with pytest.raises(ValueError, match="transformers always routes DeepSeek-V3 by sigmoid scores"):
        write_hf_folder(model.state_dict(), SPEC, model.args, tmp_path / "out")
    assert not (tmp_path / "out").exists()
