"""Parallel degrees -> one DeviceMesh, and the named sub-meshes every component asks for.

Mesh dimension order, outermost first: pp, dp_replicate, dp_shard, cp, tp. Tensor parallel is innermost
so its heavy collectives stay between neighbouring ranks (inside a node on GPUs).

Expert parallel adds no ranks: it borrows `ep` of the `dp_shard x cp` ranks. Their flattened view (cp inner) is
cut into (efsdp, ep) with ep innermost, so the ranks of one ep group are the closest ones that hold different
data: with tp = 1 they are ep consecutive ranks (one node on GPUs); under tp they sit tp ranks apart. Example,
8 ranks as dp_shard = 8, ep = 2: ep groups {0,1} {2,3} {4,5} {6,7}, efsdp groups {0,2,4,6} {1,3,5,7}. Routed
experts are split over ep and FSDP-sharded over efsdp (plus replicated over dp_replicate: HSDP); dense
parameters keep FSDP over dp_shard x cp. The (dp_replicate, efsdp, ep) view comes from unflattening the
flattened dp_replicate x dp_shard x cp mesh, so it shares the world mesh's root and FSDP can combine the
efsdp mesh with the ep mesh of a DTensor parameter.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshloom.config.errors import ConfigError
from meshloom.config.schema import ParallelismConfig
from meshloom.parallel.resize import resized

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Every degree a run sets, as `parallelism.<name>`; ep borrows its ranks from dp_shard x cp.
DEGREE_NAMES = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")


def check_divisible(degree_name: str, degree: int, sizes: dict[str, int]) -> None:
    """Raise ConfigError unless `degree` divides every model size, naming the first that it does not."""
    for name, size in sizes.items():
        if size % degree:
            divisors = [d for d in range(1, size + 1) if size % d == 0 and d <= 64]
            raise ConfigError(
                f"parallelism.{degree_name}={degree} does not divide the model's {name}={size}; "
                f"choose {degree_name} from {divisors[-6:]}"
            )


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    ep: int
    world_size: int
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, config: ParallelismConfig, world_size: int) -> ParallelDims:
        config = resized(config, world_size)  # parallelism.resize: which degree a changed world size goes to
        others = config.dp_replicate * config.tp * config.pp * config.cp
        dp_shard = config.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"parallelism: dp_replicate x tp x pp x cp = {others} does not divide the world size {world_size}, "
                    f"so dp_shard = -1 cannot be inferred; launch a multiple of {others} ranks or change the degrees"
                )
            dp_shard = world_size // others
        product = others * dp_shard
        if product != world_size:
            if product > world_size:
                hint = f"launch {product} ranks (NPROC={product})"
            elif world_size % others == 0:
                hint = (f"set parallelism.dp_shard = -1 (here {world_size // others}) to use all {world_size} ranks, "
                        f"or launch {product} ranks")  # fmt: skip
            else:
                hint = (f"launch {product} ranks (NPROC={product}); dp_shard = -1 cannot fill {world_size} ranks, as "
                        f"dp_replicate x tp x pp x cp = {others} does not divide {world_size}")  # fmt: skip
            raise ConfigError(
                f"parallelism degrees dp_replicate={config.dp_replicate} x dp_shard={dp_shard} x tp={config.tp} x "
                f"pp={config.pp} x cp={config.cp} = {product}, but the world size is {world_size}; {hint}"
            )
        ep = config.ep
        if ep > 1 and (dp_shard * config.cp) % ep:
            shardable = dp_shard * config.cp
            choices = [d for d in range(1, shardable + 1) if shardable % d == 0]
            raise ConfigError(
                f"parallelism.ep={ep} must divide dp_shard x cp = {dp_shard} x {config.cp} = {shardable} (expert parallel "
                f"borrows its ranks from them); choose ep from {choices[-6:]} or raise dp_shard"
            )
        return cls(config.dp_replicate, dp_shard, config.tp, config.pp, config.cp, ep, world_size)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def efsdp(self) -> int:
        """Ranks that FSDP-shard each routed expert: what dp_shard x cp leaves after ep."""
        return self.dp_shard * self.cp // self.ep

    @property
    def expert_gradient_divide_factor(self) -> int:
        """What expert gradients are divided by: every data-parallel rank's loss reaches an expert through the
        all-to-all, so its gradient is summed over dp_replicate x dp_shard x cp ranks, as dense ones are averaged."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the world mesh plus the flattened views the trainer uses; call once per process group."""
        sizes = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        assert math.prod(sizes) == self.world_size
        world = init_device_mesh(device_type, sizes, mesh_dim_names=MESH_DIMS)
        self._meshes = {name: world[name] for name in MESH_DIMS}
        # Flattened views are kept here: slicing them back off the root mesh is deprecated.
        self._meshes["dp"] = world["dp_replicate", "dp_shard"]._flatten("dp")
        self._meshes["dp_shard_cp"] = world["dp_shard", "cp"]._flatten("dp_shard_cp")
        self._meshes["dp_cp"] = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        if self.dp_replicate == 1:
            self._meshes["fsdp"] = self._meshes["dp_shard_cp"]
        elif self.cp == 1:
            self._meshes["fsdp"] = world["dp_replicate", "dp_shard"]
        else:
            with warnings.catch_warnings():
                # HSDP x CP needs the (replicate, shard x cp) view, only reachable through the root mesh.
                warnings.simplefilter("ignore")
                self._meshes["fsdp"] = world["dp_replicate", "dp_shard_cp"]
        if self.ep > 1:
            # dp_replicate x (efsdp x ep = dp_shard x cp), ep innermost (see the module docstring).
            experts = self._meshes["dp_cp"]._unflatten(0, (self.dp_replicate, self.efsdp, self.ep), ("dp_replicate", "efsdp", "ep"))
            self._meshes["ep"] = experts["ep"]
            self._meshes["efsdp"] = experts["efsdp"]
            self._meshes["expert_fsdp"] = experts["dp_replicate", "efsdp"] if self.dp_replicate > 1 else experts["efsdp"]
        self._meshes["world"] = world
        return world

    def mesh(self, name: str) -> DeviceMesh:
        """Named sub-mesh: pp, dp_replicate, dp_shard, cp, tp, dp, dp_shard_cp, dp_cp (loss), fsdp, world; with ep > 1
        also ep, efsdp and expert_fsdp (the routed experts' FSDP mesh: efsdp, or (dp_replicate, efsdp) for HSDP)."""
        assert self._meshes, "build_mesh() first"
        return self._meshes[name]
