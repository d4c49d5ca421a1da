"""Where Muon's Newton-Schulz work runs, and how the shards of each matrix travel there and back.

Newton-Schulz needs a whole matrix, but under FSDP, TP and HSDP a parameter (a DTensor) is split over the ranks of its
mesh. Every mesh dimension plays one of three roles for a parameter:

- *matrix* dims shard one of the matrix's own two dimensions (FSDP Shard(0), TP colwise Shard(0) / rowwise Shard(1),
  FSDP x TP's strided shard): the ranks along them hold pieces of the same matrix;
- *expert* dims shard dim 0 of a 3-D expert weight [n_experts, out, in]: each rank holds whole expert matrices, so
  nothing travels along them;
- *replica* dims (Replicate, e.g. HSDP's replicate dim) hold equal copies.

Parameters whose dims play the same roles on the same ranks form a :class:`Bucket`. A bucket's matrices (one per 2-D
parameter, one per local expert of a 3-D one) are given owners among the ``S x R`` ranks of one *work group* (S = ranks
along the matrix dims, R = ranks along the replica dims), balancing the Newton-Schulz cost ``m*n*min(m, n)`` (counting
what each rank got from earlier buckets) so each rank orthogonalises about 1/(S*R) of them. A step then costs at most
three collectives per bucket:

1. gather: one ``all_to_all_single`` over the S matrix-dim ranks of each replica sends every rank's piece of
   each matrix to its owner, if that owner sits in the same replica (replicas hold equal data, so only one sends);
   each rank receives at most the matrices it owns, in full, and sends the pieces of its own shard once;
2. scatter: one ``all_to_all_single`` back, the owner sending each rank its piece of the result;
3. replicas: when R > 1, one ``all_to_all_single`` over the R replica ranks swaps the pieces each replica owned, so
   every replica ends with the same result bit for bit (one owner computed it).

Per step and rank, phases 1 and 2 move the rank's own shard of the bucket once each way in the Newton-Schulz dtype
(bf16 by default: 2 bytes per element), plus the owned matrices in full into and out of the owner; phase 3 moves
(R-1)/R of the shard.
Every collective uses the mesh's own groups (``DeviceMesh.get_group``) or, when a role spans several mesh dims, a
group of exactly those ranks made once with ``new_group(use_local_synchronization=True)``, so pipeline stages on
different ranks never need to agree on it. Plain tensors (and DTensors with only expert dims) are orthogonalised
locally with no communication.

Each rank learns the other ranks' pieces once, when the first step builds the plan: the global offset and size of every
local shard (from the DTensor, the same chunk description distributed checkpointing saves) and each rank's load so far
are all-gathered over the work group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from meshloom.tensors import local_tensor

# A block of a matrix: ((row offset, column offset), (rows, columns)).
Box = tuple[tuple[int, int], tuple[int, int]]
Orthogonalize = Callable[[int, Tensor], Tensor]  # (entry index, full matrix in the NS dtype) -> orthogonalised matrix

_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


@dataclass(frozen=True)
class Matrix:
    """One matrix to orthogonalise: a 2-D parameter, or one local expert (row of dim 0) of a 3-D one."""

    entry: int
    expert: int | None
    owner: int  # worker index in the work group: replica * S + member


def mesh_roles(param: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(matrix dims, replica dims) of a DTensor's mesh; dims that split the experts of a 3-D weight are in neither."""
    if not isinstance(param, DTensor):
        return (), ()
    matrix, replica = [], []
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_replicate():
            replica.append(mesh_dim)
            continue
        if placement.is_partial() or not hasattr(placement, "dim"):
            raise ValueError(f"Muon cannot update a parameter placed as {param.placements}: only Shard and Replicate")
        # Shard and FSDP x TP's strided shard both name the tensor dim they split.
        if param.ndim == 3 and placement.dim % 3 == 0:
            continue
        matrix.append(mesh_dim)
    return tuple(matrix), tuple(replica)


def _ranks_along(param: DTensor, dims: tuple[int, ...]) -> list[int]:
    """Global ranks that differ from this one only along `dims`, in row-major order of their coordinates."""
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the parameter's mesh"
    index = tuple(slice(None) if d in dims else c for d, c in enumerate(coordinate))
    return mesh.mesh[index].flatten().tolist()


def _group_for(param: DTensor, dims: tuple[int, ...], ranks: list[int]) -> dist.ProcessGroup | None:
    if len(ranks) == 1:
        return None
    if len(dims) == 1:
        return param.device_mesh.get_group(dims[0])
    key = tuple(sorted(ranks))
    if key not in _GROUPS:
        # Only these ranks take part, so other pipeline stages or replicas need not make the same call.
        _GROUPS[key] = dist.new_group(ranks=list(key), use_local_synchronization=True)
    return _GROUPS[key]


