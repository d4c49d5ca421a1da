"""Muon + AdamW (meshloom/train/muon.py): torch parity in one process, then the same parameters under FSDP, TP,
FSDP x TP, HSDP and expert sharding on gloo, the Newton-Schulz work split, and a DCP round trip with resharding.

Gradients are synthetic and elementwise (a seeded random tensor plus half the parameter), so every layout sees exactly
the single-process gradients and any difference comes from the optimizer alone.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from meshloom.config import ConfigError, OptimizerConfig, load_config
from meshloom.config.errors import UserError
from meshloom.config.schema import LRSchedulerConfig
from meshloom.testing.ranks import run_ranks
from meshloom.train.lr import build_lr_scheduler, lr_factor
from meshloom.train.muon import MuonAdamW, muon_param_groups, optimizer_state_elements, parameter_kinds
from meshloom.train.optim import build_optimizer
from meshloom.train.orthogonalize import assign_owners

STEPS = 10
LR, WEIGHT_DECAY, BETAS = 0.01, 0.1, (0.9, 0.95)
N_EXPERTS = 5  # uneven over 2 and 4 ranks on purpose
MATRICES = 2 * 3 + N_EXPERTS  # Muon matrices per step: three per block, one per expert
TOLERANCE = 1e-5
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Odd sizes so that FSDP and TP shards are uneven.
        self.attn = nn.Linear(16, 18, bias=False)
        self.up = nn.Linear(16, 22)
        self.down = nn.Linear(22, 16, bias=False)


class Toy(nn.Module):
    """Embedding, output head, norm, biases (AdamW); block matrices and a 3-D expert stack (Muon)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(16)
        self.experts = nn.Parameter(torch.randn(N_EXPERTS, 12, 16) * 0.1)
        self.out = nn.Linear(16, 32, bias=False)


def adamw_only(name: str) -> bool:
    return name.startswith(("embed", "out"))


def toy() -> Toy:
    torch.manual_seed(0)
    return Toy()


def make_optimizer(model: nn.Module, adjust: str = "match_rms_adamw") -> torch.optim.Optimizer:
    # torch.optim.Muon runs Newton-Schulz in bf16; the bitwise comparisons need the same.
    config = OptimizerConfig(name="Muon", lr=LR, weight_decay=WEIGHT_DECAY, beta1=BETAS[0], beta2=BETAS[1],
                             muon_ns_dtype="bfloat16")
    config.muon_adjust_lr = adjust
    return build_optimizer(model, config, torch.device("cpu"), adamw_only=adamw_only)


@torch.no_grad()
def set_grads(model: nn.Module, step: int) -> None:
    for i, (_, p) in enumerate(model.named_parameters()):
        full = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * step + i))
        if isinstance(p, DTensor):
            (chunk,) = p.__create_chunk_list__()
            local = full[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] + 0.5 * p.to_local()
            p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        else:
            p.grad = full + 0.5 * p


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        set_grads(model, step)
        optimizer.step()
        optimizer.zero_grad()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def reference_params(steps: int = STEPS) -> dict[str, torch.Tensor]:
    model = toy()
    train(model, make_optimizer(model), steps)
    return full_params(model)


# ---------------------------------------------------------------------------
# One process
# ---------------------------------------------------------------------------


def _torch_reference(model: Toy, adjust: str, nesterov: bool, lr: float):
    """torch.optim.Muon on the block matrices and on per-expert copies of the 3-D weight, torch.optim.AdamW on the
    rest; returns (optimizers, expert copies)."""
    muon_args = {"lr": lr, "weight_decay": WEIGHT_DECAY, "nesterov": nesterov, "adjust_lr_fn": adjust}
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and not adamw_only(n)]
    experts = [nn.Parameter(model.experts.detach()[e].clone()) for e in range(N_EXPERTS)]
    decay = [model.embed.weight, model.out.weight]
    no_decay = [p for p in model.parameters() if p.ndim == 1]
    return [
        torch.optim.Muon(matrices, **muon_args),
        torch.optim.Muon(experts, **muon_args),
        torch.optim.AdamW(decay, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY, foreach=True),
        torch.optim.AdamW(no_decay, lr=lr, betas=BETAS, weight_decay=0.0, foreach=True),
    ], experts


