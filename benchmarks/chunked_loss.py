"""The chunked loss (loss.chunked) against whole logits: time of the output projection + cross-entropy, forward and
backward, at several chunk sizes, measured in the same run as the whole-logits baseline. Also timed: the other way
to chunk, `recompute_<chunk>` (each chunk's projection and loss under activation checkpointing, so backward
recomputes its logits), the design meshloom/parallel/chunked_loss.py explains it does not take.

    PYTHONPATH=. .venv/bin/python benchmarks/chunked_loss.py --out benchmarks/results/2026-12-04
    PYTHONPATH=. python benchmarks/chunked_loss.py --device cuda --dtype bf16 --dim 3072 --tokens 8192 --out DIR

Each round times every method once, in a rotated order (whole logits, then each chunk size), so that slow phases of a
shared machine hit all of them alike; a figure is the median over rounds, and its ratio is to the whole-logits median
of the same run. Before timing, every method's gradients are checked against whole logits'. The peak memory of one
forward and backward is read from torch's memory tracker on CPU (the allocator's peak on CUDA). Writes
chunked_loss_<device>.json and .txt under --out, with the commit and (on CPU) the lscpu flags that matter for matmuls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from meshloom.parallel.chunked_loss import linear_cross_entropy_sum

REPO = Path(__file__).resolve().parents[1]
CPU_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="the weight's and hidden states' dtype")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of one microbatch (batch x sequence)")
    parser.add_argument("--vocabs", default="128256,201088")
    parser.add_argument("--chunks", default="256,512,1024,2048")
    parser.add_argument("--recompute-chunks", default="1024", help="chunk sizes of the recompute-in-backward variant ('' for none)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: torch's default)")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")


def _methods(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunks: list[int], recompute_chunks: list[int]
) -> dict[str, Callable[[], None]]:
    def whole() -> None:
        F.cross_entropy(F.linear(hidden, weight).float(), labels).backward()

    def chunked(chunk: int) -> Callable[[], None]:
        return lambda: (linear_cross_entropy_sum(hidden, weight, labels, chunk) / labels.numel()).backward()

    def recomputed(chunk: int) -> Callable[[], None]:
        def run() -> None:
            total = sum(
                checkpoint(_chunk_loss_sum, hidden[start : start + chunk], weight, labels[start : start + chunk], use_reentrant=False)
                for start in range(0, labels.numel(), chunk)
            )
            (total / labels.numel()).backward()

        return run

    return {
        "whole": whole,
        **{f"chunk_{c}": chunked(c) for c in chunks},
        **{f"recompute_{c}": recomputed(c) for c in recompute_chunks},
    }


def _check_gradients(methods: dict[str, Callable[[], None]], hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """Every method's gradients equal whole logits' (loosely in bf16): a faster method that computes something else
    would not be a comparison."""
    grads = {}
    for name, run in methods.items():
        hidden.grad = weight.grad = None
        run()
        grads[name] = (hidden.grad.float(), weight.grad.float())
    tolerance = 1e-5 if hidden.dtype == torch.float32 else 5e-2
    for name, (grad_hidden, grad_weight) in grads.items():
        for got, want in ((grad_hidden, grads["whole"][0]), (grad_weight, grads["whole"][1])):
            error = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
            assert error <= tolerance, f"{name}: gradient differs from whole logits' by {error:.2e} of its largest entry"


def _peak_bytes(run: Callable[[], None], device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        run()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def measure(args: argparse.Namespace, vocab: int) -> dict[str, dict[str, float]]:
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.dim, device=args.device, dtype=dtype).requires_grad_()
    weight = (torch.randn(vocab, args.dim, device=args.device, dtype=dtype) * args.dim**-0.5).requires_grad_()
    labels = torch.randint(0, vocab, (args.tokens,), device=args.device)
    recompute = [int(c) for c in args.recompute_chunks.split(",") if c]
    methods = _methods(hidden, weight, labels, [int(c) for c in args.chunks.split(",")], recompute)

    def clear() -> None:
        hidden.grad = weight.grad = None

    _check_gradients(methods, hidden, weight)  # and the warm-up: allocator, kernels, thread pools
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for round_index in range(args.rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            clear()
            _sync(args.device)
            start = time.perf_counter()
            methods[name]()
            _sync(args.device)
            times[name].append(time.perf_counter() - start)
    peaks = {}
    for name, run in methods.items():
        clear()
        peaks[name] = _peak_bytes(run, args.device)
    base = statistics.median(times["whole"])
    return {
        name: {
            "median_s": statistics.median(values), "min_s": min(values), "max_s": max(values),
            "ratio_to_whole": statistics.median(values) / base, "peak_bytes": peaks[name],
            "peak_ratio_to_whole": peaks[name] / peaks["whole"],
        }
        for name, values in times.items()
    }  # fmt: skip


def environment(args: argparse.Namespace) -> dict[str, object]:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    env: dict[str, object] = {"commit": commit, "torch": torch.__version__, "threads": torch.get_num_threads()}
    if args.device == "cpu":
        flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n")[0].split()
        env["cpu_flags"] = [flag for flag in CPU_FLAGS if flag in flags]
        model = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")]
        env["cpu"] = model[0].split(":", 1)[1].strip() if model else ""
    else:
        env["gpu"] = torch.cuda.get_device_name()
    return env


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {"environment": environment(args), "settings": {k: str(v) for k, v in vars(args).items()}, "results": {}}
    lines = [f"chunked loss vs whole logits, {args.device} {args.dtype}, dim {args.dim}, {args.tokens} tokens, {args.rounds} rounds"]
    lines.append(json.dumps(report["environment"]))
    for vocab in (int(v) for v in args.vocabs.split(",")):
        results = measure(args, vocab)
        report["results"][str(vocab)] = results
        lines.append(f"vocab {vocab}:")
        for name, row in results.items():
            lines.append(
                f"  {name:<14} {row['median_s']:8.3f} s (min {row['min_s']:.3f}, max {row['max_s']:.3f})"
                f"  x{row['ratio_to_whole']:.3f} of whole   peak {row['peak_bytes'] / 2**20:9.1f} MiB"
                f"  x{row['peak_ratio_to_whole']:.3f}"
            )
        print("\n".join(lines[-len(results) - 1 :]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"chunked_loss_{args.device}"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (args.out / f"{stem}.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
