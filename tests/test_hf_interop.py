"""Hugging Face interop: import (from_hf, convert), export (convert back, export), and bad folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_fixtures import LLAMA31_SCALING, llama_config, require_transformers, save_random_llama
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import meshloom
from meshloom.checkpoint import folders
from meshloom.cli.checkpoint_commands import convert_main, export_main
from meshloom.checkpoint.hf import HFFolder
from meshloom.config.loader import ConfigError, load_config
from meshloom.models.llama3 import hf as llama_hf


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize(
    ("tie", "rope_scaling"), [(False, LLAMA31_SCALING), (True, None)], ids=["untied-llama31-rope", "tied-default-rope"]
)
def test_from_hf_logits_match_transformers(tmp_path: Path, tie: bool, rope_scaling: dict | None) -> None:
    theirs = save_random_llama(tmp_path, llama_config(tie=tie, rope_scaling=rope_scaling), seed=1)
    ours = meshloom.from_hf(tmp_path)
    assert ours.args.tie_embeddings is tie
    assert (ours.output.weight is ours.tok_embeddings.weight) is tie
    tokens = torch.randint(0, 512, (2, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = theirs(tokens).logits
        actual = ours(tokens)
    assert (actual - expected).abs().max().item() <= 1e-5


def test_rope_permutation_is_needed_and_exact() -> None:
    w = torch.randn(64, 16)
    halves = llama_hf.interleaved_to_halves(w, n_heads=4)
    assert not torch.equal(halves, w)
    assert torch.equal(llama_hf.halves_to_interleaved(halves, n_heads=4), w)
    # Head 0's first rotated pair is channels (0, 1) for us and (0, head_dim/2 = 8) for HF.
    assert torch.equal(halves[8], w[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_round_trip_hf_meshloom_hf_is_bit_identical(tmp_path: Path, dtype: torch.dtype) -> None:
    source, ckpt, back = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    save_random_llama(source, llama_config(rope_scaling=LLAMA31_SCALING), seed=2, dtype=dtype, max_shard_size="100KB")
    assert (source / "model.safetensors.index.json").is_file()

    assert convert_main([str(source), str(ckpt)]) == 0
    assert folders.read_marker(ckpt)["kind"] == "weights"
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    assert convert_main([str(ckpt), str(back), "--dtype", name, "--max-shard-size", "100KB"]) == 0

    original, returned = hf_tensors(source), hf_tensors(back)
    assert sorted(original) == sorted(returned)
    for key, tensor in original.items():
        assert returned[key].dtype == dtype and torch.equal(returned[key], tensor), key
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)
    with safe_open(back / index["weight_map"]["lm_head.weight"], framework="pt") as f:
        assert f.metadata() == {"format": "pt"}

    config_in, config_out = json.loads((source / "config.json").read_text()), json.loads((back / "config.json").read_text())
    assert llama_hf.args_from_hf_config(config_out) == llama_hf.args_from_hf_config(config_in)
    assert (config_out["bos_token_id"], config_out["eos_token_id"]) == (config_in["bos_token_id"], config_in["eos_token_id"])

    # transformers itself reads the export and computes what meshloom computes.
    reloaded = require_transformers().LlamaForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    tokens = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (reloaded(tokens).logits - meshloom.from_hf(back)(tokens)).abs().max().item()
    assert diff <= 1e-5


def test_export_writes_consolidated_bf16_weights(tmp_path: Path) -> None:
    save_random_llama(tmp_path / "hf", llama_config(tie=True), seed=3)
    assert convert_main([str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors")]) == 0
    exported = load_file(tmp_path / "model.safetensors")
    model = meshloom.from_hf(tmp_path / "hf")
    expected = model.state_dict()
    assert sorted(exported) == sorted(expected)
    for key, tensor in exported.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[key].to(torch.bfloat16)), key
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert json.loads(f.metadata()["model_args"])["tie_embeddings"] is True
    # The file loads straight into a model of that shape.
    fresh = meshloom.from_hf(tmp_path / "hf")
    fresh.load_state_dict({k: v.float() for k, v in exported.items()})


# --------------------------------------------------------------------------- bad input


def _write_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture
def hf_folder(tmp_path: Path) -> Path:
    save_random_llama(tmp_path / "hf", llama_config(), seed=4, max_shard_size="100KB")
    return tmp_path / "hf"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, r"unsupported architecture \['MistralForCausalLM'\]"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
        ({"attention_bias": True}, r"attention_bias=True is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, r"rope_type='yarn' is not supported"),
        ({"head_dim": 16}, r"head_dim=16 x num_attention_heads=8 != hidden_size=64"),
        ({"num_key_value_heads": 3}, r"n_kv_heads \(3\) must be a positive divisor of n_heads \(8\)"),
    ],
)
def test_unsupported_hf_config_is_a_clear_error(hf_folder: Path, changes: dict, message: str) -> None:
    _write_config(hf_folder, **changes)
    with pytest.raises(ValueError, match=message):
        meshloom.from_hf(hf_folder)


def test_missing_shard_file_is_named(hf_folder: Path) -> None:
    shard = sorted(set(json.loads((hf_folder / "model.safetensors.index.json").read_text())["weight_map"].values()))[1]
    (hf_folder / shard).unlink()
    with pytest.raises(ValueError, match=rf"shard file {shard} listed in .* is missing"):
        HFFolder(hf_folder)


def test_missing_or_misshapen_tensor_is_named(hf_folder: Path, tmp_path: Path) -> None:
    _write_config(hf_folder, num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"lacks tensor 'model.layers.2.input_layernorm.weight'"):
        HFFolder(hf_folder).check()
    _write_config(hf_folder, num_hidden_layers=2, intermediate_size=128)
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.gate_proj.weight' .* has shape \[256, 64\], but config.json implies \[128, 64\]"):
        HFFolder(hf_folder).check()


def test_pickled_weights_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(llama_config().to_dict()))
    torch.save({"x": torch.zeros(1)}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"neither model.safetensors nor .*pytorch_model.bin.*never loaded"):
        HFFolder(folder)


def test_initial_load_from_hf_with_another_shape_fails_before_building(hf_folder: Path, tmp_path: Path) -> None:
    config = load_config(
        ["--model.flavor", "debug", "--checkpoint.initial_load_path", str(hf_folder), "--checkpoint.initial_load_format", "hf"]
    )
    with pytest.raises(ConfigError, match=r"does not match model.flavor='debug' .*dim: 64 vs 256"):
        _checkpointer(config, tmp_path / "run")


def test_convert_rejects_unknown_source(tmp_path: Path) -> None:
    assert convert_main([str(tmp_path), str(tmp_path / "out")]) == 2
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
    save_file({"x": torch.zeros(1)}, tmp_path / "model.safetensors")
    assert convert_main([str(tmp_path), str(tmp_path / "out")]) == 2  # no config.json


def test_published_llama_configs_map_onto_our_flavors() -> None:
    """Hugging Face config.json fields of Llama 3.1 8B and 3.2 1B (transformers 4 layout) give our flavours' shapes."""
    from meshloom.models.registry import get_model_args

    rope = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    common = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "max_position_embeddings": 131072, "hidden_act": "silu"}  # fmt: skip
    llama_8b = {**common, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "rope_scaling": {**rope, "factor": 8.0}, "tie_word_embeddings": False}  # fmt: skip
    llama_1b = {**common, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                "num_key_value_heads": 8, "rope_scaling": {**rope, "factor": 32.0}, "tie_word_embeddings": True}  # fmt: skip
    for flavor, config in (("8B", llama_8b), ("1B", llama_1b)):
        assert llama_hf.shape_differences(get_model_args("llama3", flavor), llama_hf.args_from_hf_config(config)) == []
    # Any intermediate size is representable, below or above 8/3 of the width.
    for width, intermediate in ((64, 96), (64, 1000), (4096, 11008)):
        args = llama_hf.args_from_hf_config({**llama_8b, "hidden_size": width, "num_attention_heads": 8,
                                            "num_key_value_heads": 8, "intermediate_size": intermediate})  # fmt: skip
        assert args.ffn_hidden_dim == intermediate


def _checkpointer(config, run_dir):
    """A checkpointer as the trainer builds it: from the run plan of this launch's world size."""
    from meshloom.checkpoint.dcp import Checkpointer
    from meshloom.parallel.distributed import world_size_from_env
    from meshloom.planning.run_plan import RunPlan

    return Checkpointer(RunPlan.build(config, world_size_from_env()), run_dir)