@pytest.mark.parametrize("adjust, nesterov", [("match_rms_adamw", True), ("original", True), ("original", False)])
def test_one_process_equals_torch_muon_and_adamw_bit_for_bit(adjust, nesterov):
    model, reference = toy(), toy()
    optimizer = make_optimizer(model, adjust)
    for group in optimizer.param_groups:
        group["nesterov"] = nesterov
    torch_optimizers, experts = _torch_reference(reference, adjust, nesterov, LR)
    for step in range(STEPS):
        set_grads(model, step)
        set_grads(reference, step)
        for e, expert in enumerate(experts):
            expert.grad = reference.experts.grad[e].clone()
        optimizer.step()
        for torch_optimizer in torch_optimizers:
            torch_optimizer.step()
        with torch.no_grad():
            reference.experts.copy_(torch.stack(experts))
    assert optimizer.newton_schulz_calls == STEPS * MATRICES
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), (name, float((p - q).abs().max()))
    # the state has torch's names: a momentum buffer per Muon parameter, AdamW's moments and step for the rest
    state = optimizer.state_dict()["state"]
    kinds = [g["kind"] for g in optimizer.param_groups for _ in g["params"]]
    assert [sorted(state[i]) for i in range(len(kinds))] == [
        ["momentum_buffer"] if kind == "muon" else ["exp_avg", "exp_avg_sq", "step"] for kind in kinds
    ]


def test_newton_schulz_in_any_dtype_repeats_torchs_operations():
    from torch.optim._muon import _zeropower_via_newtonschulz

    from meshloom.train.muon import NS_COEFFICIENTS, newton_schulz_in

    torch.manual_seed(0)
    for shape in [(12, 16), (22, 16)]:  # wide and tall (transposed inside)
        g = torch.randn(shape)
        torch_bf16 = _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, 1e-7)
        assert torch.equal(newton_schulz_in(g, NS_COEFFICIENTS, 5, 1e-7, torch.bfloat16), torch_bf16)
        exact = newton_schulz_in(g.double(), NS_COEFFICIENTS, 5, 1e-7, torch.float64)
        fp32 = newton_schulz_in(g, NS_COEFFICIENTS, 5, 1e-7, torch.float32)
        assert fp32.dtype == torch.float32
        assert (fp32 - exact).abs().max() < 1e-5 < (torch_bf16.double() - exact).abs().max()


def test_auto_newton_schulz_runs_in_float32_on_cpu():
    from meshloom.train.muon import NS_COEFFICIENTS, adjusted_lr, newton_schulz_in

    model, reference = toy(), toy()
    config = OptimizerConfig(name="Muon", lr=LR, weight_decay=WEIGHT_DECAY)
    assert config.muon_ns_dtype == "auto"
    optimizer = build_optimizer(model, config, torch.device("cpu"), adamw_only=adamw_only)
    assert optimizer.ns_dtype == torch.float32
    set_grads(model, 0)
    set_grads(reference, 0)
    optimizer.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if name not in ("blocks.0.attn.weight", "experts"):
            continue
        # Step 1 of Nesterov momentum: the update is g.lerp(B, mu) with B = (1 - mu) g.
        update = q.grad.lerp(q.grad * (1 - 0.95), 0.95)
        matrices = update if q.ndim == 3 else update[None]
        orthogonal = torch.stack([newton_schulz_in(m, NS_COEFFICIENTS, 5, 1e-7, torch.float32) for m in matrices])
        step = adjusted_lr(LR, "match_rms_adamw", q.shape) * orthogonal.view(q.shape)
        expected = q.detach() * (1 - LR * WEIGHT_DECAY) - step
        assert torch.allclose(p, expected, rtol=0, atol=1e-7), name
    with pytest.raises(UserError, match="Newton-Schulz dtype must be one of"):
        MuonAdamW([{"kind": "muon", "params": [nn.Parameter(torch.ones(2, 2))]}], ns_dtype="float16")


def test_auto_newton_schulz_dtype_and_the_reason_the_summary_gives(tmp_path, monkeypatch):
    from meshloom.observe import cpu
    from meshloom.train.ns_dtype import ns_dtype_reason, resolve_ns_dtype

    def reason(setting: str, device_type: str, cpuinfo) -> str:
        monkeypatch.setattr(cpu, "CPUINFO", cpuinfo)
        return ns_dtype_reason(setting, device_type)

    assert resolve_ns_dtype("auto", "cuda") == "bfloat16" and resolve_ns_dtype("auto", "cpu") == "float32"
    assert resolve_ns_dtype("bfloat16", "cpu") == "bfloat16" and resolve_ns_dtype("float32", "cuda") == "float32"
    avx2 = tmp_path / "avx2"
    avx2.write_text("processor : 0\nflags\t\t: fpu sse avx2 fma\n")
    amx = tmp_path / "amx"
    amx.write_text("processor : 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16\n")
    assert reason("auto", "cpu", avx2) == (
        "float32 (auto: cpu; no native bf16 matmul here, where bf16 is about 10x slower)")
    assert reason("auto", "cpu", amx) == (
        "float32 (auto: cpu; this CPU has avx512_bf16/amx_bf16, set bfloat16 to use it)")
    assert reason("auto", "cuda", avx2) == "bfloat16 (auto: CUDA)"
    assert reason("bfloat16", "cpu", avx2) == "bfloat16 (optimizer.muon_ns_dtype)"


