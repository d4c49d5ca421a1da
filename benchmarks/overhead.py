"""Trainer overhead: meshloom's `Trainer.train_step` against a minimal hand-written PyTorch loop.

The hand-written side has its own plain Llama model, defined below (same shapes and parameter count as the
meshloom flavour, written the straightforward way: torch's RMSNorm, rotate-half RoPE, SDPA with GQA), a plain
AdamW with gradient clipping, and batches taken from the same token stream. So the ratio counts everything
meshloom adds: the trainer loop, the model code (float32 RoPE and norms, explicit kv-head copies) and the loader.

Timing: `--rounds` rounds; in each, both sides run `--steps-per-round` steps back to back, in an order that
alternates from round to round, so load on a shared machine hits both alike. Each round gives one ratio
(hand-written time / meshloom time = meshloom's relative throughput, > 1 means meshloom is faster). Printed:
the minimum, quartiles and median of those ratios by wall time and by process CPU time, and the ratio of each
side's fastest step.

    .venv/bin/python benchmarks/overhead.py [--flavor debug] [--rounds 30] [--steps-per-round 2] [--seq-len 256] [--batch 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshloom.config import load_config
from meshloom.train.trainer import Trainer


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.RMSNorm(dim, eps=eps), nn.RMSNorm(dim, eps=eps)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1
        )
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class PlainLlama(nn.Module):
    """A Llama decoder as one would write it for a single GPU script (fused qkv and gate/up projections)."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, hidden: int, seq_len: int, theta: float, eps: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, hidden, eps) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.head = nn.Linear(dim, vocab, bias=False)
        head_dim = dim // heads
        freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(seq_len).float(), freqs).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, cos, sin)
        return self.head(self.norm(h))


def timed(step: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one step."""
    start, cpu = time.perf_counter(), time.process_time()
    step()
    return time.perf_counter() - start, time.process_time() - cpu


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each side before the rounds")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--data-bytes", type=int, default=0, help="data.max_bytes of the run (0: the whole built-in corpus)")
    parser.add_argument("--vocab-size", type=int, default=0, help="data.vocab_size (0: the recipe's)")
    parser.add_argument("--data-cache", default="", help="data.cache_dir (empty: the default cache)")
    args = parser.parse_args()

    steps = args.warmup + args.rounds * args.steps_per_round
    overrides = [
        "--model.flavor", args.flavor, "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch), "--training.steps", str(steps + 1),
        "--validation.enable", "false", "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
        "--metrics.peak_tflops", "1", "--job.dump_folder", tempfile.mkdtemp(prefix="meshloom-overhead-"),
    ]  # fmt: skip
    if args.data_bytes:
        overrides += ["--data.max_bytes", str(args.data_bytes)]
    if args.vocab_size:
        overrides += ["--data.vocab_size", str(args.vocab_size)]
    if args.data_cache:
        overrides += ["--data.cache_dir", args.data_cache]
    trainer = Trainer(load_config(overrides))
    config, shape = trainer.config, trainer.model_args

    torch.manual_seed(config.training.seed)
    model = PlainLlama(
        shape.vocab_size, shape.dim, shape.n_layers, shape.n_heads, shape.kv_heads, shape.ffn_hidden_dim,
        args.seq_len, shape.rope_theta, shape.norm_eps,
    )
    ours_params = sum(p.numel() for p in trainer.model.parameters())
    hand_params = sum(p.numel() for p in model.parameters())
    assert hand_params == ours_params, f"the plain model has {hand_params} parameters, meshloom's {ours_params}"
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.optimizer.lr, betas=(config.optimizer.beta1, config.optimizer.beta2),
        weight_decay=config.optimizer.weight_decay, foreach=True,
    )
    # The hand-written loop reads a fixed cycle of real batches (its data cost is a tensor index, i.e. nothing).
    batches = [trainer.data.train.next_batch() for _ in range(8)]
    position = 0

    def hand_step() -> float:
        nonlocal position
        batch = batches[position % len(batches)]
        position += 1
        logits = model(batch.inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.training.max_norm, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(args.warmup):
        hand_step()
        trainer.train_step()

    hand_steps, ours_steps, ratios, cpu_ratios = [], [], [], []
    for r in range(args.rounds):
        wall = {"hand": 0.0, "ours": 0.0}
        cpu = {"hand": 0.0, "ours": 0.0}
        # Alternate which side goes first, so cache and frequency effects do not favour one.
        order = [("hand", hand_step), ("ours", trainer.train_step)]
        for name, step in order if r % 2 == 0 else order[::-1]:
            for _ in range(args.steps_per_round):
                t, c = timed(step)
                wall[name] += t
                cpu[name] += c
                (hand_steps if name == "hand" else ours_steps).append(t)
        ratios.append(wall["hand"] / wall["ours"])
        cpu_ratios.append(cpu["hand"] / cpu["ours"])

    tokens = args.seq_len * args.batch
    q1, median, q3 = quartiles(ratios)
    hand_median, ours_median = statistics.median(hand_steps), statistics.median(ours_steps)
    print(
        f"model {args.flavor} ({ours_params:,} parameters), batch {args.batch} x seq {args.seq_len}, fp32, AdamW; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end"
    )
    print(f"{args.rounds} rounds x {args.steps_per_round} steps per side after {args.warmup} warm-up steps each")
    print(f"hand-written loop : median {hand_median * 1e3:8.1f} ms/step  {tokens / hand_median:10,.0f} tok/s  (fastest {min(hand_steps) * 1e3:.1f} ms)")
    print(f"meshloom trainer  : median {ours_median * 1e3:8.1f} ms/step  {tokens / ours_median:10,.0f} tok/s  (fastest {min(ours_steps) * 1e3:.1f} ms)")
    print("throughput ratio meshloom / hand-written, per round:")
    print(f"  min {min(ratios):.3f}  q1 {q1:.3f}  median {median:.3f}  q3 {q3:.3f}  max {max(ratios):.3f}  (IQR {q3 - q1:.3f})")
    print(f"  fastest step vs fastest step: {min(hand_steps) / min(ours_steps):.3f}")
    # CPU time is less moved by other jobs than wall time (though not immune: threads wait and caches are shared).
    c1, cmedian, c3 = quartiles(cpu_ratios)
    print(f"same ratio by process CPU time: min {min(cpu_ratios):.3f}  q1 {c1:.3f}  median {cmedian:.3f}  q3 {c3:.3f}  max {max(cpu_ratios):.3f}")
    print("per-round ratios: " + " ".join(f"{x:.3f}" for x in ratios))


if __name__ == "__main__":
    main()
