"""Muon for hidden weight matrices and AdamW for everything else, as one optimizer that works on DTensors.

The Muon maths is ``torch.optim.Muon``'s (torch 2.13): momentum buffer ``B <- lerp(B, g, 1 - mu)``, Nesterov update
``lerp(g, B, mu)``, Newton-Schulz orthogonalisation in bf16 (torch's own function, so the coefficients and the
operation order are torch's; ``ns_dtype="float32"`` runs the same operations in fp32), decoupled weight decay
``p <- p * (1 - lr * wd)``, then ``p <- p - adjusted_lr * O``. A 3-D parameter ``[n_experts, out, in]`` is a stack of
expert matrices, orthogonalised one by one, each with the learning-rate adjustment of its own ``out x in`` shape.
AdamW groups run ``torch.optim.adamw.adamw`` on the state ``torch.optim.AdamW`` keeps, under the same names, so they
are bit-identical to it.

Every group has a ``kind``, "muon" or "adamw", and its own ``lr``: one LR scheduler drives both kinds. The momentum
buffer has the parameter's layout (a DTensor shard under FSDP/TP), so distributed checkpointing saves and reshards
it like AdamW's moments. Where the Newton-Schulz work runs on a mesh is described in ``meshloom/train/orthogonalize.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz
from torch.optim.adamw import adamw

from meshloom.config.errors import UserError
from meshloom.train.ns_dtype import NS_DTYPES
from meshloom.tensors import local_tensor
from meshloom.train.orthogonalize import Bucket, build_buckets

NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
ADJUST_LR_MODES = ("match_rms_adamw", "original")


def newton_schulz(matrix: Tensor, coefficients: Sequence[float], steps: int, eps: float, dtype: torch.dtype) -> Tensor:
    """torch.optim.Muon's Newton-Schulz iteration with the working dtype as a choice: bf16 calls torch's own function,
    any other dtype runs ``newton_schulz_in``."""
    if dtype == torch.bfloat16:
        return _zeropower_via_newtonschulz(matrix, tuple(coefficients), steps, eps)
    return newton_schulz_in(matrix, coefficients, steps, eps, dtype)


def newton_schulz_in(
    matrix: Tensor, coefficients: Sequence[float], steps: int, eps: float, dtype: torch.dtype
) -> Tensor:
    """The operations of torch's ``_zeropower_via_newtonschulz``, in its order, in `dtype` (in bf16 it equals torch's
    bit for bit; tests/test_muon.py checks that)."""
    a, b, c = coefficients
    x = matrix.to(dtype)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, mode: str, shape: Sequence[int]) -> float:
    """Learning rate for one m x n matrix (the last two dims): "match_rms_adamw" scales by 0.2*sqrt(max(m, n)) so the
    update's RMS matches AdamW's, "original" by sqrt(max(1, m/n))."""
    m, n = shape[-2], shape[-1]
    if mode == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(m, n))
    if mode == "original":
        return lr * math.sqrt(max(1, m / n))
    raise UserError(f"unknown Muon learning-rate adjustment {mode!r}; use one of {ADJUST_LR_MODES}")


class MuonAdamW(torch.optim.Optimizer):
    """Param groups of kind "muon" (2-D matrices, 3-D expert stacks) and "adamw" (anything), stepped together.

    Keyword arguments are the defaults of groups that do not set a value; ``eps`` is Muon's Newton-Schulz norm floor
    and ``adamw_eps`` AdamW's epsilon (a group's own ``eps`` is the one of its kind). ``ns_dtype`` ("bfloat16" as
    torch.optim.Muon, or "float32"; the config's "auto" is resolved by ``meshloom.train.ns_dtype``) is the dtype Newton-Schulz runs in and the update shards travel in.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 1e-3,
        *,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = EPS,
        ns_steps: int = 5,
        adjust_lr_fn: str = "match_rms_adamw",
        ns_dtype: str = "bfloat16",
        betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        foreach: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        muon_defaults = {
            "lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients), "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn,
        }  # fmt: skip
        # torch.optim.AdamW's group settings, so its functional kernel sees what AdamW would pass.
        adamw_defaults = {
            "lr": lr, "betas": tuple(betas), "eps": adamw_eps, "weight_decay": weight_decay, "amsgrad": False,
            "maximize": False, "foreach": foreach, "capturable": False, "differentiable": False, "fused": fused,
            "decoupled_weight_decay": True,
        }  # fmt: skip
        self._kind_defaults = {"muon": muon_defaults, "adamw": adamw_defaults}
        if ns_dtype not in NS_DTYPES:
            raise UserError(f"Muon's Newton-Schulz dtype must be one of {list(NS_DTYPES)}, got {ns_dtype!r}")
        # An optimizer setting, not a group one: a checkpoint's groups must not override it on resume.
        self.ns_dtype = NS_DTYPES[ns_dtype]
        self._buckets: list[Bucket] = []
        self._planned: tuple[int, ...] = ()
        self.newton_schulz_calls = 0  # matrices this rank orthogonalised, for tests and load-balance checks
        super().__init__(list(params), {"lr": lr})

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_kind_defaults": self._kind_defaults, "ns_dtype": self.ns_dtype}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_kind_defaults" in state:  # unpickling or deepcopy; load_state_dict passes state and groups only
            self._kind_defaults = state.pop("_kind_defaults")
            self.ns_dtype = state.pop("ns_dtype", torch.bfloat16)
            self._buckets, self._planned, self.newton_schulz_calls = [], (), 0  # process groups do not travel
        super().__setstate__(state)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        kind = param_group.get("kind")
        if kind not in self._kind_defaults:
            raise ValueError(f"every MuonAdamW param group needs kind = 'muon' or 'adamw', got {kind!r}")
        for key, value in self._kind_defaults[kind].items():
            param_group.setdefault(key, value)
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        if kind == "muon":
            for p in params:
                if p.ndim not in (2, 3):
                    raise UserError(
                        f"Muon updates 2-D matrices and 3-D stacks of expert matrices, not a {p.ndim}-D parameter of "
                        f"shape {tuple(p.shape)}; put it in an 'adamw' group"
                    )
            adjusted_lr(1.0, param_group["adjust_lr_fn"], (1, 1))  # refuses an unknown mode now, not at step 1
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = [group.get("kind") for group in state_dict["param_groups"]]
        current = [group["kind"] for group in self.param_groups]
        if saved != current:
            raise UserError(
                f"this optimizer state has param-group kinds {saved}, but the optimizer has {current}: it was saved by "
                "another optimizer (optimizer.name) or another split of the parameters"
            )
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon_groups = []
        for group in self.param_groups:
            if group["kind"] == "adamw":
                self._adamw_step(group)
            else:
                muon_groups.append(group)
        if muon_groups:
            self._muon_step(muon_groups)
        return loss

    def _adamw_step(self, group: dict[str, Any]) -> None:
        # A foreach kernel cannot mix plain tensors and DTensors (say TP biases next to unsharded norms), so each
        # kind of tensor gets its own call; every element's arithmetic is the same either way.
        by_layout: dict[Any, list[Tensor]] = {}
        for p in group["params"]:
            if p.grad is not None:
                by_layout.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
        for params in by_layout.values():
            self._adamw_update(group, params)

    def _adamw_update(self, group: dict[str, Any], with_grad: list[Tensor]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        has_complex = False
        for p in with_grad:
            has_complex |= torch.is_complex(p)
            state = self.state[p]
            if not state:
                # Where and in which dtype torch.optim.AdamW keeps its step counter.
                on_device = group["capturable"] or group["fused"]
                scalar = torch.float32 if on_device or torch.get_default_dtype() != torch.float64 else torch.float64
                state["step"] = torch.zeros((), dtype=scalar, device=p.device if on_device else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if group["amsgrad"]:
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, foreach=group["foreach"],
              capturable=group["capturable"], differentiable=group["differentiable"], fused=group["fused"],
              has_complex=has_complex, amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])  # fmt: skip

    def _plan(self, params: list[Tensor]) -> list[Bucket]:
        # Built at the first step (it talks to the other ranks once), again only if the Muon parameters change.
        key = tuple(id(p) for p in params)
        if key != self._planned:
            self._buckets, self._planned = build_buckets(params), key
        return self._buckets

    def _muon_step(self, groups: list[dict[str, Any]]) -> None:
        group_of = {p: group for group in groups for p in group["params"]}  # insertion-ordered, hashed by id
        updates: dict[int, Tensor] = {}  # by id(param): tensors compare elementwise
        for p, group in group_of.items():
            if p.grad is None:
                continue
            grad = p.grad
            if isinstance(grad, DTensor) and any(placement.is_partial() for placement in grad.placements):
                # A replicated weight fed by sequence-sharded inputs (tensor parallel's sequence-parallel regions, e.g.
                # MLA's down-projections) gets a pending sum over tp: complete it, as AdamW's DTensor arithmetic does.
                grad = grad.redistribute(grad.device_mesh, p.placements)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            grad = local_tensor(grad)
            buf = local_tensor(state["momentum_buffer"])
            buf.lerp_(grad, 1 - group["momentum"])
            update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
            # Newton-Schulz starts by rounding to its dtype, elementwise, so shards are rounded before they travel.
            updates[id(p)] = update.to(self.ns_dtype, copy=True)

        for bucket in self._plan(list(group_of)):
            entry_groups = [group_of[p] for p in bucket.params]

            def orthogonalize_one(entry: int, matrix: Tensor, groups: list = entry_groups) -> Tensor:
                self.newton_schulz_calls += 1
                group = groups[entry]
                return newton_schulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)

            results = bucket.orthogonalize([updates.get(id(p)) for p in bucket.params], orthogonalize_one)
            for p, orthogonal, group in zip(bucket.params, results, entry_groups):
                if orthogonal is None:
                    continue
                lr, param = group["lr"], local_tensor(p)
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(orthogonal, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))