def test_startup_summary_names_the_newton_schulz_dtype(tmp_path):
    from meshloom.config.loader import load_config
    from meshloom.observe.summary import startup_summary

    def summary(*args: str) -> str:
        config = load_config(["--model.flavor", "tiny", *args])
        degrees = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1}
        return startup_summary(config, tmp_path, 10, 10, degrees, 1, "cpu", 512, 1, tmp_path, 0)

    assert "newton-schulz  float32 (auto: cpu;" in summary("--optimizer.name", "Muon")
    assert "newton-schulz" not in summary()


def test_lambda_lr_drives_both_kinds():
    schedule = LRSchedulerConfig(warmup_steps=3, decay_type="cosine", min_lr_ratio=0.1)
    model, reference = toy(), toy()
    optimizer = make_optimizer(model)
    scheduler = build_lr_scheduler(optimizer, schedule, total_steps=STEPS)
    torch_optimizers, experts = _torch_reference(reference, "match_rms_adamw", True, LR)
    for step in range(STEPS):
        expected = LR * lr_factor(step, STEPS, schedule)
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([expected] * 3, rel=1e-12)
        set_grads(model, step)
        set_grads(reference, step)
        for e, expert in enumerate(experts):
            expert.grad = reference.experts.grad[e].clone()
        optimizer.step()
        scheduler.step()
        for torch_optimizer in torch_optimizers:
            for group in torch_optimizer.param_groups:
                group["lr"] = expected
            torch_optimizer.step()
        with torch.no_grad():
            reference.experts.copy_(torch.stack(experts))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


def test_partition_and_build_optimizer():
    model = toy()
    kinds = parameter_kinds(model, adamw_only)
    assert [n for n, k in kinds.items() if k == "muon"] == [
        "experts", "blocks.0.attn.weight", "blocks.0.up.weight", "blocks.0.down.weight",
        "blocks.1.attn.weight", "blocks.1.up.weight", "blocks.1.down.weight",
    ]  # fmt: skip
    groups = muon_param_groups(model, 0.1, adamw_only)
    assert [(g["kind"], g["weight_decay"], len(g["params"])) for g in groups] == [
        ("muon", 0.1, 7), ("adamw", 0.1, 2), ("adamw", 0.0, 4),
    ]  # fmt: skip

    adam = build_optimizer(model, OptimizerConfig(), torch.device("cpu"))
    assert type(adam) is torch.optim.AdamW and [g["weight_decay"] for g in adam.param_groups] == [0.1, 0.0]

    config = OptimizerConfig(name="Muon", lr=1e-3)
    with pytest.raises(ValueError, match="needs the model family's adamw_only rule"):
        build_optimizer(model, config, torch.device("cpu"))
    config.muon_lr, config.muon_momentum, config.muon_ns_steps = 0.02, 0.9, 4
    muon = build_optimizer(model, config, torch.device("cpu"), adamw_only=adamw_only)
    assert [(g["kind"], g["lr"]) for g in muon.param_groups] == [("muon", 0.02), ("adamw", 1e-3), ("adamw", 1e-3)]
    assert (muon.param_groups[0]["momentum"], muon.param_groups[0]["ns_steps"]) == (0.9, 4)
    assert muon.param_groups[1]["foreach"] is True  # as the AdamW path picks on CPU

    model.conv = nn.Parameter(torch.zeros(2, 2, 2, 2))
    with pytest.raises(ValueError, match="parameter conv has 4 dims; .* adamw_only rule must claim it"):
        parameter_kinds(model, adamw_only)
    with pytest.raises(ValueError, match="needs kind = 'muon' or 'adamw'"):
        MuonAdamW([{"params": [model.conv]}])
    with pytest.raises(ValueError, match="not a 1-D parameter .* put it in an 'adamw' group"):
        MuonAdamW([{"kind": "muon", "params": [model.norm.weight]}])


