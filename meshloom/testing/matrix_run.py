"""Running the pairwise matrix's cells (meshloom/testing/matrix.py) in as few launches as their rank counts allow.

- Synchronous cells, their one-process references, and the stops and resumes of the kill and relayout cells run as
  resume_parity cases: one launch of forked ranks per world size, every case of that size in turn, in order.
- Replica-group cells (`ft` on) run two groups side by side, each its own launch of forked ranks with its own
  rendezvous, both going through the same cells in the same order; every cell (and each phase of a cell that stops
  and resumes) gets its own Lighthouse, served from this process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from meshloom.testing import matrix
from meshloom.testing.layout_parity import ParityCase
from meshloom.testing.matrix import GROUPS, OTHER_LAYOUT, STEPS, STOP_AFTER, Cell, cell_id, cell_spec, data_args, ft_args
from meshloom.testing.matrix_checks import KILLED, cell_check
from meshloom.testing.resume_parity import Case, CaseResult, launch, launch_killed
from meshloom.testing.semi_sync_reference import EmulatedCase, EmulatedResult
from meshloom.testing.semi_sync_reference import launch as launch_emulated

SEMI_SYNC = ("diloco", "local_sgd")

SAVE = ["--checkpoint.enable", "true", "--checkpoint.interval", str(STOP_AFTER)]
RESUME = [*SAVE, "--checkpoint.resume", "true"]
# A fresh cell's first step waits this long for both groups (they start together, so only the slower start counts).
FT_COMMON = ["--fault_tolerance.start_wait_seconds", "120", "--fault_tolerance.quorum_timeout_seconds", "120"]


@dataclass
class Outcome:
    """What a cell trained: per group (one entry without replica groups) the losses of steps 1..STEPS and the digests
    of the final weights; and the reference's losses."""

    losses: list[list[float]]
    reference: list[float]
    model_digests: list[dict[str, str]] = field(default_factory=list)
    tolerance: float = 0.0
    # DiLoCo and LocalSGD: per group, the losses of the same groups emulated in one process (semi_sync_reference).
    group_references: list[list[float]] = field(default_factory=list)


def reference_spec(cell: Cell) -> str:
    """The cell's settings on one process, reading the whole global batch, eager and without activation
    checkpointing (neither changes what is computed, so the cell is held to the plainest run).

    A streaming cell of several data-parallel ranks is held to pure replication of that degree instead: each rank
    reads and packs its own share of the stream, so the samples of a step follow the data-parallel degree (as they do
    on a cluster), and replication computes what one process would on them (tests/test_parity.py)."""
    plain = {**cell, "ft": "ft_off", "ac": "ac_none", "compile": "eager"}
    dp = ParityCase.parse(cell_spec(plain)).dp
    if cell["data"] == "streaming" and dp > 1:
        return cell_spec(plain, matrix.Value(f"replicate{dp}", (f"dp_replicate={dp}",)))
    return cell_spec(plain, matrix.value("layout", "1proc"))


def _emulated(cell: Cell, workdir: Path, paths: dict[str, str]) -> EmulatedCase:
    """A DiLoCo or LocalSGD cell's groups in one process: one process per group, eager, without activation
    checkpointing, straight through (a kill or a relayout must not change what the groups compute)."""
    plain = {**cell, "ac": "ac_none", "compile": "eager"}
    spec = cell_spec(plain, matrix.value("layout", "1proc"))
    group_args = [ft_args(cell["ft"], g, "http://127.0.0.1:1") for g in range(GROUPS)]
    name = f"emulated:{cell_id(cell)}"
    return EmulatedCase(name, str(workdir / name.replace(":", "_")), spec, STEPS, GROUPS, group_args, data_args(cell["data"], paths))


def _phases(cell: Cell, run_dir: Path, extra: list[str]) -> list[Case]:
    """The cases of one training (one group's): straight, or a stop at STOP_AFTER and the resume."""
    name, spec = cell_id(cell), cell_spec(cell)
    if cell["resume"] == "straight":
        return [Case(name, str(run_dir), spec, STEPS, None, extra)]
    after = spec if cell["resume"] == "kill_restart" else cell_spec(cell, OTHER_LAYOUT[cell["layout"]])
    return [
        Case(f"{name}:stop", str(run_dir), spec, STEPS, STOP_AFTER, [*extra, *SAVE], kill=name in KILLED),
        Case(f"{name}:resume", str(run_dir), after, STEPS, None, [*extra, *RESUME]),
    ]


def _joined(results: dict[str, CaseResult], cases: list[Case]) -> tuple[list[float], dict[str, str]]:
    losses = [loss for case in cases for loss in results[case.name].losses]
    final = results[cases[-1].name].final_state
    return losses, {k: v for k, v in final.items() if k.startswith("model.")}


