"""Data pipeline throughput: `meshloom prepare` tokens/s, and the shard loader's tokens/s on one core.

Builds a .jsonl corpus from the standard library, prepares it with the debug run's tokenizer (1 worker
= 1 core, and one worker per core), then times the shard loader in this process with one thread for each sampling mode,
with and without document masks and with two mixed sources. The baseline measured in the same run is
what the trainer consumes: the debug model's train_step tokens/s (batch 8 x seq 256, all cores).
Targets: loader >= 5M tokens/s, and >= 50x the trainer.

The streaming part reads the same corpus as .jsonl, .parquet and .arrow through `data.stream`, tokenizing on the
fly, with 0 and 2 prefetch workers (data.stream_workers), in alternating rounds (median, min, max), against the
debug trainer training on that stream in the same run. Target: >= 10x the trainer.

    .venv/bin/python benchmarks/dataloader.py [--part all|shards|streaming] [--mbytes 8] [--seconds 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path

from meshloom.config.schema import DataConfig
from meshloom.data.prepare import PrepareOptions, prepare

# torch and the trainer are imported inside functions: prepare's worker processes re-import this script,
# and should start as light as they do under `meshloom prepare`.

LOADER_TARGET = 5e6
RATIO_TARGET = 50
STREAM_RATIO_TARGET = 10


def write_corpus(path: Path, mbytes: float) -> int:
    """Standard-library files as json lines, repeated until the corpus has `mbytes` MB of text."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    written = 0
    with open(path, "w") as f:
        while written < mbytes * 1e6:
            for file in files:
                if "site-packages" in file.parts:
                    continue
                try:
                    text = file.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                if not text:
                    continue
                f.write(json.dumps({"text": text}) + "\n")
                written += len(text)
                if written >= mbytes * 1e6:
                    break
    return written


def time_prepare(corpus: Path, out: Path, data: DataConfig, tokenizer, workers: int) -> float:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    meta = prepare(PrepareOptions([str(corpus)], out, workers=workers, progress=False), data, tokenizer)
    return meta["tokens"] / (time.perf_counter() - start)


def time_loader(folders: str, sampling: str, mask: bool, seq_len: int, batch: int, seconds: float) -> float:
    from meshloom.data.shards import build_shard_loaders

    loader, _ = build_shard_loaders(folders, sampling, 0.0, mask, seq_len, batch, 0, 1, 0, lambda s: None)
    loader.next_batch()  # first epoch's permutation and packing
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            loader.next_batch()
        tokens += 20 * batch * seq_len
    return tokens / (time.perf_counter() - start)


def trainer_tokens_per_second(dataset: list[str], data: DataConfig, steps: int) -> float:
    """The debug trainer's tokens/s on `dataset` (e.g. ["--data.dataset", "shards", "--data.shards", FOLDER])."""
    from meshloom.config import load_config
    from meshloom.train.trainer import Trainer

    trainer = Trainer(load_config([
        "--config", "configs/llama3_debug.toml", "--training.steps", str(steps + 2), *dataset, "--data.cache_dir", data.cache_dir,
        "--validation.enable", "false", "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
        "--metrics.peak_tflops", "1", "--job.dump_folder", tempfile.mkdtemp(prefix="meshloom-dataloader-run-"),
    ]))
    for _ in range(2):  # warm-up
        trainer.train_step()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    return trainer.tokens_per_step * steps / (time.perf_counter() - start)


