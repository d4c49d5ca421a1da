"""The Qwen3 family, dense and MoE: published sizes, Hugging Face interop, layout checks, training, exact resume,
the dry run of 235B-A22B, and multi-rank parity (one launch for every layout)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import meshloom
from meshloom.checkpoint import folders
from meshloom.checkpoint.hf import HFFolder, write_hf_folder
from meshloom.checkpoint.offline import read_model_weights
from meshloom.config.errors import ConfigError
from meshloom.config.loader import load_config
from meshloom.inference.generate import generate
from meshloom.models.registry import get_model_args, get_model_spec
from meshloom.parallel.apply import parallelize
from meshloom.planning.dry_run import dry_run
from meshloom.planning.run_plan import RunPlan
from meshloom.cli.checkpoint_commands import convert_main
from meshloom.testing.layout_parity import (
    FP32_TOLERANCE,
    ParityCase,
    base_overrides,
    launch,
    run_steps,
)
from meshloom.testing.resume_parity import Case, run_case
from meshloom.train.trainer import Trainer

transformers = pytest.importorskip("transformers")
SPEC = get_model_spec("qwen3")


# --------------------------------------------------------------------------- sizes


def test_every_flavour_builds_and_its_shape_model_counts_the_same_parameters():
    for flavor, args in SPEC.flavors.items():
        with torch.device("meta"):
            model = SPEC.model_cls(args)
        assert SPEC.shape_model(args).num_params() == model.num_params(), flavor


@pytest.mark.parametrize(
    ("flavor", "total", "active"),
    [("0.6B", 0.596e9, 0.596e9), ("1.7B", 1.72e9, 1.72e9), ("8B", 8.19e9, 8.19e9), ("30B-A3B", 30.53e9, 3.35e9), ("235B-A22B", 235.09e9, 22.19e9)],
)
def test_published_sizes(flavor, total, active):
    shape = SPEC.shape_model(get_model_args("qwen3", flavor))
    assert shape.num_params() == pytest.approx(total, rel=2e-3)
    assert shape.active_params() == pytest.approx(active, rel=2e-3)
    assert get_model_args("qwen3", "0.6B").tie_embeddings and SPEC.shape_model(get_model_args("qwen3", "0.6B")).num_params() == 596_049_920


def test_mfu_counts_active_parameters():
    moe = SPEC.shape_model(get_model_args("qwen3", "30B-A3B"))
    dense_equivalent = 6 * (moe.num_params() - moe.vocab_size * moe.dim)
    assert moe.flops_per_token(4096) < dense_equivalent / 5
    assert moe.flops_per_token(4096) == pytest.approx(6 * (moe.active_params() - moe.vocab_size * moe.dim) + moe.attention_flops_per_token(4096))


# --------------------------------------------------------------------------- Hugging Face


def hf_qwen3(tmp: Path, moe: bool, tie: bool, norm_topk_prob: bool = True, seed: int = 0, dtype=torch.float32):
    """A random Qwen3 / Qwen3-MoE saved with save_pretrained; the MoE one has a dense block (mlp_only_layers)."""
    common = dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4,
        head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=tie, attn_implementation="eager",
    )  # fmt: skip
    if moe:
        config = transformers.Qwen3MoeConfig(
            **common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=norm_topk_prob, mlp_only_layers=[1]
        )
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config, cls = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # random norm scales and a decisive router, so a swapped tensor would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    model = model.to(dtype)
    model.save_pretrained(tmp)
    return model


TOKENS = torch.randint(0, 512, (2, 50), generator=torch.Generator().manual_seed(0))
CASES = [(False, True, True), (False, False, True), (True, False, True), (True, False, False), (True, True, False)]
IDS = ["dense-tied", "dense-untied", "moe-renorm", "moe-no-renorm", "moe-tied-no-renorm"]


@pytest.mark.parametrize(("moe", "tie", "norm_topk_prob"), CASES, ids=IDS)
def test_hf_logits_export_and_round_trip(tmp_path: Path, moe: bool, tie: bool, norm_topk_prob: bool):
    theirs = hf_qwen3(tmp_path / "hf", moe, tie, norm_topk_prob)
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    if moe:  # transformers fuses experts in memory but saves one 2-D tensor per expert, as the released checkpoints
        assert "model.layers.0.mlp.experts.7.gate_proj.weight" in saved and "model.layers.0.mlp.experts.gate_up_proj" not in saved
    ours = meshloom.from_hf(tmp_path / "hf")
    assert ours.args.tie_embeddings is tie and (ours.args.moe is not None) is moe
    with torch.no_grad():
        diff = (ours(TOKENS) - theirs(TOKENS).logits).abs().max().item()
    print(f"hf logits {IDS[CASES.index((moe, tie, norm_topk_prob))]}: max |diff| {diff:.2e}")
    assert diff <= 1e-5

    # meshloom -> HF (from our own weights), read back by transformers.
    write_hf_folder(ours.state_dict(), SPEC, ours.args, tmp_path / "exported", torch.float32)
    cls = transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM
    reloaded = cls.from_pretrained(tmp_path / "exported", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (reloaded(TOKENS).logits - ours(TOKENS)).abs().max().item() <= 1e-5

    # HF -> meshloom checkpoint -> HF: the same tensors, bit for bit.
    assert convert_main([str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    assert convert_main([str(tmp_path / "ckpt"), str(tmp_path / "back"), "--dtype", "float32"]) == 0
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(saved)
    assert all(torch.equal(back[k], v) for k, v in saved.items())
    config_out = json.loads((tmp_path / "back" / "config.json").read_text())
    assert HFFolder(tmp_path / "back").args == HFFolder(tmp_path / "hf").args
    assert config_out["model_type"] == ("qwen3_moe" if moe else "qwen3")


def test_greedy_generation_with_the_kv_cache_matches_transformers(tmp_path: Path):
    theirs = hf_qwen3(tmp_path, moe=True, tie=False)
    ours = meshloom.from_hf(tmp_path)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (7, 2, 11)]
    batched = generate(ours, prompts, 12)  # left-padded batch, per-sequence RoPE positions
    for prompt, tokens in zip(prompts, batched.tokens, strict=True):
        expected = theirs.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=12,
            do_sample=False, pad_token_id=0,
        )[0, len(prompt):].tolist()  # fmt: skip
        assert tokens == expected


def test_export_with_a_balancing_bias_is_refused(tmp_path: Path):
    hf_qwen3(tmp_path / "hf", moe=True, tie=False)
    model = meshloom.from_hf(tmp_path / "hf")
    state = model.state_dict()
    assert torch.equal(state["layers.0.moe.expert_bias"], torch.zeros(8))  # an import starts unbiased
    state["layers.2.moe.expert_bias"][3] = 0.01
    with pytest.raises(ValueError, match=r"1 MoE layers \(first layers.2.moe.expert_bias\) route with a non-zero load-balancing bias"):
        write_hf_folder(state, SPEC, model.args, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_hf_settings_are_named(tmp_path: Path):
    hf_qwen3(tmp_path / "hf", moe=True, tie=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for change, message in [({"use_sliding_window": True}, "use_sliding_window=True is not supported"),
                            ({"num_experts_per_tok": 9}, r"top_k=9 exceeds n_experts=8")]:  # fmt: skip
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            HFFolder(tmp_path / "hf")


# --------------------------------------------------------------------------- layouts


@pytest.mark.parametrize(
    ("flavor", "world", "settings", "message"),
    [
        ("debug", 2, ["--parallelism.pp", "2"], "ties its output projection to the embedding"),
        ("tiny", 2, ["--parallelism.ep", "2"], r"with parallelism.ep > 1 \(EP\): expert parallel splits the routed experts"),
        ("tiny_moe", 8, ["--parallelism.tp", "8"], r"tp=8 does not divide the model's n_kv_heads=4"),
    ],
)
def test_layouts_the_shapes_forbid_are_config_errors(tmp_path, flavor, world, settings, message):
    config = load_config(["--model.name", "qwen3", "--model.flavor", flavor, "--job.dump_folder", str(tmp_path), *settings])
    with pytest.raises(ConfigError, match=message):
        RunPlan.build(config, world)


@pytest.mark.parametrize(
    ("world", "settings", "message"),
    [
        (2, ["--parallelism.cp", "2", "--moe.aux_loss_coef", "1e-3"], "the sequence-wise balance loss needs whole sequences"),
        (1, ["--compile.enable", "true", "--moe.grouped_mm", "off"], "fullgraph blocks cannot trace"),
        (1, ["--checkpoint.hf_export_interval", "10"], "Hugging Face format has no place for the balancing bias"),
    ],
)
def test_moe_settings_the_layout_cannot_honour_are_config_errors(tmp_path, world, settings, message):
    config = load_config(["--model.name", "qwen3", "--model.flavor", "tiny_moe", "--job.dump_folder", str(tmp_path), *settings])
    with pytest.raises(ConfigError, match=message):
        RunPlan.build(config, world)  # before any process group or model exists


def test_dry_run_235b_a22b_on_256_ranks():
    config = load_config([
        "--model.name", "qwen3", "--model.flavor", "235B-A22B", "--training.seq_len", "4096", "--training.local_batch_size", "8",
        "--parallelism.tp", "4", "--parallelism.pp", "8", "--pipeline.microbatches", "8",
    ])  # fmt: skip
    report = dry_run(config, 256)
    print(report.format())
    assert report.seconds < 60
    assert report.built_param_bytes == report.rank_params
    # Rank 0: its 12 of 94 blocks and the embedding, experts FSDP-sharded over 8 and replicated over tp.
    assert 0.8 < report.built_param_bytes / (4 * 235.09e9 / 8 / 8) < 1.3


# --------------------------------------------------------------------------- training


def _qwen3(flavor: str) -> list[str]:
    return ["--model.name", "qwen3", "--model.flavor", flavor]


@pytest.mark.parametrize("flavor", ["tiny", "tiny_moe"])
def test_training_reduces_the_loss(tiny_args, flavor):
    trainer = Trainer(load_config(tiny_args + _qwen3(flavor) + ["--training.steps", "8", "--optimizer.lr", "1e-2"]))
    losses = trainer.train()
    assert losses[-1] < losses[0] - 0.5, losses
    if flavor == "tiny_moe":
        records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
        last = records[-1]
        assert 1.0 <= last["moe_load_max"] <= 8.0 and 0 < last["moe_entropy"] <= 2.08  # ln 8
        assert last["moe/layers.1/bias_spread"] > 0 and "moe_aux_loss" not in last


def test_checkpoint_resume_of_an_moe_run_is_exact(tmp_path, data_cache):
    (tmp_path / "cache").symlink_to(data_cache)
    settings = _qwen3("tiny_moe") + ["--moe.bias_update_rate", "0.01", "--moe.aux_loss_coef", "1e-2", "--moe.z_loss_coef", "1e-3"]
    save = ["--checkpoint.enable", "true", "--checkpoint.interval", "3"]
    ref = run_case(Case("ref", str(tmp_path / "ref"), steps=5, overrides=settings), tmp_path)
    run_case(Case("stop", str(tmp_path / "run"), steps=5, stop_after=3, overrides=settings + save), tmp_path)
    saved = read_model_weights(folders.open_checkpoint(tmp_path / "run" / "checkpoint" / "step-3"))
    # After three updates of +-0.01 (an odd number) no entry can be back at zero: the trained bias was saved.
    assert all(saved[f"layers.{i}.moe.expert_bias"].abs().min() >= 0.01 - 1e-6 for i in (0, 1))
    resume = save + ["--checkpoint.resume", "true"]
    resumed = run_case(Case("resume", str(tmp_path / "run"), steps=5, overrides=settings + resume), tmp_path)
    assert resumed.losses == ref.losses[3:]


# --------------------------------------------------------------------------- parity

PARITY_LAYOUTS = ["dp_shard=2", "tp=2", "pp=2", "cp=2"]
QWEN3 = "model.name=qwen3,model.flavor="
# Bias balancing is on (the default rate) in every MoE case; the balance losses too, except under context parallel,
# which refuses the sequence-wise loss (it needs whole sequences).
REFERENCES = {
    "tiny": QWEN3 + "tiny",
    "tiny_moe": QWEN3 + "tiny_moe,moe.aux_loss_coef=1e-2,moe.z_loss_coef=1e-3",
    "tiny_moe_cp": QWEN3 + "tiny_moe,moe.z_loss_coef=1e-3",
}
CASES_BY_REFERENCE = {"tiny": PARITY_LAYOUTS, "tiny_moe": PARITY_LAYOUTS[:3], "tiny_moe_cp": ["cp=2"]}


def test_multi_rank_parity_dense_and_moe(tmp_path, data_cache):
    """Every layout in one launch of 2 ranks; each compared with its 1-process reference."""
    os.environ.pop("WORLD_SIZE", None)
    (tmp_path / "cache").symlink_to(data_cache)
    references = {
        name: run_steps(base_overrides(10, tmp_path) + ParityCase.parse(settings).setting_args() + ["--job.dump_folder", str(tmp_path / name)])
        for name, settings in REFERENCES.items()
    }
    specs = {f"{layout},{REFERENCES[name]}": name for name, layouts in CASES_BY_REFERENCE.items() for layout in layouts}
    curves = launch([ParityCase.parse(spec) for spec in specs], 10, tmp_path)
    for spec, name in specs.items():
        reference = references[name]
        loss_diff = max(abs(a - b) for a, b in zip(reference.losses, curves[spec].losses, strict=True))
        norm_diff = abs(reference.grad_norms[-1] - curves[spec].grad_norms[-1])
        print(f"parity {spec}: max |dloss| {loss_diff:.2e}, |dgrad_norm| {norm_diff:.2e}")
        assert loss_diff <= FP32_TOLERANCE and norm_diff <= FP32_TOLERANCE, (spec, reference.losses, curves[spec].losses)
    assert references["tiny_moe"].losses[-1] < references["tiny_moe"].losses[0] - 0.3


def test_tensor_parallel_keeps_a_tied_output_tied():
    """Each TP style replaces its own weight; parallelize ties the output to the sharded embedding again (meta
    model, one rank of two in torch's fake process group)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    plan = RunPlan.build(load_config(["--model.name", "qwen3", "--model.flavor", "debug", "--parallelism.tp", "2"]), 2)
    dist.init_process_group(backend="fake", store=FakeStore(), rank=0, world_size=2)
    try:
        plan.dims.build_mesh("cpu")
        with torch.device("meta"):
            model = parallelize(SPEC.model_cls(plan.model_args), plan)
    finally:
        dist.destroy_process_group()
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.to_local().shape == (1024, 256)
