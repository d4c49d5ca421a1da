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
from meshloom.testing.layout_parity import ParityCase, base_overrides
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
    train = base_overrides(STEPS, tmp_path) + ParityCase.parse("dp_shard=2").overrides() + ["--metrics.log_freq", "1"]
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


def _descendants(pid: int) -> list[int]:
    """Every process under `pid` (a host's torchrun agent and the ranks it started), children first."""
    import psutil

    try:
        return [child.pid for child in reversed(psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def test_elastic_run_continues_on_the_host_left_with_the_data_parallel_degree_halved(hosts, tmp_path: Path, data_cache: Path) -> None:
    """Both hosts run `torchrun --nnodes 1:2` as `meshloom launch slurm --min-nodes 1` renders it. Host 1 dies (agent
    and rank) after step 5; host 0's rank fails on the broken collective, its agent restarts it on one node, and it
    continues from the step-4 checkpoint with dp_shard 2 -> 1 (parallelism.resize = dp_shard) to step 8."""
    import signal
    import time

    from meshloom.launch.cluster import ClusterShape
    from meshloom.launch.torchrun import torchrun_args, train_args

    (tmp_path / "cache").symlink_to(data_cache)
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('[model]\nname = "llama3"\n')
    run_dir = tmp_path / "run"
    common = base_overrides(8, tmp_path) + [
        "--training.local_batch_size", "4", "--parallelism.resize", "dp_shard",
        "--checkpoint.enable", "true", "--checkpoint.interval", "2",
    ]  # fmt: skip
    # Rank 1 (host 1) stops inside step 6 of the first attempt, so step 6 never completes and step 4 is the latest
    # checkpoint when the host is killed.
    faults = ["--fault_injection.rank", "1", "--fault_injection.sleep_at_step", "6", "--fault_injection.sleep_seconds", "300"]
    train = train_args(str(recipe), common + faults + ["--metrics.log_freq", "1", "--job.dump_folder", str(run_dir)])
    head = hosts[0][2]
    procs = []
    # After host 1 is lost, host 0's re-rendezvous waits last_call_timeout for a second host before it goes on
    # alone: 10 s, still far more than the two agents, started together, need to reach the first rendezvous.
    for node, (ns, interface, address) in enumerate(hosts):
        env = [f"PYTHONPATH={REPO}", "OMP_NUM_THREADS=1", f"GLOO_SOCKET_IFNAME={interface}", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"]
        rendezvous = [
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{head}:{PORT + 1}", "--rdzv-id", f"elastic-{os.getpid()}",
            "--rdzv-conf", f"is_host={int(node == 0)},last_call_timeout=10", "--local-addr", address,
        ]  # fmt: skip
        args = torchrun_args(ClusterShape(nodes=2, gpus_per_node=1, min_nodes=1), 1, rendezvous, train)
        cmd = ["ip", "netns", "exec", ns, "env", *env, sys.executable, "-m", "torch.distributed.run", *args]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    assert "--nnodes 1:2" in " ".join(args)

    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 400
    while not (metrics.exists() and any(json.loads(l).get("step") == 5 for l in metrics.read_text().splitlines() if l)):
        assert time.monotonic() < deadline and procs[0].poll() is None, "the two hosts did not reach step 5"
        time.sleep(0.5)
    for pid in [procs[1].pid, *_descendants(procs[1].pid)]:  # host 1 is lost: its agent and its rank
        os.kill(pid, signal.SIGKILL)
    out, err = procs[0].communicate(timeout=400)
    procs[1].communicate(timeout=60)
    assert procs[0].returncode == 0, f"{out[-3000:]}\n{err[-6000:]}"

    # The first attempt ran on two hosts, the second on host 0 alone, both printing the rule.
    assert "dp_shard 2 on 2 rank(s)" in out and "one process on 1 rank(s)" in out, out
    assert out.count("resize         dp_shard absorbs a changed world size (dp_replicate 1, tp 1, pp 1, cp 1 kept)") == 2
    assert "resuming from the latest complete checkpoint, step-4" in err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    assert [s for s, _ in losses] == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    continued = dict(losses[5:])

    # One process restarted from a copy of that step-4 checkpoint gives the same steps 5-8.
    ref_dir = tmp_path / "ref"
    shutil.copytree(run_dir / "checkpoint" / "step-4", ref_dir / "checkpoint" / "step-4")
    ref_config = load_config(["--config", str(recipe), *common, "--checkpoint.resume", "true", "--job.dump_folder", str(ref_dir)])
    reference = Trainer(ref_config).train()
    assert len(reference) == 4
    assert max(abs(continued[step] - ref) for step, ref in zip(range(5, 9), reference)) <= 1e-5