def test_optimizer_state_elements_counts_the_real_state():
    model = toy()
    optimizer = make_optimizer(model)
    train(model, optimizer, 1)
    real = sum(t.numel() for s in optimizer.state.values() for k, t in s.items() if k != "step")
    named = list(model.named_parameters())
    kinds = parameter_kinds(model, adamw_only)
    shapes = [tuple(p.shape) for _, p in named]
    assert optimizer_state_elements(shapes, [kinds[n] for n, _ in named]) == real
    muon_elements = sum(p.numel() for n, p in named if kinds[n] == "muon")
    assert real == 2 * sum(p.numel() for _, p in named) - muon_elements  # AdamW would keep 2 per element
    with pytest.raises(ValueError, match="unknown optimizer kind 'sgd'"):
        optimizer_state_elements([(2, 2)], ["sgd"])


def test_state_of_another_optimizer_is_refused():
    model = toy()
    adam = build_optimizer(model, OptimizerConfig(), torch.device("cpu"))
    train(model, adam, 1)
    with pytest.raises(ValueError, match="saved by another optimizer"):
        make_optimizer(model).load_state_dict(adam.state_dict())


def test_owner_assignment_balances_cost_and_counts():
    assert assign_owners([5, 5, 5, 5, 5], [0, 0]) == [0, 1, 0, 1, 0]
    assert assign_owners([8, 1, 1, 1, 1], [0, 0]) == [0, 1, 1, 1, 1]
    assert assign_owners([4, 4], [10, 0, 3]) == [1, 2]  # earlier buckets' work counts


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("muon_momentum", "1.0", "optimizer.muon_momentum must lie in [0, 1), got 1.0"),
        ("muon_ns_steps", "0", "optimizer.muon_ns_steps must lie in [1, 100)"),
        ("muon_lr", "-1", "optimizer.muon_lr must be >= 0 (0 = optimizer.lr), got -1.0"),
        ("muon_ns_dtype", "float16", "optimizer.muon_ns_dtype must be one of ['auto', 'bfloat16', 'float32'], got 'float16'"),
    ],
)
def test_muon_settings_are_checked(key, value, message):
    with pytest.raises(ConfigError) as err:
        load_config(["--optimizer.name", "Muon", f"--optimizer.{key}", value])
    assert message in str(err.value)


def test_muon_config_loads():
    config = load_config(["--optimizer.name", "Muon", "--optimizer.muon_adjust_lr", "original"])
    assert (config.optimizer.name, config.optimizer.muon_adjust_lr, config.optimizer.muon_ns_steps) == ("Muon", "original", 5)
    with pytest.raises(ConfigError, match="optimizer.name"):
        load_config(["--optimizer.name", "SGD"])


# ---------------------------------------------------------------------------
# Several processes (gloo): one launch of 2 ranks and one of 4 (testing/ranks.py), each running several layouts
# ---------------------------------------------------------------------------

CASES = {2: ["fsdp2", "tp2", "ep2"], 4: ["fsdp4", "fsdp2_tp2", "hsdp2x2", "ep2_fsdp2"]}


def _tensor_parallel(block: Block, mesh) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    parallelize_module(block, mesh, {"attn": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()})


def _distribute_experts(model: Toy, mesh, placements) -> None:
    from torch.distributed.tensor import distribute_tensor

    model.experts = nn.Parameter(distribute_tensor(model.experts.detach(), mesh, placements))


