"""Trainer overhead: meshloom's train_step against a minimal hand-written PyTorch loop.

Same model, weights, batches, dtype and optimizer; the two step functions are timed alternately (so machine
noise hits both alike) and the medians after warm-up are compared. Prints the throughput ratio
meshloom / hand-written (target >= 0.97).

    .venv/bin/python benchmarks/overhead.py [--flavor debug] [--steps 20] [--seq-len 256] [--batch 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from meshloom.config import load_config
from meshloom.train.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()

    trainer = Trainer(load_config([
        "--model.flavor", args.flavor, "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch), "--training.steps", str(10 * args.steps),
        "--validation.enable", "false", "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
        "--metrics.peak_tflops", "1", "--job.dump_folder", "/tmp/meshloom-overhead",
    ]))
    config = trainer.config

    # The hand-written loop: its own copy of the model and a plain AdamW, fed by the same loader.
    torch.manual_seed(config.training.seed)
    model = type(trainer.model)(trainer.model_args)
    model.load_state_dict(trainer.model.state_dict())
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.optimizer.lr, betas=(config.optimizer.beta1, config.optimizer.beta2),
        weight_decay=config.optimizer.weight_decay, foreach=True,
    )
    loader = trainer.data.train

    def hand_step() -> float:
        batch = loader.next_batch()
        logits = model(batch.inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.training.max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def timed(step) -> float:
        start = time.perf_counter()
        step()
        return time.perf_counter() - start

    hand, ours = [], []
    for i in range(args.warmup + args.steps):
        # Alternate which loop goes first so cache and frequency effects do not favour one side.
        if i % 2:
            m, h = timed(trainer.train_step), timed(hand_step)
        else:
            h, m = timed(hand_step), timed(trainer.train_step)
        if i >= args.warmup:
            hand.append(h)
            ours.append(m)
    hand_median, ours_median = statistics.median(hand), statistics.median(ours)
    tokens = args.seq_len * args.batch
    print(f"model {args.flavor}, batch {args.batch} x seq {args.seq_len}, fp32, AdamW, {args.steps} steps after {args.warmup} warm-up")
    print(f"hand-written loop : {hand_median * 1e3:8.1f} ms/step  {tokens / hand_median:10,.0f} tok/s")
    print(f"meshloom trainer  : {ours_median * 1e3:8.1f} ms/step  {tokens / ours_median:10,.0f} tok/s")
    print(f"throughput ratio meshloom / hand-written: {hand_median / ours_median:.3f}  (target >= 0.97)")


if __name__ == "__main__":
    main()