def run_cells(cells: list[Cell], workdir: Path, paths: dict[str, str]) -> dict[str, Outcome]:
    """Train every cell and its reference; `paths` holds the shard folders and the stream file the data values read.
    `workdir/cache` is the data cache every run shares."""
    sync = [c for c in cells if c["ft"] == "ft_off"]
    groups = [c for c in cells if c["ft"] != "ft_off"]
    references: dict[str, Case] = {}
    cases: list[Case] = []
    for cell in cells:
        spec = reference_spec(cell)
        key = f"{spec}|{cell['data']}"
        if key not in references:
            references[key] = Case(f"ref{len(references)}", str(workdir / f"ref{len(references)}"), spec, STEPS, None, data_args(cell["data"], paths))
    for cell in sync:
        cases += _phases(cell, workdir / cell_id(cell), data_args(cell["data"], paths))
    # A killed stop ends its launch: each runs alone, before the launches that hold its restart.
    killed = [case for case in cases if case.kill]
    halves = [(killed[i::2], _sharing_the_cache(workdir / f"killed{i}", workdir)) for i in range(2)]
    results = {k: v for part in _side_by_side(halves, _launch_each_killed) for k, v in part.items()}
    results.update(_launch_on_both_cores(list(references.values()) + [c for c in cases if not c.kill], workdir))
    emulated_cases = [_emulated(c, workdir, paths) for c in groups if c["ft"] in SEMI_SYNC]
    emulated: dict[str, EmulatedResult] = {}
    emulation = threading.Thread(target=lambda: emulated.update(launch_emulated(emulated_cases, _sharing_the_cache(workdir / "emulated", workdir))))
    emulation.start()
    try:
        group_results = _run_groups(groups, workdir, paths)
    finally:
        emulation.join()
    if len(emulated) != len(emulated_cases):
        raise RuntimeError("the emulation of the semi-synchronous cells failed (see the output above)")
    outcomes = {}
    for cell in cells:
        reference = results[references[f"{reference_spec(cell)}|{cell['data']}"].name].losses
        tolerance = cell_check(cell).tolerance
        if cell["ft"] == "ft_off":
            losses, digests = _joined(results, _phases(cell, workdir, []))
            outcomes[cell_id(cell)] = Outcome([losses], reference, [digests], tolerance)
        else:
            per_group = [_joined(group_results[g], _phases(cell, workdir, [])) for g in range(GROUPS)]
            outcome = Outcome([p[0] for p in per_group], reference, [p[1] for p in per_group], tolerance)
            if cell["ft"] in SEMI_SYNC:
                outcome.group_references = emulated[f"emulated:{cell_id(cell)}"].losses
            outcomes[cell_id(cell)] = outcome
    return outcomes


def _sharing_the_cache(home: Path, workdir: Path) -> Path:
    """A folder of the matrix's own work folder for another launch, reading the data cache of `workdir`."""
    home.mkdir(exist_ok=True)
    if not (home / "cache").exists():
        (home / "cache").symlink_to(workdir / "cache")
    return home


def _launch_on_both_cores(cases: list[Case], workdir: Path) -> dict[str, CaseResult]:
    """resume_parity.launch, with half of the one-process runs in a second launch beside it: a launch of one rank
    keeps one core busy. A run whose stop and resume take different rank counts stays in the main launch (it runs
    its rank counts in increasing order, so the stop comes first)."""
    runs: dict[str, list[Case]] = {}
    for case in cases:
        runs.setdefault(case.run_dir, []).append(case)
    single = [run for run in runs.values() if all(case.world_size == 1 for case in run)]
    beside = [case for run in single[::2] for case in run]
    main = [case for case in cases if case not in beside]
    beside_results, main_results = _side_by_side([(beside, _sharing_the_cache(workdir / "beside", workdir)), (main, workdir)])
    return {**beside_results, **main_results}


def _launch_each_killed(cases: list[Case], home: Path) -> dict[str, CaseResult]:
    return {case.name: launch_killed(case, home) for case in cases}


def _side_by_side(
    launches: list[tuple[list[Case], Path]], launch: Callable[[list[Case], Path], dict[str, CaseResult]] = launch
) -> list[dict[str, CaseResult]]:
    """`launch` (resume_parity's) of every (cases, work folder) at once, a thread each; the first failure is raised."""
    results: list[dict[str, CaseResult]] = [{} for _ in launches]
    errors: list[BaseException] = []

    def run(index: int, cases: list[Case], home: Path) -> None:
        try:
            results[index] = launch(cases, home)
        except BaseException as err:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(launches)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def _run_groups(cells: list[Cell], workdir: Path, paths: dict[str, str]) -> list[dict[str, CaseResult]]:
    """Both groups of every replica-group cell; returns each group's case results by case name."""
    from torchft._torchft import LighthouseServer

    lighthouses = []
    per_group: list[list[Case]] = [[] for _ in range(GROUPS)]
    for cell in cells:
        run_dir = workdir / cell_id(cell)
        phases = len(_phases(cell, run_dir, []))
        # One Lighthouse per phase: a stopped group's replica id must not meet its own ghost in the next quorum.
        # Every quorum of the cell has both groups: a group that starts (or resumes) late under load would otherwise
        # find the other's sync of DiLoCo or LocalSGD already held without it.
        homes = [LighthouseServer(bind="[::]:0", min_replicas=GROUPS, join_timeout_ms=60_000, heartbeat_timeout_ms=5000) for _ in range(phases)]
        lighthouses += homes
        for group in range(GROUPS):
            for phase, case in enumerate(_phases(cell, run_dir, data_args(cell["data"], paths))):
                case.overrides += [*FT_COMMON, *ft_args(cell["ft"], group, homes[phase].address())]
                per_group[group].append(case)
    try:
        return _side_by_side([(per_group[g], _sharing_the_cache(workdir / f"group{g}", workdir)) for g in range(GROUPS)])
    finally:
        for lighthouse in lighthouses:
            lighthouse.shutdown()
