"""`meshloom analyze-hang RUN_DIR`: read every rank's Flight Recorder dump and say where the ranks parted.

Ranks call the collectives of a process group in the same order, and Flight Recorder numbers them per group
(`collective_seq_id`). So, per group, the last number each member reached tells who is behind: when some
members entered collective #N and others stopped at #N-1, #N is the collective that diverged and the others
are missing from it. Their dump shows where they are instead (the stack at the time of the dump) and the
last collective they did call. Two ranks at the same number with different ops or sizes are a mismatch
(ranks disagree on what to call). Entry times tell which rank was the last to arrive at a collective: a
late rank. Clocks of different hosts are compared as they are. Point-to-point operations (pipeline sends and
receives) have no group-wide numbering and are left out.

PyTorch's `torchfrtrace` cannot read gloo dumps (their `pg_config` is empty), hence this reader, which takes
group membership from the `groups` that meshloom writes next to the trace (see observe/flight_recorder.py).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from meshloom.cli.numbers import count, number, CommandParser
from meshloom.config.ranges import Range
from meshloom.config.errors import UserError
from meshloom.observe.flight_recorder import FOLDER

_RANK_FILE = re.compile(r"rank-(\d+)\.json")
_ATTEMPT_DIR = re.compile(r"attempt-(\d+)")


@dataclass
class Collective:
    group: str
    seq: int
    op: str
    input_sizes: Any
    dtypes: Any
    entered_ns: int
    frames: list[str]


@dataclass
class Divergence:
    group: str
    group_ranks: list[int]
    collective: Collective  # the first collective that not every member entered
    entered: dict[int, int]  # rank -> entry time (ns)
    missing: list[int]  # members that never entered it
    last_of_missing: dict[int, Collective | None]  # where each missing rank last synchronised in this group


@dataclass
class Mismatch:
    group: str
    seq: int
    calls: dict[int, str]  # rank -> "op sizes"


@dataclass
class Late:
    group: str
    seq: int
    op: str
    rank: int
    seconds: float  # after the first rank entered


@dataclass
class RankState:
    rank: int
    host: str
    reason: str
    steps_completed: int | None
    stack: list[str]


@dataclass
class HangReport:
    folder: str
    world_size: int
    ranks: dict[int, RankState]
    no_dump: list[int]
    divergences: list[Divergence] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    late: Late | None = None

    @property
    def culprits(self) -> list[int]:
        """The ranks the first divergence waits for (else the late rank, else ranks without a dump)."""
        if self.divergences:
            return self.divergences[0].missing
        if self.late:
            return [self.late.rank]
        return self.no_dump


# The range of each numeric option (meshloom/cli/numbers.py).
NUMBERS = {
    "--attempt": (int, count()),
    "--late-seconds": (float, Range(0)),
}


def find_dump_folder(path: Path, attempt: int | None = None) -> Path:
    """A run folder, its flight_recorder/ folder or one attempt folder -> the folder holding rank-*.json."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path} does not exist; pass the run folder (job.dump_folder) of the failed run")
    if not path.is_dir():
        raise UserError(f"{path} is a file; pass the run folder (job.dump_folder) of the failed run")
    if any(_RANK_FILE.fullmatch(p.name) for p in path.glob("rank-*.json")):
        return path
    base = path / FOLDER if (path / FOLDER).is_dir() else path
    attempts = sorted(
        (int(m.group(1)), p) for p in base.glob("attempt-*") if (m := _ATTEMPT_DIR.fullmatch(p.name)) and any(p.glob("rank-*.json"))
    )
    if attempt is not None:
        attempts = [a for a in attempts if a[0] == attempt]
    if not attempts:
        which = f"attempt-{attempt}" if attempt is not None else "any attempt"
        raise UserError(
            f"no Flight Recorder dumps (rank-N.json) for {which} under {path}; they are written to "
            f"<dump_folder>/{FOLDER}/attempt-N/ when a multi-rank run times out, crashes or gets SIGTERM (comm.flight_recorder)"
        )
    return attempts[-1][1]


def load_dumps(folder: Path) -> dict[int, dict[str, Any]]:
    dumps = {}
    for path in sorted(folder.glob("rank-*.json")):
        if match := _RANK_FILE.fullmatch(path.name):
            try:
                dumps[int(match.group(1))] = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise UserError(f"{path} is not a readable dump: {err}") from None
    return dumps


def _entries(dump: dict[str, Any]) -> list[dict[str, Any]]:
    """Every recorded collective of a rank (all its traces: gloo, and NCCL on GPUs)."""
    out = []
    for trace in dump.get("traces", {}).values():
        if isinstance(trace, dict):
            out += [e for e in trace.get("entries", []) if not e.get("is_p2p")]
    return out


def _group_name(entry: dict[str, Any]) -> str:
    group = entry.get("process_group") or [str(entry.get("pg_id", "?"))]
    return str(group[0])


def _frames(entry: dict[str, Any]) -> list[str]:
    return [f'  File "{f.get("filename")}", line {f.get("line")}, in {f.get("name")}' for f in reversed(entry.get("frames") or [])]


def _collective(group: str, entry: dict[str, Any]) -> Collective:
    return Collective(
        group, int(entry["collective_seq_id"]), str(entry.get("profiling_name", "?")), entry.get("input_sizes"),
        entry.get("input_dtypes"), int(entry.get("time_created_ns") or 0), _frames(entry),
    )  # fmt: skip


