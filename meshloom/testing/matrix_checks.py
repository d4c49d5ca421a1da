"""What each cell of the pairwise matrix proves: its reference, its tolerance and its step count.

tests/test_matrix.py asserts exactly what `cell_check` returns, and docs/compatibility.md prints it for the cell it
cites (the strongest cell of each pair, `strength`), so the table states what the test holds.

- A synchronous cell (its layout, AC, compile, data, optimizer...) must report the losses of one process with its
  settings (eager, without AC) at every step; a streaming cell of several data-parallel ranks, those of pure
  replication of that degree (each rank reads its own share of the stream).
- Replica groups (2 groups, gradients averaged every step): every group, the same one process.
- DiLoCo and LocalSGD (a sync every matrix.SYNC_EVERY steps): every group, the same groups emulated in one process
  with the outer step (meshloom/testing/semi_sync_reference.py), and both groups end with bit-equal weights.
- kill + restart and resume on another layout: the same, over the stop and the resume joined. In the cells of
  KILLED the stop is a real SIGKILL of every rank right after the step-2 checkpoint is committed; in the others
  the run leaves its loop at that point.

Every reference must itself train: its mean loss falls by TRAINS_BY or more over the run.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshloom.testing import matrix
from meshloom.testing.layout_parity import BF16_TOLERANCE, FP32_TOLERANCE, ParityCase
from meshloom.testing.matrix_cells import CELLS

# A reference (the one process, or the emulated groups' mean) must fall by this much over matrix.STEPS steps: a run
# that does not train cannot pass as a reference. Measured falls of the replica-group cells (2026-12-04): 0.10 to 2.3.
TRAINS_BY = 0.05

# Float8 cells: a bound per cell, 2x the Float8 spread that benchmarks/float8_spread.py measured on the cell's own
# reference settings (the same run with its batch cut into 2 and 4 microbatches: each takes its own scales, as each
# data-parallel rank does), rounded up to 1 significant digit. Measured 2026-12-04 (spreads 2.6e-4 to 1.4e-3), raw
# output in FLOAT8_SPREAD; tests/test_matrix.py holds these bounds to that file. A cell of several ranks adds the
# parity harness's bf16 bound (BF16_TOLERANCE, layout_parity.py): its ranks compute in bf16 by another path than the
# one process's autocast (FSDP's cast parameters, sharded matmuls), which the cut runs do not see; measured on the
# matrix (2026-12-04), FSDP 2 1.65e-3, CP 2 2.57e-3 and FSDP 2 x TP 2 2.39e-3 above the one process, all beyond 2x
# their spread.
FLOAT8_SPREAD = "benchmarks/results/2026-12-04/float8_spread.json"
FLOAT8_SPREAD_BOUND: dict[str, float] = {
    "deepseek_v3-pp-ac_none-eager-float8-muon_qk_clip-shards-causal-ft_off-resume_other_layout": 0.0007,
    "qwen3-hsdp-ac_none-eager-float8-muon-streaming-document_mask-ft_off-straight": 0.0006,
    "llama3-fsdp-ac_selective-eager-float8-muon_qk_clip-builtin-causal-ft_off-straight": 0.0006,
    "gpt_oss-cp-ac_full-eager-float8-adamw-builtin-causal-ft_off-straight": 0.002,
    "qwen3_moe-1proc-ac_none-eager-float8-adamw-builtin-causal-ft_off-kill_restart": 0.003,
    "qwen3_next-tp-ac_none-eager-float8-adamw-builtin-causal-ft_off-straight": 0.002,
    "qwen3_moe-ep-ac_none-eager-float8-adamw-builtin-causal-ft_off-straight": 0.003,
    "qwen3-fsdp_tp-ac_none-eager-float8-adamw-builtin-causal-ft_off-straight": 0.002,
    "llama3-1proc-ac_none-eager-float8-adamw-builtin-causal-replica_groups-straight": 0.0006,
    "llama3-1proc-ac_none-eager-float8-adamw-builtin-causal-local_sgd-straight": 0.0006,
    "qwen3_moe-1proc-ac_none-compile-float8-adamw-builtin-causal-ft_off-straight": 0.003,
    "qwen3-1proc-ac_none-eager-float8-adamw-builtin-causal-diloco-straight": 0.002,
}

# The matrix's layouts by class; at least one kill + restart cell of each class is killed for real.
LAYOUT_CLASSES: dict[str, tuple[str, ...]] = {
    "one process": ("1proc",),
    "data-parallel sharding": ("fsdp", "hsdp", "ep"),
    "model parallel": ("tp", "pp", "cp", "fsdp_tp"),
}


def layout_class(cell: dict[str, str]) -> str:
    return next(name for name, layouts in LAYOUT_CLASSES.items() if cell["layout"] in layouts)


def _killed() -> frozenset[str]:
    """The first synchronous kill + restart cell of each layout class (replica-group cells stop in-process: a killed
    group is tests/test_replica_groups.py::test_killed_group_rejoins_from_the_live_group_and_ends_bitwise_equal)."""
    chosen: dict[str, str] = {}
    for cell in CELLS:
        if cell["resume"] == "kill_restart" and cell["ft"] == "ft_off":
            chosen.setdefault(layout_class(cell), matrix.cell_id(cell))
    return frozenset(chosen.values())


KILLED = _killed()

# The kinds of reference, strongest first: the table cites, for each pair, the cell of the smallest tolerance and
# then of the strongest kind.
REFERENCES = (
    "one process",
    "pure replication",
    "one process, every group",
    "the groups emulated in one process",
)


@dataclass(frozen=True)
class CellCheck:
    reference: str
    """Which run the cell's losses must equal (one of REFERENCES)."""

    tolerance: float
    """Largest |loss - reference loss| allowed at any step."""

    steps: int
    """Steps trained (a stop and its resume: together)."""

    stop: str = ""
    """How a kill or relayout cell stops: "SIGKILL", "in-process" or "" (it runs straight)."""

    extra: tuple[str, ...] = ()
    """Further assertions, and settings the cell changes from the defaults (the table prints them)."""

    @property
    def strength(self) -> tuple[float, int]:
        return (self.tolerance, REFERENCES.index(self.reference))

    def describe(self) -> str:
        stop = {"SIGKILL": "; SIGKILL of every rank after the step-2 checkpoint, then a restart",
                "in-process": "; stopped in-process after the step-2 checkpoint, then resumed", "": ""}[self.stop]  # fmt: skip
        extra = "".join(f"; {e}" for e in self.extra)
        return f"{self.steps} steps, every loss within {self.tolerance:g} of {self.reference}{stop}{extra}"


