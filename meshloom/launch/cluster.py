"""A cluster shape (nodes x GPUs per node, optionally elastic) checked against a recipe before anything is written."""

from __future__ import annotations

from dataclasses import dataclass

from meshloom.config.errors import ConfigError, UserError
from meshloom.config.schema import Config
from meshloom.parallel.resize import fixed_ranks
from meshloom.planning.run_plan import RunPlan


@dataclass(frozen=True)
class ClusterShape:
    nodes: int
    gpus_per_node: int
    # Elastic runs: the fewest nodes the job continues on (torchrun --nnodes MIN:MAX); equal to nodes otherwise.
    min_nodes: int

    @property
    def elastic(self) -> bool:
        return self.min_nodes < self.nodes

    @property
    def nnodes(self) -> str:
        """torchrun's --nnodes value."""
        return f"{self.min_nodes}:{self.nodes}" if self.elastic else str(self.nodes)

    def node_counts(self) -> range:
        return range(self.min_nodes, self.nodes + 1)


def check_shape(shape: ClusterShape) -> None:
    if shape.nodes < 1 or shape.gpus_per_node < 1:
        raise UserError(f"--nodes and --gpus-per-node must be positive, got {shape.nodes} and {shape.gpus_per_node}")
    if not 1 <= shape.min_nodes <= shape.nodes:
        raise UserError(f"--min-nodes must lie between 1 and --nodes {shape.nodes}, got {shape.min_nodes}")


def check_tensor_parallel(config: Config, gpus_per_node: int) -> None:
    """Rule: parallelism.tp divides --gpus-per-node, so every tensor-parallel group lies inside one node.

    tp is the innermost mesh dimension and its collectives run in every layer; across nodes they would run on the
    inter-node network instead of NVLink.
    """
    tp = config.parallelism.tp
    if gpus_per_node % tp:
        choices = [d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0]
        raise UserError(
            f"parallelism.tp={tp} does not divide --gpus-per-node {gpus_per_node} (a tensor-parallel group must stay "
            f"inside one node); choose tp from {choices} or nodes with a multiple of {tp} GPUs"
        )


def check_node_count(config: Config, nodes: int, gpus_per_node: int) -> None:
    """The degrees the recipe fixes must fit nodes x gpus_per_node ranks; the message names --nodes and its choices."""
    unit, any_multiple = fixed_ranks(config.parallelism)
    ranks = nodes * gpus_per_node
    if (ranks % unit == 0) if any_multiple else ranks == unit:
        return
    fits = [n for n in range(1, max(nodes, unit) * 2 + 1) if ((n * gpus_per_node) % unit == 0 if any_multiple else n * gpus_per_node == unit)]
    need = f"a multiple of {unit} ranks" if any_multiple else f"exactly {unit} ranks (parallelism.resize = none, dp_shard set)"
    hint = f"choose --nodes from {fits[:6]}" if fits else "change the degrees or --gpus-per-node"
    raise UserError(
        f"--nodes {nodes} x --gpus-per-node {gpus_per_node} = {ranks} ranks do not fit the recipe's layout, which needs "
        f"{need}; {hint}"
    )


def check_cluster(config: Config, shape: ClusterShape, gpu_memory_gib: float | None = None) -> list[RunPlan]:
    """Every check the run's ranks would make, for every node count the job may run on; the plans, fewest nodes
    first. With gpu_memory_gib, the dry run of the fewest nodes (the largest shards) must fit it."""
    check_shape(shape)
    check_tensor_parallel(config, shape.gpus_per_node)
    if shape.elastic and config.parallelism.resize == "none" and config.parallelism.dp_shard != -1:
        raise ConfigError(
            f"--min-nodes {shape.min_nodes} lets the world size change, but parallelism.dp_shard={config.parallelism.dp_shard} "
            "is fixed; set parallelism.resize = dp_shard (or dp_replicate) to say which degree absorbs the change"
        )
    plans = []
    for nodes in shape.node_counts():
        check_node_count(config, nodes, shape.gpus_per_node)
        plans.append(RunPlan.build(config, nodes * shape.gpus_per_node))
    if gpu_memory_gib is not None:
        check_memory(config, shape.min_nodes * shape.gpus_per_node, gpu_memory_gib)
    return plans


def check_memory(config: Config, world_size: int, gpu_memory_gib: float) -> None:
    from meshloom.planning.dry_run import dry_run
    from meshloom.planning.memory_estimate import GIB

    report = dry_run(config, world_size)
    peak = report.memory.peak / GIB
    if peak > gpu_memory_gib:
        raise UserError(
            f"the dry run on {world_size} ranks ({report.layout}) estimates a peak of {peak:.1f} GiB per GPU, more than "
            f"--gpu-memory-gib {gpu_memory_gib:g}; add nodes, raise tp or dp_shard, or enable activation_checkpoint"
        )