def analyze(folder: Path, late_seconds: float = 1.0) -> HangReport:
    dumps = load_dumps(folder)
    if not dumps:
        raise UserError(f"no rank-N.json dumps in {folder}")
    world_size = max(int(d.get("world_size", 0)) for d in dumps.values())
    ranks = {
        r: RankState(r, str(d.get("host", "?")), str(d.get("reason", "?")), d.get("steps_completed"), list(d.get("stack", [])))
        for r, d in dumps.items()
    }
    report = HangReport(str(folder), world_size, ranks, [r for r in range(world_size) if r not in dumps])

    members: dict[str, set[int]] = {}
    for d in dumps.values():
        for name, info in d.get("groups", {}).items():
            members.setdefault(str(name), set()).update(int(r) for r in info.get("ranks", []))
    # group -> rank -> seq -> entry
    calls: dict[str, dict[int, dict[int, dict[str, Any]]]] = {}
    for r, d in dumps.items():
        for e in _entries(d):
            calls.setdefault(_group_name(e), {}).setdefault(r, {})[int(e["collective_seq_id"])] = e

    for group, by_rank in sorted(calls.items()):
        group_ranks = sorted(members.get(group) or by_rank)
        dumped = [r for r in group_ranks if r in dumps]
        last = {r: max(by_rank.get(r, {0: None})) for r in dumped}
        front = max(last.values())
        behind = min(last.values())
        if behind < front:
            seq = behind + 1
            entered = {r: by_rank[r][seq] for r in dumped if seq in by_rank.get(r, {})}
            first = min(entered.items(), key=lambda item: item[1].get("time_created_ns") or 0)
            missing = [r for r in dumped if last[r] < seq]
            report.divergences.append(
                Divergence(
                    group, group_ranks, _collective(group, first[1]),
                    {r: int(e.get("time_created_ns") or 0) for r, e in entered.items()}, missing,
                    {r: _collective(group, by_rank[r][last[r]]) if last[r] in by_rank.get(r, {}) else None for r in missing},
                )  # fmt: skip
            )
        for seq in sorted(set.intersection(*(set(by_rank.get(r, {})) for r in dumped)) if dumped else set()):
            seen = {r: f"{by_rank[r][seq].get('profiling_name')} {by_rank[r][seq].get('input_sizes')}" for r in dumped}
            if len(set(seen.values())) > 1:
                report.mismatches.append(Mismatch(group, seq, seen))
            times = {r: by_rank[r][seq].get("time_created_ns") or 0 for r in dumped}
            if len(times) > 1 and min(times.values()) > 0:
                late_rank = max(times, key=times.__getitem__)
                seconds = (times[late_rank] - min(times.values())) / 1e9
                if seconds >= late_seconds and (report.late is None or seconds > report.late.seconds):
                    report.late = Late(group, seq, str(by_rank[late_rank][seq].get("profiling_name")), late_rank, seconds)
    # The hang is the divergence that started first; later ones are its consequences.
    report.divergences.sort(key=lambda d: min(d.entered.values()) if d.entered else 0)
    return report


def _short(stack: list[str], frames: int = 12) -> str:
    lines = "".join(stack).rstrip().splitlines()
    return "\n".join("    " + line for line in lines[-2 * frames :])


def format_report(report: HangReport) -> str:
    out = [f"Flight Recorder dumps in {report.folder}: {len(report.ranks)} of {report.world_size} ranks"]
    if report.no_dump:
        out.append(f"ranks without a dump (killed, or stuck outside Python): {report.no_dump}")
    for r, state in sorted(report.ranks.items()):
        out.append(f"  rank {r} on {state.host}, after step {state.steps_completed}: {state.reason.splitlines()[0] if state.reason else '?'}")
    if not report.divergences and not report.mismatches:
        out.append("Every rank reached the same collective in every process group: no diverged collective.")
    for i, d in enumerate(report.divergences):
        c = d.collective
        title = "Diverged collective" if i == 0 else "Also diverged (probably a consequence)"
        out.append(
            f"{title}: {c.op} #{c.seq} on process group {d.group} (ranks {d.group_ranks}), input sizes {c.input_sizes} {c.dtypes}"
        )
        out.append(f"  entered by ranks {sorted(d.entered)}; missing: rank{'s' if len(d.missing) > 1 else ''} {', '.join(map(str, d.missing))}")
        for r in d.missing:
            last = d.last_of_missing.get(r)
            where = f"{last.op} #{last.seq}" if last else "none recorded"
            out.append(f"  rank {r}: last collective on this group: {where}")
            if r in report.ranks:
                out.append(f"  rank {r} stack at the time of its dump ({report.ranks[r].reason.splitlines()[0]}):")
                out.append(_short(report.ranks[r].stack))
        if c.frames and i == 0:
            out.append(f"  where the other ranks called {c.op}:")
            out.append("\n".join("  " + line for line in c.frames[-12:]))
    for m in report.mismatches:
        out.append(f"Mismatched collective #{m.seq} on process group {m.group}: " + "; ".join(f"rank {r}: {v}" for r, v in sorted(m.calls.items())))
    if report.late:
        late = report.late
        out.append(f"Late rank: rank {late.rank} entered {late.op} #{late.seq} on process group {late.group} {late.seconds:.2f} s after the first rank")
    return "\n".join(out)


def _jsonable(report: HangReport) -> dict[str, Any]:
    data = asdict(report)
    data["culprits"] = report.culprits
    return data


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="meshloom analyze-hang", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="run folder (or its flight_recorder/ or one attempt-N/ folder)")
    parser.add_argument("--attempt", type=number(NUMBERS, "--attempt"), default=None, help="torchrun restart attempt to read (default: the latest)")
    parser.add_argument("--late-seconds", type=number(NUMBERS, "--late-seconds"), default=1.0, help="report a rank that entered a collective this much after the first")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        report = analyze(find_dump_folder(args.run_dir, args.attempt), args.late_seconds)
    except UserError as err:
        print(f"meshloom: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(_jsonable(report), indent=1) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
