"""Plot loss vs step from one or more runs' metrics.jsonl into a PNG.

    meshloom report RUN_DIR [RUN_DIR ...] [--out FILE]

Uses matplotlib's object API with the Agg canvas directly, so it never touches pyplot's global
backend state and works on headless machines.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from matplotlib.figure import Figure

from meshloom.output import check_output_file, staged_file
from meshloom.config.errors import UserError

METRICS_FILE = "metrics.jsonl"


def load_curve(run_dir: Path, key: str = "loss") -> tuple[list[int], list[float]]:
    """(steps, values) for `key` from run_dir/metrics.jsonl, sorted by step.

    A resumed run appends to the same file and may re-log steps it already logged before the
    checkpoint it resumed from; the later entry wins, as it belongs to the run that continued.
    Returns empty lists when no line carries `key`.
    """
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise UserError(f"run directory {str(run_dir)!r} does not exist; pass the job.dump_folder of a run")
    if not run_dir.is_dir():
        raise UserError(f"{str(run_dir)!r} is a file, not a run directory; pass the job.dump_folder of a run")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise UserError(
            f"run directory {str(run_dir)!r} has no {METRICS_FILE}; "
            "pass the folder of a run that has logged at least one step"
        )
    by_step: dict[int, float] = {}
    for lineno, record in _records(path):
        if key in record:
            try:
                by_step[int(record["step"])] = float(record[key])
            except (TypeError, ValueError):
                raise UserError(f"{path}:{lineno}: 'step' and {key!r} must be numbers") from None
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def _records(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, row) of every non-empty line of a metrics.jsonl."""
    with open(path, encoding="utf-8", errors="replace") as f:  # a damaged line fails as JSON, with its number
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or "step" not in record:
                raise UserError(f"{path}:{lineno}: expected a JSON object with a 'step' field")
            yield lineno, record


def load_events(run_dir: Path) -> list[dict]:
    """The run's event rows in file order (resume and restart, written by the trainer), each with its step.

    Call after load_curve, which checks the folder and file."""
    return [record for _, record in _records(Path(run_dir) / METRICS_FILE) if "event" in record]


def event_label(event: dict) -> str:
    """The mark's text: the event, and for a quorum change of replica groups the group counts ("quorum 2->1")."""
    if event["event"] == "quorum" and "replicas" in event:
        return f"quorum {event.get('previous', '?')}->{event['replicas']}"
    return str(event["event"])


def describe_event(event: dict) -> str:
    """One line for an event row, e.g. "step 5: resume from .../step-5 (attempt 1)" or "step 6: quorum 2->1"."""
    where = f" from {event['checkpoint']}" if event.get("checkpoint") else ""
    attempt = f" (attempt {event['attempt']})" if event.get("attempt") else ""
    return f"step {event['step']}: {event_label(event)}{where}{attempt}"


def load_mixture(run_dir: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Source name -> (steps, share) from the `data/NAME/share` metrics of a mixed-shards run ({} otherwise)."""
    names = []
    for _, record in _records(Path(run_dir) / METRICS_FILE):
        for key in record:
            if key.startswith("data/") and key.endswith("/share") and key[5:-6] not in names:
                names.append(key[5:-6])
    return {name: load_curve(run_dir, f"data/{name}/share") for name in names}


def _labels(run_dirs: list[Path]) -> list[str]:
    """Run folder names, falling back to full paths when two runs share a name."""
    names = [p.resolve().name for p in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [str(p) for p in run_dirs]


def write_report(run_dirs: list[Path], out: Path | None, overwrite: bool = False) -> Path:
    """Write the loss-vs-step PNG of `loss_figure`.

    Default output: RUN_DIR/loss.png for one run, or loss_comparison.png next to the first run
    directory when comparing several. An existing file is replaced only with `overwrite`.
    """
    run_dirs = [Path(p) for p in run_dirs]
    if not run_dirs:
        raise UserError("no run directories given; pass at least one RUN_DIR")
    if out is None:
        out = run_dirs[0] / "loss.png" if len(run_dirs) == 1 else run_dirs[0].parent / "loss_comparison.png"
    out = Path(out)
    inputs = tuple(("the metrics of " + str(run_dir), Path(run_dir) / METRICS_FILE) for run_dir in run_dirs)
    check_output_file(out, overwrite, inputs)
    fig = loss_figure(run_dirs)
    with staged_file(out, overwrite, inputs) as tmp:
        fig.savefig(tmp, format="png")
    return out


def loss_figure(run_dirs: list[Path]) -> Figure:
    """Loss vs step, one curve per run, validation loss dashed if logged, resumes, restarts and quorum changes as
    dotted vertical lines; with the data mixture over the steps beside it when the runs logged one."""
    run_dirs = [Path(p) for p in run_dirs]
    assert run_dirs, "write_report refuses an empty list"
    curves = []
    for run_dir in run_dirs:
        steps, losses = load_curve(run_dir, "loss")
        if not steps:
            raise UserError(f"run directory {str(run_dir)!r} has no logged 'loss' in {METRICS_FILE}")
        curves.append(((steps, losses), load_curve(run_dir, "val_loss"), load_events(run_dir)))
    mixtures = [load_mixture(run_dir) for run_dir in run_dirs]

    # A run that mixes shard sources gets a second panel: each source's share of the samples over the steps.
    with_mixture = any(mixtures)
    fig = Figure(figsize=(14 if with_mixture else 8, 5), dpi=100)
    ax = fig.add_subplot(1, 2, 1) if with_mixture else fig.add_subplot()
    for label, ((steps, losses), (val_steps, val_losses), events) in zip(_labels(run_dirs), curves):
        (line,) = ax.plot(steps, losses, label=label, linewidth=1.2)
        if val_steps:
            ax.plot(val_steps, val_losses, "--o", color=line.get_color(), markersize=3, label=f"{label} (val)")
        # Where the run continued after a stop (the steps around it may have been trained twice), or where the
        # quorum of replica groups changed.
        for event in events:
            ax.axvline(event["step"], color=line.get_color(), linestyle=":", linewidth=1)
            ax.annotate(event_label(event), (event["step"], 1), xycoords=("data", "axes fraction"), rotation=90,
                        va="top", ha="right", fontsize=7, color=line.get_color())  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    if with_mixture:
        mix_ax = fig.add_subplot(1, 2, 2, sharex=ax)
        for label, mixture in zip(_labels(run_dirs), mixtures):
            for name, (steps, shares) in mixture.items():
                mix_ax.plot(steps, shares, label=f"{label}: {name}" if len(run_dirs) > 1 else name, linewidth=1.2)
        mix_ax.set_xlabel("step")
        mix_ax.set_ylabel("share of samples")
        mix_ax.set_ylim(0, 1)
        mix_ax.set_title("data mixture")
        mix_ax.grid(True, alpha=0.3)
        mix_ax.legend()
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    """CLI entry: returns 0 on success, 2 on a user error (one line on stderr)."""
    parser = argparse.ArgumentParser(prog="meshloom report", description="Plot loss vs step for training runs.")
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run folder containing metrics.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="output PNG path")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing PNG")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.run_dirs, args.out, args.overwrite)
    except UserError as e:
        print(f"meshloom: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. --out in a folder that cannot be written
        print(f"meshloom: error: cannot write {e.filename or args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    for label, run_dir in zip(_labels(args.run_dirs), args.run_dirs):
        for event in load_events(run_dir):
            print(f"{label}: {describe_event(event)}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