def parameter_kinds(model: nn.Module, adamw_only: Callable[[str], bool]) -> dict[str, str]:
    """Kind of every trainable parameter by name: "muon" for each matrix (ndim >= 2) that `adamw_only` does not claim
    (embeddings, output heads, routers are the model family's to name), "adamw" for the rest."""
    kinds = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim >= 2 and not adamw_only(name):
            if p.ndim > 3:
                raise UserError(
                    f"parameter {name} has {p.ndim} dims; Muon takes 2-D matrices and 3-D expert stacks only, so the "
                    "model family's adamw_only rule must claim it"
                )
            kinds[name] = "muon"
        else:
            kinds[name] = "adamw"
    return kinds


def muon_param_groups(model: nn.Module, weight_decay: float, adamw_only: Callable[[str], bool]) -> list[dict]:
    """Muon matrices with weight decay; AdamW matrices with it and AdamW vectors (norms, biases) without, as for
    plain AdamW. Empty groups are left out: a checkpoint keys group settings by parameter name."""
    kinds = parameter_kinds(model, adamw_only)
    named = dict(model.named_parameters())
    muon = [named[n] for n, k in kinds.items() if k == "muon"]
    decay = [named[n] for n, k in kinds.items() if k == "adamw" and named[n].ndim >= 2]
    no_decay = [named[n] for n, k in kinds.items() if k == "adamw" and named[n].ndim < 2]
    groups = [
        {"kind": "muon", "params": muon, "weight_decay": weight_decay},
        {"kind": "adamw", "params": decay, "weight_decay": weight_decay},
        {"kind": "adamw", "params": no_decay, "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def optimizer_state_elements(param_shapes: Sequence[Sequence[int]], kinds: Sequence[str]) -> int:
    """Elements of optimizer state, in the parameters' dtype: one momentum buffer per Muon parameter, two moments
    (exp_avg, exp_avg_sq) per AdamW parameter. AdamW's 0-d step counters are left out, as the memory estimator does.
    Pass local shard shapes for per-rank state. Newton-Schulz also needs, transiently on the rank that owns a matrix,
    the whole matrix in the Newton-Schulz dtype plus a few temporaries of its size (not counted here)."""
    if len(param_shapes) != len(kinds):
        raise ValueError(f"{len(param_shapes)} shapes but {len(kinds)} kinds")
    per_kind = {"muon": 1, "adamw": 2}
    total = 0
    for shape, kind in zip(param_shapes, kinds):
        if kind not in per_kind:
            raise ValueError(f"unknown optimizer kind {kind!r}; use 'muon' or 'adamw'")
        total += per_kind[kind] * math.prod(shape)
    return total
