"""`meshloom plan`: rank the layouts of a GPU cluster by estimated step time; write the best as a TOML recipe.

    meshloom plan --flavor 405B --gpus 512 --gpus-per-node 8 --gpu-memory-gib 80 --interconnect nvlink_ib \\
        --seq-len 8192 --global-batch 256 --output layout.toml

The estimates and the search are `meshloom.planning.planner`'s; this is the command line around them.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from meshloom.checkpoint.output import check_output_file, write_output_file
from meshloom.config.errors import UserError
from meshloom.planning.memory_estimate import GIB
from meshloom.planning.planner import INTERCONNECTS, Cluster, format_table, layout_toml, plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshloom plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3", help="model family (model.name), e.g. llama3")
    parser.add_argument("--flavor", required=True, help="the family's flavour, e.g. llama3's 8B, 70B, 405B")
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0)
    parser.add_argument("--interconnect", default="nvlink_ib", choices=sorted(INTERCONNECTS))
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    parser.add_argument("--mfu", type=float, default=0.4, help="share of peak FLOP/s the compute reaches")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 TFLOP/s of one GPU")
    parser.add_argument("--headroom", type=float, default=0.9, help="usable share of GPU memory")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--output", type=Path, help="write the best layout as a TOML recipe here")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    opts = parser.parse_args(argv)
    for name in ("gpus", "gpus_per_node", "seq_len", "global_batch"):
        if getattr(opts, name) <= 0:
            print(f"meshloom: error: --{name.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    if not 0 < opts.mfu <= 1 or not 0 < opts.headroom <= 1:
        print("meshloom: error: --mfu and --headroom must lie in (0, 1]", file=sys.stderr)
        return 2
    cluster = Cluster(opts.gpus, opts.gpus_per_node, opts.gpu_memory_gib, opts.interconnect, opts.peak_tflops, opts.mfu, opts.headroom)
    try:
        if opts.output is not None:
            check_output_file(opts.output, opts.overwrite)
        candidates = plan(opts.flavor, cluster, opts.seq_len, opts.global_batch, model=opts.model)
    except UserError as err:
        print(f"meshloom: error: {err}", file=sys.stderr)
        return 2
    print(f"{opts.model} {opts.flavor} on {opts.gpus} x {opts.gpu_memory_gib:g} GiB ({opts.interconnect}), seq {opts.seq_len}, "
          f"global batch {opts.global_batch}: {len(candidates)} layouts fit; fastest first")
    print(format_table(candidates, opts.top))
    tp_max = math.gcd(opts.gpus, opts.gpus_per_node)
    if tp_max < min(opts.gpus, opts.gpus_per_node):
        print(f"note: every layout uses all {opts.gpus} GPUs, so tensor parallel is limited to degrees dividing both "
              f"{opts.gpus} and --gpus-per-node {opts.gpus_per_node} (at most {tp_max}); a GPU count that divides a node "
              "allows more")
    if opts.output is not None:
        best = candidates[0]
        note = (f"meshloom plan: {best.layout.describe()}, estimated peak {best.memory.peak / GIB:.1f} GiB, "
                f"step {best.step_s:.3f} s on {opts.gpus} GPUs")
        try:
            write_output_file(opts.output, layout_toml(opts.model, opts.flavor, best.layout, opts.seq_len, note), opts.overwrite)
        except UserError as err:
            print(f"meshloom: error: {err}", file=sys.stderr)
            return 2
        print(f"wrote {opts.output}")
    return 0
