"""The pairwise matrix: features combined across eleven axes, every pair of values in at least one cell.

An all-pairs covering array (not the full product, which has 248,832 cells): `CELLS` in matrix_cells.py is what
`generate()` wrote, and tests/test_matrix.py checks that it still covers every pair. Each cell either trains and
matches its reference, or the declaration (meshloom/planning/features.py) refuses it by name, and the test asserts
that line. A pair of values that the declaration refuses (witnessed by a cell of that pair alone) is covered by its
refusal; every other pair must appear in a cell that trains.

What each cell must match (its reference, tolerance and steps, and whether its kill is a real SIGKILL) is stated in
matrix_checks.py, which the test asserts and docs/compatibility.md prints. Every cell runs the parity harness's tiny
run (meshloom.testing.layout_parity.base_overrides) for `STEPS` steps.

`python -m meshloom.testing.matrix` prints a freshly generated cell list for matrix_cells.py.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from meshloom.config.errors import ConfigError, UserError
from meshloom.testing.layout_parity import ParityCase

STEPS = 4
# A kill (a stop right after the checkpoint of this step) and the restart; or the stop before another layout.
STOP_AFTER = 2


@dataclass(frozen=True)
class Value:
    name: str
    """The value's id; for most values also the declared feature it turns on (FEATURE_OF maps the others)."""

    spec: tuple[str, ...] = ()
    """Settings in the parity harness's `key=value` form (bare keys: parallelism, or training.mixed_precision)."""

    cost: float = 1.0
    """Relative price of a cell with it: the generator spends expensive values only where a pair needs them."""


AXES: dict[str, tuple[Value, ...]] = {
    "family": (
        Value("llama3", ("model.name=llama3",)),
        Value("qwen3", ("model.name=qwen3",)),
        Value("qwen3_moe", ("model.name=qwen3", "model.flavor=tiny_moe")),
        Value("deepseek_v3", ("model.name=deepseek_v3",), 1.3),
        Value("gpt_oss", ("model.name=gpt_oss",), 1.3),
        Value("qwen3_next", ("model.name=qwen3_next",), 1.5),
    ),
    "layout": (
        Value("1proc"),
        Value("fsdp", ("dp_shard=2",), 1.2),
        Value("hsdp", ("dp_replicate=2", "dp_shard=2"), 2.0),
        Value("tp", ("tp=2",), 1.2),
        Value("pp", ("pp=2", "pipeline.microbatches=2"), 1.3),
        Value("cp", ("cp=2",), 1.2),
        Value("ep", ("dp_shard=2", "ep=2"), 1.3),
        Value("fsdp_tp", ("dp_shard=2", "tp=2"), 2.0),
    ),
    "ac": (
        Value("ac_none"),
        Value("ac_full", ("activation_checkpoint.mode=full",), 1.05),
        Value("ac_selective", ("activation_checkpoint.mode=selective_op",), 1.05),
    ),
    "compile": (Value("eager"), Value("compile", ("compile.enable=true",), 3.0)),
    # Float8 matmuls on CPU cost about 60 times bf16's (torch 2.13, 2026-12-03: 6.5 s a step of the tiny run against
    # 0.1 s), so its cells train half as many tokens a sequence.
    "float8": (Value("fp32"), Value("float8", ("mixed_precision=bf16", "float8.enable=true", "training.seq_len=32"), 5.0)),
    "optimizer": (
        Value("adamw"),
        Value("muon", ("optimizer.name=Muon",), 1.1),
        Value("muon_qk_clip", ("optimizer.name=Muon", "optimizer.qk_clip_threshold=0.08"), 1.1),
    ),
    "data": (
        Value("builtin"),
        Value("shards", (), 1.1),
        Value("streaming", (), 1.1),
    ),
    "mask": (Value("causal"), Value("document_mask", ("data.document_mask=true",), 1.05)),
    "ft": (
        Value("ft_off"),
        Value("replica_groups", (), 3.0),
        Value("diloco", (), 3.0),
        Value("local_sgd", (), 3.0),
    ),
    "resume": (Value("straight"), Value("kill_restart", (), 1.6), Value("resume_other_layout", (), 1.6)),
    # Chunks of 100 tokens leave a remainder on every layout's microbatch.
    "loss": (Value("whole_loss"), Value("chunked_loss", ("loss.chunked=true", "loss.chunk_tokens=100"))),
}

