"""Kimi K2 on the DeepSeek-V3 family: the `kimi_k2` flavour's shape, the MuonClip recipe's dry run at the report's
layout (PP 16 with virtual stages x EP 16, 1,024 ranks, in one process) and logits against transformers'
DeepseekV3ForCausalLM on a tiny Kimi-shaped config (one dense block then MoE blocks, many experts, no group limit,
Kimi's YaRN with beta_fast = beta_slow, routed scale 2.827)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import meshloom
from meshloom.config.loader import load_config
from meshloom.models.registry import get_model_args, get_model_spec
from meshloom.planning.dry_run import dry_run
from meshloom.planning.run_plan import RunPlan
from tests.test_deepseek_v3_hf import HF_TOKENS, random_hf_folder

SPEC = get_model_spec("deepseek_v3")


def test_kimi_k2_flavour_has_the_released_shape():
    args = get_model_args("deepseek_v3", "kimi_k2")
    assert (args.n_layers, args.n_dense_layers, args.n_heads, args.dim) == (61, 1, 64, 7168)
    assert (args.n_routed_experts, args.n_activated_experts, args.n_shared_experts) == (384, 8, 1)
    assert (args.n_expert_groups, args.n_limited_groups, args.route_scale) == (1, 1, 2.827)
    assert (args.q_lora_rank, args.kv_lora_rank, args.vocab_size, args.mtp_depth) == (1536, 512, 163840, 0)
    shape = SPEC.shape_model(args)
    # Moonshot: "1 trillion total parameters", "32 billion activated".
    assert 1.02e12 < shape.num_params() < 1.03e12 and 32.5e9 < shape.active_params() < 33e9


def test_kimi_k2_recipe_dry_run_at_the_reports_scale():
    """configs/kimi_k2.toml on 1,024 ranks: PP 16 (2 virtual stages each) x FSDP 64 with EP 16, Muon and QK-clip on;
    rank 0's built shards equal the estimator's, Muon's state (one buffer) counted."""
    config = load_config(["--config", "configs/kimi_k2.toml"])
    assert config.optimizer.name == "Muon" and config.optimizer.qk_clip_threshold == 100.0
    plan = RunPlan.build(config, 1024)
    assert (plan.dims.pp, plan.dims.ep, plan.dims.dp_shard) == (16, 16, 64)
    assert plan.pipeline.num_stages == 32
    report = dry_run(config, 1024)
    print(report.format())
    assert "pp=16" in report.layout and "ep=16" in report.layout
    assert report.built_param_bytes == report.rank_params
    assert report.memory.optimizer < 2 * report.memory.params  # Muon: one buffer per expert/hidden matrix


def test_kimi_k2_dry_run_command_is_one_process():
    proc = subprocess.run([sys.executable, "-m", "meshloom.train", "--config", "configs/kimi_k2.toml", "--dry-run",
                           "--world-size", "1024"], capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dry run: rank 0 of 1024" in proc.stdout and "Traceback" not in proc.stderr


def test_tiny_kimi_shaped_model_matches_transformers(tmp_path):
    """One dense block then two MoE blocks of 48 experts, 8 per token, one group (no limit), one shared expert, routed
    scale 2.827, RoPE theta 50,000 with Kimi's YaRN (beta_fast = beta_slow = 1), rms_norm_eps 1e-6."""
    pytest.importorskip("transformers")
    kimi = {"n_routed_experts": 48, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
            "rms_norm_eps": 1e-6,
            "rope_scaling": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "beta_fast": 1.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 16}}  # fmt: skip
    reference = random_hf_folder(tmp_path / "hf", 16, True, True, n_shared_experts=1, **kimi)
    ours = meshloom.from_hf(tmp_path / "hf")
    a = ours.args
    assert (a.n_dense_layers, a.n_routed_experts, a.n_activated_experts, a.n_expert_groups) == (1, 48, 8, 1)
    assert a.rope_scaling.beta_fast == a.rope_scaling.beta_slow == 1.0 and a.route_scale == 2.827
    with torch.no_grad():
        expected = reference(HF_TOKENS).logits
        assert expected.std() > 0.5
        diff = (ours(HF_TOKENS) - expected).abs().max().item()
    print(f"kimi-shaped hf logits: max |diff| {diff:.2e}")
    assert diff <= 1e-5
