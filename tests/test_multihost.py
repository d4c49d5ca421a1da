"""Two "hosts" on one machine: two Linux network namespaces joined by a veth pair, with addresses this test
creates. Each runs `torchrun --nnodes 2 --rdzv-backend c10d` with one rank and trains 5 FSDP steps over gloo.
A namespace has only its loopback and its end of the veth, so every byte between the hosts (rendezvous store
and gloo) crosses the veth. Without the rights to create namespaces the test is skipped, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshloom.config.loader import load_config
from meshloom.testing.layout_parity import Layout, base_overrides
from meshloom.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
STEPS = 5
PORT = 29531


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def hosts() -> Iterator[list[tuple[str, str, str]]]:
    """[(namespace, interface, address)] for two hosts, removed afterwards."""
    tag = os.getpid() % 100_000
    subnet = f"10.231.{tag % 250}"
    made = [(f"mlhost{i}-{tag}", f"mlv{i}-{tag}", f"{subnet}.{i + 1}") for i in range(2)]
    if shutil.which("ip") is None:
        pytest.skip("network namespaces: the `ip` command (iproute2) is not installed")
    try:
        for ns, _, _ in made:
            _ip("netns", "add", ns)
    except subprocess.CalledProcessError as err:
        for ns, _, _ in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        reason = f"network namespaces cannot be created here (`ip netns add` said: {err.stderr.strip()})"
        print(reason)
        pytest.skip(reason)
    try:
        (ns0, if0, _), (ns1, if1, _) = made
        _ip("link", "add", if0, "type", "veth", "peer", "name", if1)
        for ns, interface, address in made:
            _ip("link", "set", interface, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", interface)
            _ip("-n", ns, "link", "set", interface, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield made
    finally:
        for ns, _, _ in made:  # deleting a namespace deletes its end of the veth, and with it the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_two_hosts_train_over_gloo_with_c10d_rendezvous(hosts, tmp_path: Path, data_cache: Path) -> None:
    (tmp_path / "cache").symlink_to(data_cache)
    run_dir = tmp_path / "run"
    train = base_overrides(STEPS, tmp_path) + Layout.parse("dp_shard=2").overrides() + ["--metrics.log_freq", "1"]
    head = hosts[0][2]
    procs = []
    for node, (ns, interface, address) in enumerate(hosts):
        env = [
            f"PYTHONPATH={REPO}", "OMP_NUM_THREADS=1", f"GLOO_SOCKET_IFNAME={interface}", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        ]  # fmt: skip
        cmd = [
            "ip", "netns", "exec", ns, "env", *env, sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{head}:{PORT}",
            "--rdzv-id", f"meshloom-{os.getpid()}", "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", address,
            "-m", "meshloom.train", *train, "--job.dump_folder", str(run_dir),
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, f"{out[-2000:]}\n{err[-6000:]}"

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # Two hosts compute what one process computes.
    reference = Trainer(load_config(base_overrides(STEPS, tmp_path) + ["--job.dump_folder", str(tmp_path / "ref")])).train()
    assert max(abs(r["loss"] - ref) for r, ref in zip(rows, reference)) <= 1e-5