# Values whose declared features differ from their names (a list: a value may turn on several).
FEATURE_OF: dict[str, tuple[str, ...]] = {
    "1proc": (), "ac_none": (), "eager": (), "fp32": (), "adamw": (), "builtin": (), "causal": (), "ft_off": (),
    "straight": (), "whole_loss": (),
    "hsdp": ("hsdp", "fsdp"), "ep": ("ep", "fsdp"), "fsdp_tp": ("fsdp", "tp"), "muon_qk_clip": ("muon", "qk_clip"),
}  # fmt: skip


Cell = dict[str, str]  # axis -> value name
MOE_FAMILIES = ("qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next")


def value(axis: str, name: str) -> Value:
    (found,) = [v for v in AXES[axis] if v.name == name]
    return found


# The layout a "resume on another layout" cell continues on after the stop under its own: another layout of the same
# data-parallel degree (the streaming reader keeps a position per data-parallel rank; a change of that degree is
# checked at resume, and tested by test_checkpoint_resume), on as many ranks or more (launches run in rank order).
OTHER_LAYOUT: dict[str, Value] = {
    "1proc": value("layout", "tp"), "tp": value("layout", "pp"), "pp": value("layout", "tp"),
    "cp": value("layout", "tp"), "fsdp": value("layout", "fsdp_tp"), "ep": value("layout", "fsdp"),
    "hsdp": Value("fsdp4", ("dp_shard=4",)), "fsdp_tp": Value("hsdp_tp", ("dp_replicate=2", "tp=2")),
}  # fmt: skip


def features_of(name: str) -> tuple[str, ...]:
    return FEATURE_OF.get(name, (name,))


def settings_named(name: str) -> list[str]:
    """Words a refusal line uses for a value: its features' settings and titles, its own settings' names, its name."""
    from meshloom.planning.features import FEATURES

    axis = next(a for a, values in AXES.items() if name in [v.name for v in values])
    words = [w for f in features_of(name) if f in FEATURES for w in (FEATURES[f].setting, FEATURES[f].title)]
    words += [part.rsplit(".", 1)[-1] for item in value(axis, name).spec for part in item.split("=")]
    return [*words, name]


def cell_id(cell: Cell) -> str:
    return "-".join(cell[axis] for axis in AXES)


GLOBAL_BATCH = 8
GROUPS = 2


def cell_spec(cell: Cell, layout: Value | None = None) -> str:
    """The cell's synchronous settings in the parity harness's form (under `layout` instead of its own); replica
    groups share the global batch, so each group's ranks read half as much."""
    values = [layout if axis == "layout" and layout else value(axis, cell[axis]) for axis in AXES]
    spec = ",".join(item for v in values for item in v.spec)
    if cell["ft"] in ("diloco", "local_sgd") and cell["family"] in MOE_FAMILIES:
        spec += ",moe.bias_update_rate=0"  # the declaration refuses semi-sync groups with bias balancing
    if cell["ft"] != "ft_off":
        spec += f",training.local_batch_size={GLOBAL_BATCH // (ParityCase.parse(spec).dp * GROUPS)}"
    return spec.strip(",")


def default_cell(**chosen: str) -> Cell:
    return {axis: chosen.get(axis, values[0].name) for axis, values in AXES.items()}


def plan_refusal(cell: Cell) -> str | None:
    """The declaration's one line for a cell it refuses, else None (RunPlan.build on the cell's settings, and on those
    of the layout a "resume on another layout" cell continues on)."""
    from meshloom.config.loader import load_config
    from meshloom.planning.run_plan import RunPlan
    from meshloom.testing.layout_parity import base_overrides

    layouts = [None, OTHER_LAYOUT[cell["layout"]]] if cell["resume"] == "resume_other_layout" else [None]
    for layout in layouts:
        case = ParityCase.parse(cell_spec(cell, layout))
        argv = [*base_overrides(STEPS, Path("unused")), *case.overrides()]
        argv += data_args(cell["data"], {"shards": "web:1,code:1", "stream": "s.jsonl"})
        argv += ft_args(cell["ft"], replica_id=0, lighthouse="http://127.0.0.1:1")
        try:
            RunPlan.build(load_config(argv), case.world_size)
        except (ConfigError, UserError) as err:
            return str(err)
    return None


# Data values' settings; `paths` holds the shard folders (data.shards) and the stream file the test made.
STAGES = '[{"start_step": 3, "weights": {"web": 1, "code": 3}}]'


def data_args(name: str, paths: dict[str, str]) -> list[str]:
    if name == "shards":
        return ["--data.dataset", "shards", "--data.shards", paths["shards"], "--data.stages", STAGES]
    if name == "streaming":
        return ["--data.dataset", "streaming", "--data.stream", paths["stream"]]
    return []