def apply_layout(case: str, model: Toy) -> None:
    """Every Muon matrix ends up a DTensor over all ranks, so each is orthogonalised once per step in the job."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard

    world = torch.distributed.get_world_size()
    if case in ("fsdp2", "fsdp4"):  # experts: Shard(0), each rank's experts whole and local
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif case in ("tp2", "ep2"):  # colwise Shard(0), rowwise Shard(1); experts replicated (tp2) or sharded (ep2)
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            _tensor_parallel(block, mesh)
        _distribute_experts(model, mesh, [Replicate() if case == "tp2" else Shard(0)])
    elif case == "fsdp2_tp2":  # strided shard (FSDP over TP colwise) and (Shard(0), Shard(1)); experts EP x replicated
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            _tensor_parallel(block, mesh["tp"])
            fully_shard(block, mesh=mesh["dp"])
        _distribute_experts(model, mesh, [Shard(0), Replicate()])
    elif case == "hsdp2x2":  # (Replicate, Shard(0)) everywhere
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif case == "ep2_fsdp2":  # experts split by expert over ep and by row over fsdp; blocks HSDP over (ep, fsdp)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "fsdp"))
        _distribute_experts(model, mesh, [Shard(0), Shard(1)])
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
    else:
        raise AssertionError(case)


def _dcp_case(folder: Path) -> dict:
    """FSDP 2: train 4 steps, save through DCP, train 4 more; a fresh model loading the checkpoint must continue to
    the same parameters. The pytest process then loads the same checkpoint into one process."""
    import torch.distributed.checkpoint as dcp

    def fresh() -> tuple[Toy, torch.optim.Optimizer]:
        model = toy()
        apply_layout("fsdp2", model)
        return model, make_optimizer(model)

    model, optimizer = fresh()
    train(model, optimizer, 4)
    saved = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer, options=FLAT)}
    dcp.save(saved, checkpoint_id=str(folder / "checkpoint"))
    train(model, optimizer, 4, start=4)
    continued = full_params(model)

    model, optimizer = fresh()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer, options=FLAT)}
    dcp.load(state, checkpoint_id=str(folder / "checkpoint"))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"], options=FLAT)
    train(model, optimizer, 4, start=4)
    resumed = full_params(model)
    if torch.distributed.get_rank() == 0:
        torch.save(continued, folder / "dcp_continued.pt")
    keys = sorted(k for k in saved["optim"] if k.startswith("state."))
    return {"resumed_vs_continued": max_difference(resumed, continued), "state_keys": keys}


def worker(folder: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    reference = reference_params()  # this process's own single-process run
    results: dict = {}
    for case in CASES[world]:
        model = toy()
        apply_layout(case, model)
        optimizer = make_optimizer(model)
        start = time.perf_counter()
        train(model, optimizer, STEPS)
        seconds = time.perf_counter() - start
        params = full_params(model)
        counts: list = [None] * world
        dist.all_gather_object(counts, optimizer.newton_schulz_calls)
        results[case] = {"max_difference": max_difference(params, reference), "ns_calls": counts, "seconds": seconds}
        if rank == 0:
            torch.save(params, folder / f"{case}.pt")
    if world == 2:
        results["dcp"] = _dcp_case(folder)
    if rank == 0:
        (folder / "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo can abort in destructors at interpreter exit


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[int, tuple[Path, dict]]:
    out = {}
    for world in (2, 4):
        folder = tmp_path_factory.mktemp(f"muon{world}")
        start = time.perf_counter()
        run_ranks(worker, world, folder)
        results = json.loads((folder / "results.json").read_text())
        results["launch_seconds"] = time.perf_counter() - start
        out[world] = (folder, results)
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return reference_params()  # in this process, with its own thread count


@pytest.mark.parametrize("world, case", [(w, c) for w, cases in CASES.items() for c in cases])
def test_layout_matches_one_process(launches, reference, world, case):
    folder, results = launches[world]
    # against the single-process run inside the ranks (one thread each) ...
    assert results[case]["max_difference"] <= TOLERANCE, results[case]
    # ... and against this process's run, with its own thread count
    params = torch.load(folder / f"{case}.pt", weights_only=True)
    assert max_difference(params, reference) <= TOLERANCE


@pytest.mark.parametrize("world, case", [(w, c) for w, cases in CASES.items() for c in cases])
def test_newton_schulz_work_is_spread_over_the_ranks(launches, world, case):
    calls = launches[world][1][case]["ns_calls"]
    assert sum(calls) == STEPS * MATRICES, calls  # each matrix once per step in the whole job
    share = MATRICES / world
    assert all(STEPS * math.floor(share) <= c <= STEPS * math.ceil(share) for c in calls), calls


def test_checkpoint_round_trip_and_reshard_to_one_process(launches, reference):
    folder, results = launches[2]
    dcp_results = results["dcp"]
    assert dcp_results["resumed_vs_continued"] == 0.0  # FSDP 2 -> FSDP 2: bit for bit
    assert "state.blocks.0.up.weight.momentum_buffer" in dcp_results["state_keys"]
    assert {"state.embed.weight.exp_avg", "state.embed.weight.exp_avg_sq", "state.embed.weight.step"} <= set(
        dcp_results["state_keys"]
    )
    assert "state.experts.momentum_buffer" in dcp_results["state_keys"]

    import torch.distributed.checkpoint as dcp

    model = toy()
    optimizer = make_optimizer(model)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer, options=FLAT)}
    dcp.load(state, checkpoint_id=str(folder / "checkpoint"))  # saved by 2 ranks, loaded by 1
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"], options=FLAT)
    train(model, optimizer, 4, start=4)
    resumed = full_params(model)
    continued = torch.load(folder / "dcp_continued.pt", weights_only=True)
    assert max_difference(resumed, continued) <= TOLERANCE
    assert max_difference(resumed, reference_params(8)) <= TOLERANCE