def write_stream_formats(corpus: Path, workdir: Path) -> dict[str, str]:
    """The corpus as json lines (itself), Parquet and Arrow (IPC stream) files, for `data.stream`."""
    import pyarrow as pa
    import pyarrow.json as pa_json
    import pyarrow.parquet as pq

    table = pa_json.read_json(corpus).select(["text"])
    pq.write_table(table, workdir / "corpus.parquet")
    with pa.OSFile(str(workdir / "corpus.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=1000)
    return {"jsonl": str(corpus), "parquet": str(workdir / "corpus.parquet"), "arrow": str(workdir / "corpus.arrow")}


def time_streams(specs: dict[str, str], tokenizer, workers: list[int], seconds: float, rounds: int) -> dict[str, list[float]]:
    """tokens/s of the streaming loader (batch 8 x seq 256) per (format, workers), in alternating rounds."""
    from meshloom.data.streaming import StreamingLoader

    loaders = {}
    for kind, spec in specs.items():
        for n in workers:
            loader = StreamingLoader(spec, tokenizer, 256, 8, 0, 1, workers=n)
            loader.next_batch()  # opens the files; the reader and its workers start
            loaders[f"{kind}, {n} worker(s)"] = loader
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    for _ in range(rounds):
        for name, loader in loaders.items():
            tokens, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                loader.next_batch()
                tokens += 8 * 256
            rates[name].append(tokens / (time.perf_counter() - start))
    return rates


def streaming_main(args, data: DataConfig, tokenizer, corpus: Path) -> None:
    import statistics

    specs = write_stream_formats(corpus, args.workdir)
    print(f"load average before: {os.getloadavg()}")
    trainer_rate = trainer_tokens_per_second(["--data.dataset", "streaming", "--data.stream", str(corpus)], data, args.trainer_steps)
    print(f"trainer consumption (debug model on the stream, batch 8 x seq 256, fp32): {trainer_rate:,.0f} tokens/s")
    rates = time_streams(specs, tokenizer, [0, 2], args.seconds, args.rounds)
    print(f"\n{'streaming (data.stream_workers)':<34} {'median tok/s':>13} {'min':>11} {'max':>11} {'x trainer':>10}  target")
    worst = float("inf")
    for name, values in rates.items():
        median = statistics.median(values)
        worst = min(worst, median)
        ok = median >= STREAM_RATIO_TARGET * trainer_rate
        print(f"{name:<34} {median:13,.0f} {min(values):11,.0f} {max(values):11,.0f} {median / trainer_rate:10,.1f}  "
              f"{'ok' if ok else 'BELOW'}")
    print(f"\nraw rounds (tokens/s): {json.dumps({k: [round(v) for v in vs] for k, vs in rates.items()})}")
    print(f"slowest streaming case: {worst / trainer_rate:,.1f}x the trainer (target >= {STREAM_RATIO_TARGET}x); "
          f"load average after: {os.getloadavg()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mbytes", type=float, default=8.0, help="corpus size in MB of text")
    parser.add_argument("--seconds", type=float, default=2.0, help="time per loader measurement")
    parser.add_argument("--trainer-steps", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/meshloom-dataloader"))
    parser.add_argument("--part", choices=["all", "shards", "streaming"], default="all")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of the streaming cases")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    # One core per tokenizing process, so "N workers" means N cores (tokenizers would otherwise use them all).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"

    import torch

    from meshloom.data.build import run_tokenizer

    data = DataConfig(cache_dir=str(args.workdir / "cache"))  # the debug run's [data] settings
    tokenizer = run_tokenizer(data)
    corpus = args.workdir / "corpus.jsonl"
    text_bytes = write_corpus(corpus, args.mbytes)
    cores = os.cpu_count() or 1
    print(f"corpus: {text_bytes / 1e6:.1f} MB of text; tokenizer {tokenizer.identity} ({tokenizer.vocab_size} ids); {cores} cores")
    if args.part == "streaming":
        streaming_main(args, data, tokenizer, corpus)
        return

    prepare_rates = {w: time_prepare(corpus, args.workdir / f"shards-{w}", data, tokenizer, w) for w in sorted({1, cores})}
    for workers, rate in prepare_rates.items():
        print(f"prepare, {workers} worker(s): {rate:12,.0f} tokens/s")
    folder = args.workdir / f"shards-{cores}"
    other = args.workdir / "shards-1"

    trainer_rate = trainer_tokens_per_second(["--data.dataset", "shards", "--data.shards", str(folder)], data, args.trainer_steps)
    print(f"trainer consumption (debug model, batch 8 x seq 256, fp32): {trainer_rate:,.0f} tokens/s")

    torch.set_num_threads(1)  # the loader on one core
    print(f"\n{'loader (1 core)':<44} {'tokens/s':>14} {'x trainer':>10}  target")
    worst = float("inf")
    cases = [
        ("document", False, 256, str(folder)),
        ("document", True, 256, str(folder)),
        ("chunk", False, 256, str(folder)),
        ("chunk", True, 256, str(folder)),
        ("document", True, 2048, str(folder)),
        ("document", False, 256, f"{folder}:3,{other}:1"),
    ]
    for sampling, mask, seq_len, folders in cases:
        rate = time_loader(folders, sampling, mask, seq_len, 8, args.seconds)
        worst = min(worst, rate)
        label = f"{sampling}, seq {seq_len}{', masks' if mask else ''}{', 2 sources mixed' if ':' in folders else ''}"
        ok = rate >= LOADER_TARGET and rate >= RATIO_TARGET * trainer_rate
        print(f"{label:<44} {rate:14,.0f} {rate / trainer_rate:10,.0f}  {'ok' if ok else 'BELOW'}")
    print(f"\nslowest loader case: {worst / 1e6:.1f}M tokens/s (target >= {LOADER_TARGET / 1e6:.0f}M), "
          f"{worst / trainer_rate:,.0f}x the trainer (target >= {RATIO_TARGET}x)")
    if args.part == "all":
        torch.set_num_threads(cores)
        print()
        streaming_main(args, data, tokenizer, corpus)


if __name__ == "__main__":
    main()
