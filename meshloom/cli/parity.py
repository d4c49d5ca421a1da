"""`meshloom parity`: compare parallel layouts' losses with a 1-process reference (meshloom/testing/layout_parity.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from meshloom.cli.numbers import number, positive_int, CommandParser
from meshloom.config.errors import UserError
from meshloom.output import check_output_file, staged_file
from meshloom.testing import layout_parity


# The range of each numeric option (meshloom/cli/numbers.py).
NUMBERS = {
    "--steps": (int, positive_int()),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = CommandParser(prog="meshloom parity", description=layout_parity.__doc__.split("\n\n")[0])
    parser.add_argument("--layout", action="append", required=True, help="e.g. dp_shard=2,tp=2 (repeatable)")
    parser.add_argument("--common", default="", help="settings for the reference and every layout, e.g. model.n_layers=4")
    parser.add_argument("--steps", type=number(NUMBERS, "--steps"), default=10)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="write the loss curves as one PNG")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --plot file")
    args = parser.parse_args(argv)
    _check_steps(args.steps, args.common, args.layout)
    # Both are checked before any training: a user's folder or file is never written into or replaced.
    if args.workdir is not None and args.workdir.exists() and (not args.workdir.is_dir() or any(args.workdir.iterdir())):
        raise UserError(f"parity: --workdir {args.workdir} is not an empty folder; the runs, data cache and curves go there: name a new or empty one")
    if args.plot is not None:
        check_output_file(args.plot, args.overwrite)
    reference, comparisons = layout_parity.compare(args.layout, args.steps, args.workdir, args.common)
    print(f"{'layout':<40} {'ranks':>5} {'max |dloss|':>12} {'|dgrad_norm|':>13} {'tolerance':>10}  result")
    for c in comparisons:
        print(
            f"{c.layout.spec:<40} {c.layout.world_size:>5} {c.max_loss_diff:>12.2e} {c.grad_norm_diff:>13.2e} "
            f"{c.layout.tolerance:>10.0e}  {'ok' if c.ok else 'MISMATCH'}"
        )
    if args.plot:
        with staged_file(args.plot, args.overwrite) as tmp:
            layout_parity.plot(reference, comparisons, tmp)
        print(f"plot: {args.plot}")
    return 0 if all(c.ok for c in comparisons) else 1


def _check_steps(steps: int, common: str, layouts: list[str]) -> None:
    """Every run of the comparison trains --steps steps: fewer than one is refused, and so is a training.steps in
    --common or a --layout, which would silently change it for some runs."""
    if steps < 1:
        raise UserError(f"parity: --steps must be >= 1 (the steps every run trains), got {steps}")
    for flag, spec in [("--common", common), *(("--layout", layout) for layout in layouts)]:
        if "training.steps" in layout_parity.ParityCase.parse(spec).settings:
            raise UserError(f"parity: {flag} {spec!r} sets training.steps; every run trains --steps steps, so pass --steps instead")

