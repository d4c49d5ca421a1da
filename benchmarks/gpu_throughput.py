"""Tokens/s, TFLOP/s, MFU and memory (measured, and the dry run's estimate) of every family's GPU modes; writes a
results table. benchmarks/gpu_campaign.sh runs it as part of the one GPU campaign.

    python benchmarks/gpu_throughput.py --out benchmarks/results            # defaults: Llama 3.2 3B on one GPU
    python benchmarks/gpu_throughput.py --device cpu --flavor tiny --seq-len 64 --batch 2 --steps 2 --out /tmp/t

Each mode runs in its own process (fresh allocator, fresh compile state): build the trainer, run --warmup
steps (compilation happens here), then time --steps steps. A mode that runs out of memory is retried once with
half the batch; a mode that fails anyway is reported as failed, and the other modes still run. The `bare_*` modes
are a minimal hand-written training step of the same model in plain PyTorch (the family's nn.Module, bf16 autocast,
fused AdamW, cross-entropy), eager and compiled: the floor for the framework's overhead. Each Trainer mode's memory
estimate comes from `meshloom train --dry-run` with the same settings, run on the host's CPUs beside the GPU work.
With --budget, modes that would start after that many seconds are reported as skipped.

MFU counts model FLOPs (6 N + attention, no recomputation) against the device's dense bf16 peak, for every mode,
Float8 included, so the columns compare directly. Ratios are against the first mode measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

# Run from a clone without installing: the children import meshloom from here.
REPO = Path(__file__).resolve().parents[1]

COMPILE = ["--compile.enable", "true"]
MODES: dict[str, list[str]] = {
    "eager_bf16": [],
    "compile": COMPILE,
    "compile_float8": [*COMPILE, "--float8.enable", "true"],
    "compile_selective_ac": [*COMPILE, "--activation_checkpoint.mode", "selective_op"],
    # The chunked loss (1024-token chunks) against whole logits: compare with "compile".
    "compile_chunked_loss": [*COMPILE, "--loss.chunked", "true"],
    # The same model in a hand-written plain-PyTorch step (see run_bare); not a Trainer run.
    "bare_eager": [],
    "bare_compile": COMPILE,
    # Every MoE family's grouped_mm path in bf16, compiled (4 blocks of the released shapes, to fit one GPU).
    "qwen3_moe_compile": ["--model.name", "qwen3", "--model.flavor", "30B-A3B", "--model.n_layers", "4", *COMPILE],
    "deepseek_v3_compile": ["--model.name", "deepseek_v3", "--model.flavor", "16B", "--model.n_layers", "4", *COMPILE],
    # torchtitan's 8B shape (seq 8192, selective AC, compiled) with 8 of its 32 blocks, for the memory estimate.
    "llama3_8b_8_blocks": [
        "--model.flavor", "8B", "--model.n_layers", "8", "--training.seq_len", "8192", *COMPILE,
        "--activation_checkpoint.mode", "selective_op",
    ],
    # The families' own CUDA paths, each on a model of its own (so their ratios are not against the first mode's):
    # gpt-oss's compiled FlexAttention (windows and sinks; 4 of 20B's 24 blocks), and Qwen3-Next's Gated DeltaNet
    # through flash-linear-attention's kernels on its debug flavour (the [fla] extra; without it the plain-torch rule
    # runs, and the row's model says which; the debug model holds 2,048 positions, the 80B's 4 smallest blocks would
    # not fit AdamW's state in one GPU).
    "gpt_oss_flex_compile": ["--model.name", "gpt_oss", "--model.flavor", "20B", "--model.n_layers", "4", "--compile.enable", "true"],
    "qwen3_next_fla": ["--model.name", "qwen3_next", "--model.flavor", "debug", "--training.seq_len", "2048"],
}
BARE = ("bare_eager", "bare_compile")


def mode_overrides(args: argparse.Namespace, mode: str, batch: int, run_dir: Path) -> list[str]:
    return [
        "--model.flavor", args.flavor,
        "--training.device", args.device,
        "--training.mixed_precision", "bf16",
        "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(batch),
        "--training.steps", str(args.warmup + args.steps),
        "--lr_scheduler.warmup_steps", "2",
        # A small slice of the built-in corpus: tokenizing it is quick and it still holds every step's tokens.
        "--data.max_bytes", str(args.data_bytes),
        "--data.vocab_size", str(args.vocab_size),
        "--validation.enable", "false",
        "--metrics.tensorboard", "false",
        "--metrics.progress_bar", "false",
        "--job.dump_folder", str(run_dir),
    ] + (["--data.cache_dir", args.data_cache] if args.data_cache else []) + MODES[mode]


def run_mode(args: argparse.Namespace, mode: str, batch: int, out: Path) -> dict:
    """In this process: train warmup + steps steps and return the figures."""
    import torch

    from meshloom.config.loader import load_config
    from meshloom.train.trainer import Trainer

    trainer = Trainer(load_config(mode_overrides(args, mode, batch, out / f"run_{mode}")))
    device = trainer.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        trainer.train_step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    losses = [trainer.train_step().loss for _ in range(args.steps)]
    sync()
    elapsed = time.perf_counter() - start
    tokens_per_s = trainer.tokens_per_step * args.steps / elapsed
    tflops = tokens_per_s * trainer.throughput.flops_per_token / 1e12
    peak = trainer.throughput.peak_flops_per_second
    model = trainer.config.model
    fla = " (fla kernels)" if trainer.plan.kernels.fla_ops is not None else ""
    cuda = device.type == "cuda"
    return {
        "mode": mode,
        "status": "ok",
        "model": f"{model.name} {model.flavor}" + (f", {model.n_layers} blocks" if model.n_layers else "")
        + f", seq {trainer.config.training.seq_len}{fla}",
        "batch": batch,
        "tokens_per_s": tokens_per_s,
        "tflops": tflops,
        "mfu": tflops * 1e12 / peak if peak > 0 else None,
        "peak_memory_gib": (torch.cuda.max_memory_allocated(device) if cuda else 0) / 2**30,
        "reserved_gib": (torch.cuda.max_memory_reserved(device) if cuda else 0) / 2**30,
        "alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if cuda else 0,
        "step_s": elapsed / args.steps,
        "final_loss": losses[-1],
        "params": trainer.model.num_params(),
        "kernels": list(trainer.plan.kernels.lines),
    }


def run_bare(args: argparse.Namespace, mode: str, batch: int) -> dict:
    """A minimal hand-written training step of the same model: plain PyTorch, no meshloom Trainer, no data loader
    (random tokens), bf16 autocast over fp32 weights, fused AdamW, torch.compile of the whole model in bare_compile."""
    import torch
    import torch.nn.functional as F

    from meshloom.config.loader import load_config
    from meshloom.models.registry import configured_model_args, get_model_spec
    from meshloom.planning.run_plan import RunPlan

    config = load_config(mode_overrides(args, mode, batch, Path("unused")))
    plan = RunPlan.build(config, 1)
    device = torch.device(args.device)
    spec, model_args = get_model_spec(config.model.name), configured_model_args(config.model)
    torch.manual_seed(0)
    with device:
        model = spec.model_cls(model_args)
        model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    step_model = torch.compile(model) if mode == "bare_compile" else model
    seq, vocab = args.seq_len, args.vocab_size

    def step() -> float:
        tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = step_model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    losses = [step() for _ in range(args.steps)]
    sync()
    elapsed = time.perf_counter() - start
    shape = plan.shape()
    flops_per_token = shape.flops_per_token(seq)
    from meshloom.observe.metrics import peak_flops_per_second

    peak = peak_flops_per_second(device, torch.bfloat16, None)
    tokens_per_s = batch * seq * args.steps / elapsed
    cuda = device.type == "cuda"
    return {
        "mode": mode, "status": "ok", "model": f"{config.model.name} {config.model.flavor}, seq {seq} (plain PyTorch)",
        "batch": batch, "tokens_per_s": tokens_per_s, "tflops": tokens_per_s * flops_per_token / 1e12,
        "mfu": tokens_per_s * flops_per_token / peak if peak > 0 else None,
        "peak_memory_gib": (torch.cuda.max_memory_allocated(device) if cuda else 0) / 2**30,
        "reserved_gib": (torch.cuda.max_memory_reserved(device) if cuda else 0) / 2**30,
        "alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if cuda else 0,
        "step_s": elapsed / args.steps, "final_loss": losses[-1], "params": shape.num_params(), "kernels": [],
    }  # fmt: skip


def dry_run_estimate(args: argparse.Namespace, mode: str, batch: int) -> subprocess.Popen | None:
    """`meshloom train --dry-run` of a Trainer mode, started in the background on the host CPUs (no GPU)."""
    if mode in BARE:
        return None
    cmd = [sys.executable, "-m", "meshloom", "train", "--dry-run", "--world-size", "1",
           *mode_overrides(args, mode, batch, Path("unused"))]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "2",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def read_estimate(proc: subprocess.Popen | None) -> tuple[float | None, str]:
    """(the dry run's peak in GiB, its output); None where it failed or was not run."""
    if proc is None:
        return None, ""
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        return None, "dry run timed out"
    for line in out.splitlines():
        if line.strip().startswith("peak "):
            return float(line.split()[1]), out
    return None, out


def launch_mode(args: argparse.Namespace, argv: list[str], mode: str, out: Path) -> dict:
    """Run one mode in a child process (same command-line settings); on out of memory, halve the batch and retry."""
    batch = args.batch
    while True:
        result_file = out / f"{mode}.json"
        result_file.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, *argv, "--child", mode, "--child-batch", str(batch), "--child-result", str(result_file)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.mode_timeout)
        except subprocess.TimeoutExpired as err:
            (out / f"{mode}.log").write_text(f"{err.stdout or ''}{err.stderr or ''}")
            return {"mode": mode, "status": f"failed: timed out after {args.mode_timeout:.0f} s", "batch": batch}
        log = proc.stdout + proc.stderr
        (out / f"{mode}.log").write_text(log)
        if proc.returncode == 0 and result_file.exists():
            return json.loads(result_file.read_text())
        out_of_memory = "OutOfMemoryError" in log or "out of memory" in log
        if out_of_memory and batch > 1 and batch == args.batch:
            batch //= 2
            print(f"  {mode}: out of memory, retrying with batch {batch}", flush=True)
            continue
        reason = "out of memory" if out_of_memory else (log.strip().splitlines() or ["no output"])[-1][:160]
        return {"mode": mode, "status": f"failed: {reason}", "batch": batch}


