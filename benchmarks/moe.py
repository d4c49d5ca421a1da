"""Mixture-of-experts costs on CPU, as ratios measured within one run.

    PYTHONPATH=. OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/moe.py [--rounds 15] [--parts grouped,dense,ep,balance]

* grouped: the routed experts of debug_moe (16 experts, dim 256, hidden 256, top 4) over one batch's token copies
  (8 x 256 tokens x 4), forward + backward, with one torch._grouped_mm per weight against the loop over experts;
* dense: debug_moe training steps (forward, backward, AdamW) against a dense Qwen3 with the same active parameters
  (debug_moe's shape with a SwiGLU of hidden 4 x 256 = 1024 instead of the experts, untied like debug_moe), tokens/s;
* ep: debug_moe under expert parallel 2 (2 ranks, torchrun, gloo, the trainer): the share of the step spent in the
  token exchange (count exchange, dispatch and combine, forward and backward, waiting included);
* balance: Qwen3 tiny_moe (dim 64, 2 blocks, 8 experts, top 2) trained 200 steps with bias balancing on (rates
  0.001 and 0.01) and off: max / mean expert load of the last step, and the mean over its last 20 steps.

Single-process parts are timed by process CPU time (one thread), the EP part by wall time. Rounds alternate the
order of the two sides (A then B, B then A), so drifting load on a shared machine hits both alike; each round
gives one ratio, reported as median with quartiles and range.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# One process on one thread: its CPU time is what the work costs, whatever else the shared machine runs (wall time
# under load measures the other jobs too). The EP part, two processes waiting on each other, uses wall time.
CLOCK = time.process_time


def spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return f"median {q[1]:.3f} (q1 {q[0]:.3f}, q3 {q[2]:.3f}, min {min(values):.3f}, max {max(values):.3f}, n={len(values)})"


def alternate(a, b, rounds: int, clock=time.perf_counter) -> tuple[list[float], list[float]]:
    """Seconds of a() and b() per round by `clock`, the order switching every round."""
    times_a, times_b = [], []
    for r in range(rounds):
        for name in ("ab" if r % 2 == 0 else "ba"):
            start = clock()
            (a if name == "a" else b)()
            (times_a if name == "a" else times_b).append(clock() - start)
    return times_a, times_b


# ------------------------------------------------------------------------------------------ grouped vs loop


def grouped_vs_loop(rounds: int) -> dict:
    from meshloom.models.common.moe import GroupedExperts
    from meshloom.models.qwen3.flavors import QWEN3_FLAVORS

    moe = QWEN3_FLAVORS["debug_moe"].moe
    torch.manual_seed(0)
    experts = GroupedExperts(256, moe.hidden_dim, moe.n_experts)
    experts.init_weights(0.02, 0.02)
    copies = 8 * 256 * moe.top_k
    choice = torch.randint(0, moe.n_experts, (copies,)).sort().values
    counts = torch.bincount(choice, minlength=moe.n_experts)
    x = torch.randn(copies, 256, requires_grad=True)

    def run(mode: str):
        def step():
            experts.grouped_mm = mode
            experts(x, counts).square().mean().backward()
        return step

    outputs = {}
    for mode in ("on", "off"):
        experts.grouped_mm = mode
        outputs[mode] = experts(x, counts)
    diff = (outputs["on"] - outputs["off"]).abs().max().item()
    run("on")(), run("off")()  # warm-up
    grouped, loop = alternate(run("on"), run("off"), rounds, CLOCK)
    ratios = [b / a for a, b in zip(grouped, loop)]
    return {"grouped_ms": statistics.median(grouped) * 1e3, "loop_ms": statistics.median(loop) * 1e3,
            "loop_over_grouped": ratios, "max_abs_diff": diff}  # fmt: skip


# ------------------------------------------------------------------------------------------ MoE vs dense


def moe_vs_dense(rounds: int, batch: int, seq: int) -> dict:
    from meshloom.models.qwen3.flavors import QWEN3_FLAVORS
    from meshloom.models.qwen3.model import Qwen3

    moe_args = QWEN3_FLAVORS["debug_moe"]
    dense_args = dataclasses.replace(moe_args, moe=None, ffn_hidden_dim=moe_args.moe.hidden_dim * moe_args.moe.top_k)
    models, steps = {}, {}
    tokens = torch.randint(0, moe_args.vocab_size, (batch, seq + 1))
    for name, args in (("moe", moe_args), ("dense", dense_args)):
        torch.manual_seed(0)
        model = Qwen3(args)
        model.init_weights()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, optimizer=optimizer):
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()

        models[name], steps[name] = model, step
        step()  # warm-up
    moe_model = models["moe"]
    active = moe_model.num_params() - sum(
        layer.moe.experts.w1.numel() * 3 * (1 - moe_args.moe.top_k / moe_args.moe.n_experts)
        for layer in moe_model.layers.values()
    )
    moe_times, dense_times = alternate(steps["moe"], steps["dense"], rounds, CLOCK)
    return {
        "moe_params": moe_model.num_params(), "moe_active_params": int(active), "dense_params": models["dense"].num_params(),
        "moe_tokens_per_s": batch * seq / statistics.median(moe_times), "dense_tokens_per_s": batch * seq / statistics.median(dense_times),
        "moe_over_dense_tokens_per_s": [d / m for m, d in zip(moe_times, dense_times)],
    }  # fmt: skip


# ------------------------------------------------------------------------------------------ EP 2 exchange share


def ep_worker(out: Path, steps: int, batch: int, seq: int) -> None:
    """One rank of the EP 2 run: time every exchange and every training step."""
    import meshloom.parallel.expert_parallel as ep
    from meshloom.config.loader import load_config
    from meshloom.parallel.distributed import rank, shutdown_and_exit
    from meshloom.train.trainer import Trainer

    spent = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return wrapper

    ep.all_to_all, ep.plan_dispatch = timed(ep.all_to_all), timed(ep.plan_dispatch)
    trainer = Trainer(load_config([
        "--model.name", "qwen3", "--model.flavor", "debug_moe", "--parallelism.dp_shard", "2", "--parallelism.ep", "2",
        "--training.steps", str(steps), "--training.local_batch_size", str(batch), "--training.seq_len", str(seq),
        "--data.max_bytes", "400000", "--data.vocab_size", "512", "--data.cache_dir", str(out.parent / "cache"),
        "--job.dump_folder", str(out.parent / "ep_run"), "--validation.enable", "false", "--metrics.tensorboard", "false",
        "--metrics.progress_bar", "false", "--metrics.peak_tflops", "1",
    ]))  # fmt: skip
    trainer.train_step()  # warm-up
    shares = []
    for _ in range(steps - 1):
        spent[0] = 0.0
        start = time.perf_counter()
        trainer.train_step()
        shares.append((spent[0], time.perf_counter() - start))
    if rank() == 0:
        out.write_text(json.dumps(shares))
    shutdown_and_exit(0)


def ep_share(steps: int, batch: int, seq: int) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="meshloom-moe-bench-"))
    out = workdir / "ep.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--ep-worker", str(out), "--ep-steps", str(steps), "--batch", str(batch), "--seq", str(seq)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-4000:])
    shares = json.loads(out.read_text())
    return {"exchange_share": [s / t for s, t in shares], "step_s": [t for _, t in shares]}


# ------------------------------------------------------------------------------------------ balancing


def balance(steps: int) -> dict:
    from meshloom.config.loader import load_config
    from meshloom.train.trainer import Trainer

    workdir = Path(tempfile.mkdtemp(prefix="meshloom-moe-balance-"))
    results = {}
    for rate in ("0", "0.001", "0.01"):
        trainer = Trainer(load_config([
            "--model.name", "qwen3", "--model.flavor", "tiny_moe", "--moe.bias_update_rate", rate,
            "--training.steps", str(steps), "--training.local_batch_size", "8", "--training.seq_len", "64",
            "--optimizer.lr", "3e-3", "--data.max_bytes", "400000", "--data.vocab_size", "512",
            "--data.cache_dir", str(workdir / "cache"), "--job.dump_folder", str(workdir / f"rate_{rate}"),
            "--validation.enable", "false", "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
            "--metrics.peak_tflops", "1", "--metrics.log_freq", "1000",
        ]))  # fmt: skip
        loads, losses = [], []
        for _ in range(steps):
            losses.append(trainer.train_step().loss)
            metrics = trainer.moe.metrics()
            loads.append(metrics["moe_load_max"])
        results[rate] = {"last_load_max": loads[-1], "mean_load_max_last_20": statistics.fmean(loads[-20:]),
                         "first_load_max": loads[0], "final_loss": losses[-1]}  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="grouped,dense,ep,balance")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--ep-steps", type=int, default=12)
    parser.add_argument("--balance-steps", type=int, default=200)
    parser.add_argument("--ep-worker", type=Path, default=None)
    args = parser.parse_args()
    if args.ep_worker is not None:
        ep_worker(args.ep_worker, args.ep_steps, args.batch, args.seq)
        return
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start")
    parts = args.parts.split(",")
    if "grouped" in parts:
        r = grouped_vs_loop(args.rounds)
        print(f"grouped matmul vs per-expert loop (debug_moe experts, forward+backward, {8 * 256 * 4} token copies): "
              f"grouped {r['grouped_ms']:.1f} ms, loop {r['loop_ms']:.1f} ms; loop/grouped {spread(r['loop_over_grouped'])}; "
              f"max |difference| {r['max_abs_diff']:.1e}")  # fmt: skip
    if "dense" in parts:
        r = moe_vs_dense(args.rounds, args.batch, args.seq)
        print(f"debug_moe ({r['moe_params']:,} parameters, {r['moe_active_params']:,} active) vs dense ({r['dense_params']:,}), "
              f"batch {args.batch} x seq {args.seq}, training steps: {r['moe_tokens_per_s']:.0f} vs {r['dense_tokens_per_s']:.0f} "
              f"tokens/s; MoE tokens/s over dense {spread(r['moe_over_dense_tokens_per_s'])}")  # fmt: skip
    if "ep" in parts:
        r = ep_share(args.ep_steps, args.batch, args.seq)
        print(f"EP 2 (debug_moe, 2 ranks, batch {args.batch} x seq {args.seq} per rank): share of the step in the token "
              f"exchange {spread(r['exchange_share'])}; step {statistics.median(r['step_s']):.2f} s")  # fmt: skip
    if "balance" in parts:
        r = balance(args.balance_steps)
        for rate, row in r.items():
            print(f"balance rate {rate}: max/mean expert load at step {args.balance_steps} {row['last_load_max']:.3f}, mean of "
                  f"the last 20 steps {row['mean_load_max_last_20']:.3f} (step 1: {row['first_load_max']:.3f}); "
                  f"loss {row['final_loss']:.3f}")  # fmt: skip
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