SYNC_EVERY = 2


def ft_args(name: str, replica_id: int, lighthouse: str) -> list[str]:
    if name == "ft_off":
        return []
    args = ["--fault_tolerance.enable", "true", "--fault_tolerance.replica_id", str(replica_id)]
    args += ["--fault_tolerance.lighthouse", lighthouse, "--fault_tolerance.timeout_seconds", "30"]
    if name != "replica_groups":
        args += ["--fault_tolerance.semi_sync", name, "--fault_tolerance.sync_every", str(SYNC_EVERY)]
        # Semi-synchronous groups meet only at the syncs, without the first quorum's wait for every group: a group
        # slower to start (or to resume) would leave the other to sync alone. Every sync of the cell has both.
        args += ["--fault_tolerance.min_replicas", str(GROUPS)]
    return args


# --------------------------------------------------------------------------- the covering array


def pairs_of(cell: Cell) -> set[tuple[str, str]]:
    """The pairs of values a cell holds (of the axes it has chosen so far), in the axes' order."""
    names = [cell[axis] for axis in AXES if cell.get(axis)]
    return set(itertools.combinations(names, 2))


@cache
def pair_refusal(a: tuple[str, str], b: tuple[str, str]) -> str | None:
    """The declaration's line when it refuses the two values (axis, name) together under every family, the other
    axes at their first values; else None."""
    families = [f.name for f in AXES["family"]] if "family" not in (a[0], b[0]) else [""]
    lines = [plan_refusal(default_cell(**{a[0]: a[1], b[0]: b[1]}, **({"family": f} if f else {}))) for f in families]
    return None if None in lines else lines[0]


def required_pairs() -> set[tuple[str, str]]:
    """Every pair of values of two axes that the declaration does not refuse: a training cell must hold each."""
    out = set()
    for (axis_a, values_a), (axis_b, values_b) in itertools.combinations(AXES.items(), 2):
        for va, vb in itertools.product(values_a, values_b):
            if pair_refusal((axis_a, va.name), (axis_b, vb.name)) is None:
                out.add((va.name, vb.name))
    return out


def refused_pairs() -> dict[tuple[str, str], str]:
    out = {}
    for (axis_a, values_a), (axis_b, values_b) in itertools.combinations(AXES.items(), 2):
        for va, vb in itertools.product(values_a, values_b):
            if (line := pair_refusal((axis_a, va.name), (axis_b, vb.name))) is not None:
                out[(va.name, vb.name)] = line
    return out


def _cost(cell: Cell) -> float:
    total = 1.0
    for axis, name in cell.items():
        total *= value(axis, name).cost
    return total


def generate(seed: int = 2, tries: int = 60, weight: float = 0.5) -> list[Cell]:
    """Greedy all-pairs (AETG-like): each new cell starts from an uncovered pair and fills the other axes with the
    values that cover the most uncovered pairs less `weight` x their cost; a cell the declaration refuses is not kept."""
    rng = random.Random(seed)
    missing = required_pairs()
    cells: list[Cell] = []
    axes = list(AXES)
    while missing:
        best: tuple[float, Cell] | None = None
        for _ in range(tries):
            a, b = sorted(missing)[rng.randrange(len(missing))]
            cell = {axis: "" for axis in axes}
            for axis in axes:
                names = [v.name for v in AXES[axis]]
                if a in names:
                    cell[axis] = a
                if b in names:
                    cell[axis] = b
            order = [axis for axis in axes if not cell[axis]]
            rng.shuffle(order)
            for axis in order:
                scored = []
                for v in AXES[axis]:
                    trial = {**cell, axis: v.name}
                    gain = len(pairs_of(trial) & missing)
                    scored.append((gain - weight * v.cost, rng.random(), v.name))
                cell[axis] = max(scored)[2]
            if plan_refusal(cell) is not None and (cell := _repaired(cell, order)) is None:
                continue
            score = len(pairs_of(cell) & missing) - weight * _cost(cell)
            if best is None or score > best[0]:
                best = (score, cell)
        assert best is not None, "no cell the declaration accepts covers the remaining pairs"
        cells.append(best[1])
        missing -= pairs_of(best[1])
    return cells


def _repaired(cell: Cell, free: list[str]) -> Cell | None:
    """The refused cell with one of its freely chosen values changed so that the declaration accepts it, if any."""
    for axis in free:
        for v in AXES[axis]:
            trial = {**cell, axis: v.name}
            if plan_refusal(trial) is None:
                return trial
    return None


if __name__ == "__main__":
    for c in generate():
        print(f"    {c!r},")