def prepare_data(args: argparse.Namespace, out: Path) -> None:
    """Train the tokenizer and tokenize the corpus once, here, so no mode's time includes it."""
    from meshloom.config.loader import load_config
    from meshloom.data.build import build_data

    config = load_config(mode_overrides(args, next(iter(MODES)), args.batch, out / "prepare"))
    build_data(config.data, args.seq_len, args.batch, 0, 1, config.training.seed, with_validation=False)


def environment(args: argparse.Namespace) -> dict:
    import torch

    gpu = torch.cuda.get_device_name(0) if args.device != "cpu" and torch.cuda.is_available() else platform.processor() or "cpu"
    return {
        "date": datetime.date.today().isoformat(),
        "device": gpu,
        "torch": torch.__version__,
        "config": f"batch {args.batch}, bf16, AdamW, "
        f"{args.warmup} warm-up + {args.steps} timed steps",
    }


def results_table(env: dict, results: list[dict]) -> str:
    lines = [
        f"Date: {env['date']}; device: {env['device']}; torch {env['torch']}; {env['config']}",
        "",
        "| mode | model | batch | tokens/s | vs first of its model | TFLOP/s | MFU | max allocated GiB | max reserved GiB "
        "| estimate GiB | estimate / reserved | final loss |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    bases: dict[str, dict] = {}
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['mode']} | | {r['batch']} | {r['status']} | | | | | | | | |")
            continue
        base = bases.setdefault(r["model"].replace(" (plain PyTorch)", ""), r)
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        estimate = r.get("estimate_gib")
        ratio = f"{estimate / r['reserved_gib']:.2f}" if estimate and r.get("reserved_gib") else "-"
        lines.append(
            f"| {r['mode']} | {r['model']} | {r['batch']} | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
            f"{r['tflops']:.3g} | {mfu} | {r['peak_memory_gib']:.1f} | {r.get('reserved_gib', 0):.1f} | "
            f"{'-' if estimate is None else f'{estimate:.1f}'} | {ratio} | {r['final_loss']:.3f} |"
        )
    kernels = sorted({line for r in results for line in r.get("kernels", [])})
    if kernels:
        lines += ["", "Kernels the runs chose (RunPlan.kernels):", *(f"- {line}" for line in kernels)]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="3B")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--data-bytes", type=int, default=3_000_000)
    parser.add_argument("--vocab-size", type=int, default=2048, help="of the built-in tokenizer (at most the model's)")
    parser.add_argument("--data-cache", default="", help="tokenizer/token cache folder (default: ~/.cache/meshloom)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--mode-timeout", type=float, default=None, help="seconds one mode may take (default: no limit)")
    parser.add_argument("--budget", type=float, default=None, help="seconds after which no further mode starts")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for mode in args.modes.split(","):
        if mode not in MODES:
            parser.error(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        if args.child in BARE:
            result = run_bare(args, args.child, args.child_batch)
        else:
            result = run_mode(args, args.child, args.child_batch, args.out)
        args.child_result.write_text(json.dumps(result))
        from meshloom.parallel.distributed import shutdown_and_exit

        shutdown_and_exit(0)
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_throughput: no CUDA device is visible; pass --device cpu to try the script itself on CPU", file=sys.stderr)
        return 2
    env = environment(args)
    print(f"{env['config']} on {env['device']}", flush=True)
    begin = time.perf_counter()
    modes = args.modes.split(",")
    estimates = {mode: dry_run_estimate(args, mode, args.batch) for mode in modes}
    prepare_data(args, args.out)
    results = []
    for mode in modes:
        started = time.perf_counter()
        if args.budget is not None and started - begin > args.budget:
            results.append({"mode": mode, "status": f"skipped: past the {args.budget:.0f} s budget", "batch": args.batch})
        else:
            results.append(launch_mode(args, argv, mode, args.out))
        estimate, output = read_estimate(estimates[mode])
        results[-1]["estimate_gib"] = estimate
        (args.out / f"{mode}.dry_run.txt").write_text(output)
        print(f"  {mode}: {results[-1]['status']} ({time.perf_counter() - started:.0f} s)", flush=True)
        (args.out / "gpu_throughput.json").write_text(json.dumps({"environment": env, "results": results}, indent=1))
    text = results_table(env, results)
    (args.out / "gpu_throughput.md").write_text(text + "\n")
    (args.out / "gpu_throughput.json").write_text(json.dumps({"environment": env, "results": results}, indent=1))
    print(text)
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
