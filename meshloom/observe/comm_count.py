"""Count the bytes a rank's collectives send, by mesh dimension, as the planner's communication model counts them.

`CommCounter` is a dispatch mode: every c10d collective and point-to-point op this process issues while it is active
(FSDP's gathers and reduce-scatters, DTensor's functional collectives, pipeline sends, the expert all-to-all) passes
through it with its tensors and its process group. Each is booked to the mesh dimension whose group it ran on, at
the bytes a ring algorithm sends from one rank, the model `planning/comm_estimate.py` uses:

- all-gather over n ranks: (n - 1) x the local input; reduce-scatter: (n - 1)/n x the input; all-reduce: twice that;
- all-to-all (expert parallel's, booked to ep): (n - 1)/n of the input, what leaves the rank under uniform routing,
  which the estimate assumes. A rank's real share depends on where its tokens' experts are; over the group the
  inputs sum to the same rows either way, so the mean over ranks is the uniform figure;
- send: the tensor; recv: nothing.

What gloo does underneath (its reduce-scatter is an all-reduce) is deliberately not what is counted: the estimate
plans for NCCL's ring algorithms, and this checks that it finds every collective and sizes each right.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_c10d = torch.ops.c10d
_functional = torch.ops._c10d_functional
# op -> (what it is, the position of its input tensor(s), the position of its process group or group name).
_OPS = {
    _c10d._allgather_base_: ("all_gather", 1, 2),
    _c10d._reduce_scatter_base_: ("reduce_scatter", 1, 2),
    _c10d.allreduce_: ("all_reduce", 0, 1),
    _c10d.alltoall_base_: ("all_to_all", 1, 2),
    _c10d.send: ("send", 0, 1),
    _functional.all_gather_into_tensor: ("all_gather", 0, 2),
    _functional.reduce_scatter_tensor: ("reduce_scatter", 0, 3),
    _functional.all_reduce: ("all_reduce", 0, 2),
    _functional.all_to_all_single: ("all_to_all", 0, 3),
}
# Bytes one rank sends, from the group size and the bytes of its input.
_SENT = {
    "all_gather": lambda n, size: (n - 1) * size,
    "reduce_scatter": lambda n, size: _ring(n) * size,
    "all_reduce": lambda n, size: 2 * _ring(n) * size,
    "all_to_all": lambda n, size: _ring(n) * size,
    "send": lambda n, size: size,
}
# Ops in those namespaces that send nothing themselves: waits, receives, and DTensor's autograd wrapper.
_NOT_SENDING = {"c10d.recv_", "c10d.recv_any_source_", "_c10d_functional.wait_tensor", "_c10d_functional._wrap_tensor_autograd"}


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


class CommCounter(TorchDispatchMode):
    """Bytes sent per mesh dimension while active. `dims` maps a process group's name to the dimension it belongs
    to (`group_dimensions(dims)`); a group not in it is booked under its own name."""

    def __init__(self, dims: dict[str, str]):
        super().__init__()
        self.dims = dims
        self.sent: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def _group(self, group: Any) -> tuple[str, int]:
        if not isinstance(group, str):
            group = torch._C._distributed_c10d.ProcessGroup.unbox(group).group_name
        from torch.distributed.distributed_c10d import _resolve_process_group

        return self.dims.get(group, group), _resolve_process_group(group).size()

    def _book(self, op: str, inputs: Any, group: Any) -> None:
        dim, n = self._group(group)
        if op == "all_to_all":
            # Expert parallel's dispatch and combine, the only all-to-alls; its group may be the same ranks (and
            # the same process group) as dp_shard's, which it borrows.
            dim = "ep"
        size = sum(_bytes(t) for t in inputs) if isinstance(inputs, list | tuple) else _bytes(inputs)
        sent = _SENT[op](n, size)
        self.sent[dim] += sent
        self.calls[f"{dim}:{op}"] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        packet = func.overloadpacket
        if (known := _OPS.get(packet)) is not None:
            op, input_at, group_at = known
            self._book(op, args[input_at], args[group_at])
        elif str(packet).startswith(("c10d.", "_c10d_functional.")) and str(packet) not in _NOT_SENDING:
            self.calls[f"uncounted:{packet}"] += 1  # a collective this model does not size: the test shows it
        return func(*args, **(kwargs or {}))


# The dimensions a flattened mesh spans; it is booked to the one of size > 1, or under its own name if several are.
_FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "efsdp": ("dp_shard", "cp"),
}


def group_dimensions(dims: Any) -> dict[str, str]:
    """Process-group name -> mesh dimension for a built ParallelDims (its 1-D meshes, base dimensions first)."""
    out: dict[str, str] = {}
    sizes = {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp, "tp": dims.tp}
    for name in (*sizes, "ep", *_FLATTENED):
        try:
            mesh = dims.mesh(name)
        except KeyError:
            continue
        if mesh.ndim != 1 or mesh.size() == 1:
            continue
        spanned = [d for d in _FLATTENED.get(name, (name,)) if sizes.get(d, mesh.size()) > 1]
        out.setdefault(mesh.get_group().group_name, spanned[0] if len(spanned) == 1 else name)
    return out