def float8_tolerance(cell: dict[str, str]) -> float:
    """The Float8 cell's bound: its spread bound, plus the bf16 bound when its layout has several ranks."""
    several_ranks = ParityCase.parse(matrix.cell_spec({**cell, "ft": "ft_off"})).world_size > 1
    return FLOAT8_SPREAD_BOUND[float8_spread_key(cell)] + (BF16_TOLERANCE if several_ranks else 0.0)


def float8_spread_key(cell: dict[str, str]) -> str:
    """The cell's id without its loss axis: the spread was measured with whole logits, and the chunked loss's head is
    left out of Float8 (meshloom/parallel/float8.py), so it changes no Float8 matmul."""
    return "-".join(cell[axis] for axis in matrix.AXES if axis != "loss")


def cell_check(cell: dict[str, str]) -> CellCheck:
    spec = ParityCase.parse(matrix.cell_spec(cell))
    tolerance = float8_tolerance(cell) if cell["float8"] == "float8" else spec.tolerance
    assert cell["float8"] == "float8" or tolerance == FP32_TOLERANCE, (matrix.cell_id(cell), tolerance)
    extra: list[str] = []
    if cell["ft"] in ("diloco", "local_sgd"):
        reference = "the groups emulated in one process"
        extra.append("both groups end with bit-equal weights")
        if cell["family"] in matrix.MOE_FAMILIES:
            extra.append("runs with moe.bias_update_rate=0 (bias balancing is refused with semi-sync groups)")
    elif cell["ft"] == "replica_groups":
        reference = "one process, every group"
    elif cell["data"] == "streaming" and ParityCase.parse(matrix.cell_spec({**cell, "ft": "ft_off"})).dp > 1:
        reference = "pure replication"
    else:
        reference = "one process"
    if cell["resume"] == "straight":
        stop = ""
    else:
        stop = "SIGKILL" if matrix.cell_id(cell) in KILLED else "in-process"
    if cell["resume"] == "resume_other_layout":
        extra.append(f"resumed on {matrix.OTHER_LAYOUT[cell['layout']].name}")
    return CellCheck(reference, tolerance, matrix.STEPS, stop, tuple(extra))
