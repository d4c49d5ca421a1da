"""`meshloom lighthouse`: run torchft's Lighthouse, which keeps the quorum of a fault-tolerant job's replica groups.

    meshloom lighthouse --port 29510 --min-replicas 1
    meshloom train ... --fault_tolerance.enable true --fault_tolerance.lighthouse http://HOST:29510 \\
        --fault_tolerance.replica_id 0 --fault_tolerance.group_size 2     # one torchrun job per replica group

It serves until interrupted (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from meshloom.cli.numbers import count, number, positive_int, CommandParser
from meshloom.config.ranges import Range
from meshloom.planning.checks import EXTRA_HINT, torchft_installed


# The range of each numeric option (meshloom/cli/numbers.py).
NUMBERS = {
    "--port": (int, Range(0, 65535, note="0 picks a free one")),
    "--min-replicas": (int, positive_int()),
    "--join-timeout-ms": (int, count()),
    "--quorum-tick-ms": (int, count()),
    "--heartbeat-timeout-ms": (int, count()),
}


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="meshloom lighthouse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bind", default="[::]", help="address to listen on (default: every interface)")
    parser.add_argument("--port", type=number(NUMBERS, "--port"), default=29510, help="port to listen on; 0 picks a free one (default 29510)")
    parser.add_argument("--min-replicas", type=number(NUMBERS, "--min-replicas"), default=1, help="fewest replica groups a quorum may have (default 1)")
    parser.add_argument(
        "--join-timeout-ms", type=number(NUMBERS, "--join-timeout-ms"), default=60000,
        help="how long a quorum waits for groups that heartbeat but have not asked to join yet (default 60000)",
    )  # fmt: skip
    parser.add_argument("--quorum-tick-ms", type=number(NUMBERS, "--quorum-tick-ms"), default=100, help="how often a quorum is attempted (default 100)")
    parser.add_argument(
        "--heartbeat-timeout-ms", type=number(NUMBERS, "--heartbeat-timeout-ms"), default=5000,
        help="a group silent this long is taken for dead and left out of the next quorum (default 5000)",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torchft_installed():
        print(f"meshloom: error: `meshloom lighthouse` needs torchft, which is not installed; {EXTRA_HINT}", file=sys.stderr)
        return 2
    from torchft._torchft import LighthouseServer

    try:
        server = LighthouseServer(
            bind=f"{args.bind}:{args.port}",
            min_replicas=args.min_replicas,
            join_timeout_ms=args.join_timeout_ms,
            quorum_tick_ms=args.quorum_tick_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        )
    except RuntimeError as err:
        print(f"meshloom: error: cannot start the Lighthouse on {args.bind}:{args.port} ({err}); choose another --port", file=sys.stderr)
        return 2
    print(f"lighthouse: serving at {server.address()} (min_replicas={args.min_replicas})", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    server.shutdown()
    return 0