class _Peers:
    """Ranks along some mesh dims, indexed by coordinate order, with the process group joining them."""

    def __init__(self, param: Tensor, dims: tuple[int, ...]):
        # order[g]: the coordinate index of group rank g (all_to_all splits follow group-rank order).
        self.ranks, self.group, self.index, self.order = [0], None, 0, [0]
        if not isinstance(param, DTensor) or not dims:
            return
        self.ranks = _ranks_along(param, dims)
        self.group = _group_for(param, dims, self.ranks)
        self.index = self.ranks.index(dist.get_rank())
        if self.group is not None:
            self.order = [self.ranks.index(rank) for rank in dist.get_process_group_ranks(self.group)]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def all_to_all(self, pieces: list[list[Tensor]], receive: list[int], like: Tensor) -> list[Tensor]:
        """Send pieces[j] (flattened, concatenated) to peer j; return what each peer sent, in coordinate order."""
        send = [torch.cat([p.reshape(-1) for p in pieces[j]]) if pieces[j] else like.new_empty(0) for j in range(self.size)]
        order = self.order
        inputs = torch.cat([send[j] for j in order])
        output = like.new_empty(sum(receive))
        dist.all_to_all_single(
            output, inputs, [receive[j] for j in order], [send[j].numel() for j in order], group=self.group
        )
        chunks = dict(zip(order, output.split([receive[j] for j in order])))
        return [chunks[j] for j in range(self.size)]


def _my_box(param: Tensor) -> Box:
    """This rank's block of the matrix dims (the last two) of a parameter, in global coordinates."""
    if isinstance(param, DTensor):
        (chunk,) = param.__create_chunk_list__()
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
    else:
        offsets, sizes = (0,) * param.ndim, tuple(param.shape)
    return (offsets[-2], offsets[-1]), (sizes[-2], sizes[-1])


def _cost(shape: Sequence[int]) -> int:
    m, n = shape[-2], shape[-1]
    return m * n * min(m, n)


def assign_owners(costs: Sequence[int], prior_loads: Sequence[int]) -> list[int]:
    """Owner of each matrix: largest first, each to the least loaded worker (lowest index on ties), starting from the
    work each worker already has from earlier buckets. Equal matrices go round-robin, and every worker gets about
    1/workers of the Newton-Schulz cost."""
    load = list(prior_loads)
    workers = len(load)
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        worker = min(range(workers), key=lambda w: (load[w], w))
        owners[i] = worker
        load[worker] += costs[i]
    return owners


