"""Silent data corruption check (`fault_tolerance.replica_check_interval`): parameters that must be equal on
several ranks are compared by fingerprint, and a mismatch stops the run naming the ranks and the first parameter.

Copies that must agree:
- across replica groups: group rank r of every group holds the same shards (same layout, same updates) and the same
  persistent buffers, which training updates alike in every group (an MoE layer's expert_bias; non-persistent
  buffers are per rank or derived and are left out);
- inside a group: a DTensor's local tensor is the same on every rank of each mesh dimension where its placement is
  `Replicate` (parameters replicated under tensor parallelism, such as norms).

A fingerprint is the 64-bit integer sum of a tensor's bits read as integers, with a second sum weighted by position:
any single flipped bit changes the first sum, so one bad bit always shows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from meshloom.train.fault_injection import plain_name

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class SilentCorruptionError(RuntimeError):
    """Copies of a parameter that must be equal differ: a hardware or software fault changed one of them."""


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """[2] int64: the sum of the tensor's bits as integers, and the same sum weighted by (position mod 65521) + 1."""
    words = tensor.detach().contiguous().view(-1).view(_INT_OF_SIZE[tensor.element_size()]).to(torch.int64)
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64) % 65521 + 1
    return torch.stack([words.sum(), (words * weights).sum()])


def named_local_parameters(model_parts: list[nn.Module]) -> list[tuple[str, torch.Tensor, DTensor | None]]:
    out = []
    for part in model_parts:
        for name, param in part.named_parameters():
            dtensor = param if isinstance(param, DTensor) else None
            out.append((plain_name(name), param.to_local() if dtensor is not None else param, dtensor))
    return out


def named_persistent_buffers(model_parts: list[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """The buffers a checkpoint saves (an MoE layer's expert_bias), by plain name. Non-persistent buffers are per
    rank or derived (a step's token counts, rotary tables) and are left out."""
    out = []
    for part in model_parts:
        for prefix, module in part.named_modules():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer is not None and name not in module._non_persistent_buffers_set:
                    local = buffer.to_local() if isinstance(buffer, DTensor) else buffer
                    out.append((plain_name(f"{prefix}.{name}" if prefix else name), local))
    return out


def _first_mismatch(names: list[str], gathered: list[torch.Tensor]) -> tuple[str, list[int]] | None:
    """(first parameter whose fingerprints differ, the indices of the copies that disagree with the majority)."""
    stacked = torch.stack(gathered)  # [copies, params, 2]
    differs = (stacked != stacked[:1]).any(dim=2).any(dim=0)
    if not differs.any():
        return None
    index = int(differs.nonzero()[0])
    values = [tuple(row[index].tolist()) for row in stacked]
    majority = max(set(values), key=values.count)
    odd = [i for i, v in enumerate(values) if v != majority]
    if len(odd) * 2 >= len(values):  # no majority (two copies): all of them are suspects
        odd = list(range(len(values)))
    return names[index], odd


def _gather(local: torch.Tensor, size: int, all_gather) -> list[torch.Tensor]:
    out = [torch.empty_like(local) for _ in range(size)]
    all_gather(out, local)
    return out


def check_within_group(model_parts: list[nn.Module]) -> None:
    """Compare TP-replicated (and other `Replicate`) local tensors over their mesh dimensions."""
    groups: dict[tuple[int, int], list[tuple[str, torch.Tensor]]] = {}
    meshes = {}
    for name, local, dtensor in named_local_parameters(model_parts):
        if dtensor is None:
            continue
        for dim, placement in enumerate(dtensor.placements):
            if isinstance(placement, Replicate) and dtensor.device_mesh.size(dim) > 1:
                key = (id(dtensor.device_mesh), dim)
                meshes[key] = dtensor.device_mesh
                groups.setdefault(key, []).append((name, fingerprint(local)))
    for key, items in groups.items():
        mesh, dim = meshes[key], key[1]
        group = mesh.get_group(dim)
        local = torch.stack([fp for _, fp in items])
        gathered = _gather(local, mesh.size(dim), lambda out, t, g=group: dist.all_gather(out, t, group=g))
        if (found := _first_mismatch([n for n, _ in items], gathered)) is not None:
            name, odd = found
            ranks = [dist.get_global_rank(group, i) for i in odd]
            raise SilentCorruptionError(
                f"silent data corruption: parameter {name} differs between ranks {ranks} of mesh dimension "
                f"{mesh.mesh_dim_names[dim] if mesh.mesh_dim_names else dim}, where its copies must be equal; stop "
                "and check those devices"
            )


def check_across_groups(model_parts: list[nn.Module], all_gather, live: int, replica_id: int, group_rank: int) -> None:
    """Compare this group rank's parameters and persistent buffers with the same group rank of every live group.

    all_gather(out_list, tensor) runs over the quorum's groups (one copy per group)."""
    items = [(f"parameter {name}", t) for name, t, _ in named_local_parameters(model_parts)]
    items += [(f"buffer {name}", t) for name, t in named_persistent_buffers(model_parts)]
    # The last row says whose copy it is.
    local = torch.stack([fingerprint(t) for _, t in items] + [torch.tensor([replica_id, group_rank])])
    gathered = _gather(local, live, all_gather)
    found = _first_mismatch([n for n, _ in items], [g[:-1] for g in gathered])
    if found is not None:
        name, odd = found
        where = ", ".join(f"replica group {int(gathered[i][-1, 0])} rank {group_rank}" for i in odd)
        raise SilentCorruptionError(
            f"silent data corruption: {name} differs between replica groups ({where}), where its copies "
            "must be equal; stop and check those devices"
        )
