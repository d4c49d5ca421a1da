"""`meshloom lighthouse`: run torchft's Lighthouse, which keeps the quorum of a fault-tolerant job's replica groups.

    meshloom lighthouse --port 29510 --min-replicas 1
    meshloom train ... --fault_tolerance.enable true --fault_tolerance.lighthouse http://HOST:29510 \\
        --fault_tolerance.replica_id 0 --fault_tolerance.group_size 2     # one torchrun job per replica group

It serves until interrupted (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import argparse
import errno
import signal
import socket
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


def bind_problem(bind: str, port: int) -> str | None:
    """Why the Lighthouse could not listen on bind:port, naming the option at fault, or None. Tried with a socket of
    the address's family (bound, then closed at once), so the address and the port are told apart by the OS's own
    answer: an address this machine does not have is --bind's fault, a port in use or reserved is --port's."""
    if not 0 <= port <= 65535:
        return f"--port must be in 0..65535 (0 picks a free one), got {port}"
    host = bind[1:-1] if bind.startswith("[") and bind.endswith("]") else bind
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as err:
        return f"--bind {bind!r} is not an address of this machine nor a host name that resolves ({err}); give one of its addresses, or [::] for all"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server does: a closed port's TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRNOTAVAIL:
                return f"--bind {bind} is not an address of this machine ({err.strerror}); give one of its addresses, or [::] for all"
            if err.errno == errno.EADDRINUSE:
                return f"--port {port} is already in use on {bind}; choose another --port (0 picks a free one)"
            if err.errno == errno.EACCES:
                return f"--port {port} on {bind} needs privileges this process lacks ({err.strerror}); choose a --port of 1024 or more"
            return f"cannot listen on {bind}:{port} ({err.strerror})"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torchft_installed():
        print(f"meshloom: error: `meshloom lighthouse` needs torchft, which is not installed; {EXTRA_HINT}", file=sys.stderr)
        return 2
    problem = bind_problem(args.bind, args.port)
    if problem:
        print(f"meshloom: error: {problem}", file=sys.stderr)
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
        print(f"meshloom: error: cannot start the Lighthouse on {args.bind}:{args.port} ({err})", file=sys.stderr)
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