class Bucket:
    """Parameters whose mesh dims play the same roles on the same ranks: orthogonalised together each step."""

    def __init__(self, params: list[Tensor], prior_load: int = 0):
        self.params = params
        matrix_dims, replica_dims = mesh_roles(params[0])
        self.members = _Peers(params[0], matrix_dims)  # ranks holding pieces of the same matrices
        self.replicas = _Peers(params[0], replica_dims)  # ranks holding equal copies
        mine = [_my_box(p) for p in params]
        if self.members.group is not None:
            gathered: list[list[Box] | None] = [None] * self.members.size
            dist.all_gather_object(gathered, mine, group=self.members.group)
            by_coordinate = dict(zip(self.members.order, gathered))
            self.boxes = [[by_coordinate[j][e] for j in range(self.members.size)] for e in range(len(params))]
        else:
            self.boxes = [[box] for box in mine]
        for param, box in zip(params, mine):
            assert tuple(local_tensor(param).shape[-2:]) == box[1], (param.shape, box)
        matrices = [(e, None) if p.ndim == 2 else (e, x) for e, p in enumerate(params) for x in self._experts(p)]
        costs = [_cost(params[e].shape) for e, _ in matrices]
        owners = assign_owners(costs, self._work_group_loads(prior_load))
        self.matrices = [Matrix(e, x, owner) for (e, x), owner in zip(matrices, owners)]
        self.cost = sum(c for c, owner in zip(costs, owners) if owner == self.worker)  # this rank's share

    def _work_group_loads(self, mine: int) -> list[int]:
        """Newton-Schulz cost each worker of the work group already has from earlier buckets, by worker index."""
        row = [mine]
        if self.members.group is not None:
            gathered: list[int | None] = [None] * self.members.size
            dist.all_gather_object(gathered, mine, group=self.members.group)
            by_coordinate = dict(zip(self.members.order, gathered))
            row = [by_coordinate[j] for j in range(self.members.size)]
        if self.replicas.group is None:
            return row
        rows: list[list[int] | None] = [None] * self.replicas.size
        dist.all_gather_object(rows, row, group=self.replicas.group)
        by_coordinate = dict(zip(self.replicas.order, rows))
        return [load for k in range(self.replicas.size) for load in by_coordinate[k]]

    @staticmethod
    def _experts(param: Tensor) -> range:
        return range(local_tensor(param).shape[0]) if param.ndim == 3 else range(1)

    @property
    def worker(self) -> int:
        return self.replicas.index * self.members.size + self.members.index

    def _numel(self, matrix: Matrix, member: int) -> int:
        rows, columns = self.boxes[matrix.entry][member][1]
        return rows * columns

    def orthogonalize(self, updates: list[Tensor | None], newton_schulz: Orthogonalize) -> list[Tensor | None]:
        """Local updates of the bucket's parameters, in the Newton-Schulz dtype (None: no gradient, skipped on every
        rank alike) -> this rank's piece of their orthogonalised updates, same shapes."""
        S, me, replica = self.members.size, self.members.index, self.replicas.index
        live = [m for m in self.matrices if updates[m.entry] is not None]

        def piece(m: Matrix) -> Tensor:
            update = updates[m.entry]
            return update if m.expert is None else update[m.expert]

        in_replica = [m for m in live if m.owner // S == replica]
        owned = [m for m in in_replica if m.owner % S == me]
        like = next((u for u in updates if u is not None), None)
        if like is None:
            return updates

        if S == 1:
            results = {m: newton_schulz(m.entry, piece(m)) for m in owned}
        else:
            sends: list[list[Tensor]] = [[] for _ in range(S)]
            for m in in_replica:
                sends[m.owner % S].append(piece(m))
            received = self.members.all_to_all(sends, [sum(self._numel(m, j) for m in owned) for j in range(S)], like)
            results = {}
            offsets = [0] * S
            for m in owned:
                full = like.new_empty(self.params[m.entry].shape[-2:])
                for j in range(S):
                    (row, col), (rows, cols) = self.boxes[m.entry][j]
                    n = rows * cols
                    full[row : row + rows, col : col + cols] = received[j][offsets[j] : offsets[j] + n].view(rows, cols)
                    offsets[j] += n
                results[m] = newton_schulz(m.entry, full)
            replies: list[list[Tensor]] = [[] for _ in range(S)]
            for m in owned:
                for j in range(S):
                    (row, col), (rows, cols) = self.boxes[m.entry][j]
                    replies[j].append(results[m][row : row + rows, col : col + cols])
            expected = [0] * S
            for m in in_replica:
                expected[m.owner % S] += self._numel(m, me)
            back = self.members.all_to_all(replies, expected, like)
            results, offsets = {}, [0] * S
            for m in in_replica:
                j, n = m.owner % S, self._numel(m, me)
                results[m] = back[j][offsets[j] : offsets[j] + n].view(self.boxes[m.entry][me][1])
                offsets[j] += n

        if self.replicas.size > 1:
            results = self._share_with_replicas(live, results, like)
        return self._assemble(updates, results)

    def _share_with_replicas(self, live: list[Matrix], results: dict[Matrix, Tensor], like: Tensor) -> dict:
        S, R, me, replica = self.members.size, self.replicas.size, self.members.index, self.replicas.index
        ours = [results[m] for m in live if m.owner // S == replica]
        expected = [0] * R
        for m in live:
            expected[m.owner // S] += self._numel(m, me)
        received = self.replicas.all_to_all([ours] * R, expected, like)
        offsets = [0] * R
        for m in live:
            k, n = m.owner // S, self._numel(m, me)
            if k != replica:
                results[m] = received[k][offsets[k] : offsets[k] + n].view(self.boxes[m.entry][me][1])
            offsets[k] += n
        return results

    def _assemble(self, updates: list[Tensor | None], results: dict[Matrix, Tensor]) -> list[Tensor | None]:
        out: list[Tensor | None] = [None] * len(updates)
        by_entry: dict[int, list[Matrix]] = {}
        for m in results:
            by_entry.setdefault(m.entry, []).append(m)
        for e, matrices in by_entry.items():
            if self.params[e].ndim == 2:
                out[e] = results[matrices[0]]
            else:
                matrices.sort(key=lambda m: m.expert)
                out[e] = torch.stack([results[m] for m in matrices])
        for e, update in enumerate(updates):
            if update is not None and out[e] is None:  # a 3-D parameter with no local experts
                out[e] = update.new_empty(update.shape)
        return out


def build_buckets(params: list[Tensor]) -> list[Bucket]:
    """Buckets in the order their first parameter appears, so every rank issues the collectives in the same order."""
    keyed: dict[tuple, list[Tensor]] = {}
    for param in params:
        if isinstance(param, DTensor):
            matrix_dims, replica_dims = mesh_roles(param)
            mesh = param.device_mesh.mesh
            key: tuple = ("dtensor", tuple(mesh.flatten().tolist()), tuple(mesh.shape), matrix_dims, replica_dims)
        else:
            key = ("local",)
        keyed.setdefault(key, []).append(param)
    buckets: list[Bucket] = []
    for members in keyed.values():
        buckets.append(Bucket(members, sum(b.cost for b in buckets)))
    return buckets

