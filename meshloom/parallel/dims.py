"""Parallel degrees -> one DeviceMesh, and the named sub-meshes every component asks for.

Mesh dimension order, outermost first: pp, dp_replicate, dp_shard, cp, tp. Tensor parallel is innermost
so its heavy collectives stay between neighbouring ranks (inside a node on GPUs).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshloom.config.errors import ConfigError
from meshloom.config.schema import ParallelismConfig

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
            hint = (
                f"launch {product} ranks (NPROC={product})"
                if product > world_size
                else f"set parallelism.dp_shard = -1 to use the {world_size // others} ranks left over"
            )
            raise ConfigError(
                f"parallelism degrees dp_replicate={config.dp_replicate} x dp_shard={dp_shard} x tp={config.tp} x "
                f"pp={config.pp} x cp={config.cp} = {product}, but the world size is {world_size}; {hint}"
            )
        return cls(config.dp_replicate, dp_shard, config.tp, config.pp, config.cp, config.ep, world_size)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

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
        self._meshes["world"] = world
        return world

    def mesh(self, name: str) -> DeviceMesh:
        """Named sub-mesh: pp, dp_replicate, dp_shard, cp, tp, dp, dp_shard_cp, dp_cp (loss), fsdp, world."""
        assert self._meshes, "build_mesh() first"
        return self._meshes[name]
