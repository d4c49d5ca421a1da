"""`meshloom plan`: rank the layouts of a GPU cluster by estimated step time; write the best as a TOML recipe.

    meshloom plan --model deepseek_v3 --flavor 671B --gpus 1024 --gpus-per-node 8 --gpu-memory-gib 80 \\
        --seq-len 4096 --global-batch 4096 --output layout.toml

The estimates and the search are `meshloom.planning.planner`'s; this is the command line around them.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

from meshloom.output import check_output_file, write_output_file
from meshloom.config.errors import UserError
from meshloom.planning.layout import AC_MODES
from meshloom.planning.memory_estimate import OPTIMIZERS
from meshloom.planning.plan_report import expert_comm_note, format_table, layout_toml, recipe_note
from meshloom.planning.planner import PLAN_SCHEDULES, SearchSpace, plan
from meshloom.planning.step_time import EXPERT_COMM_MODES, INTERCONNECTS, Cluster


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    chosen = tuple(filter(None, (item.strip() for item in text.split(","))))
    unknown = [item for item in chosen if item not in allowed]
    if unknown or not chosen:
        raise UserError(f"{flag} {text!r}: choose a comma-separated list from {', '.join(allowed)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="meshloom plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3", help="model family (model.name), e.g. llama3, qwen3, deepseek_v3")
    parser.add_argument("--flavor", required=True, help="the family's flavour, e.g. llama3's 8B, 70B, 405B")
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs; the plan uses exactly this many")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0)
    parser.add_argument("--interconnect", default="nvlink_ib", choices=sorted(INTERCONNECTS))
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    parser.add_argument("--mfu", type=float, default=0.4, help="share of peak FLOP/s the compute reaches")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 TFLOP/s of one GPU")
    parser.add_argument("--headroom", type=float, default=0.9, help="usable share of GPU memory")
    parser.add_argument("--expert-comm", default="overlapped", choices=EXPERT_COMM_MODES,
                        help="expert all-to-all hidden behind the expert matmuls up to their time (DeepEP-like), or "
                        "wholly exposed (meshloom's own dispatch)")  # fmt: skip
    parser.add_argument("--ac", default=",".join(AC_MODES), help="activation-checkpointing modes to try")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="optimizers to try (optimizer.name)")
    parser.add_argument("--float8", default="both", choices=("both", "on", "off"), help="whether to try Float8")
    parser.add_argument("--schedules", default=",".join(PLAN_SCHEDULES), help="pipeline schedules to try")
    parser.add_argument("--split-points", default="", help="pipeline.split_points every pipelined layout must use")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--output", type=Path, help="write the best layout as a TOML recipe here")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    opts = parser.parse_args(argv)
    try:
        for name in ("gpus", "gpus_per_node", "seq_len", "global_batch", "top"):
            if getattr(opts, name) <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(opts, name)}")
        if not 0 < opts.mfu <= 1 or not 0 < opts.headroom <= 1:
            raise UserError("--mfu and --headroom must lie in (0, 1]")
        for name in ("peak_tflops", "gpu_memory_gib"):
            if not getattr(opts, name) > 0:  # also refuses nan
                raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(opts, name)}")
        if opts.output is not None:
            check_output_file(opts.output, opts.overwrite)  # before the search
        space = SearchSpace(
            _choices(opts.ac, AC_MODES, "--ac"),
            _choices(opts.optimizers, OPTIMIZERS, "--optimizers"),
            {"both": (False, True), "on": (True,), "off": (False,)}[opts.float8],
            _choices(opts.schedules, PLAN_SCHEDULES, "--schedules"),
            opts.split_points,
        )
        cluster = Cluster(opts.gpus, opts.gpus_per_node, opts.gpu_memory_gib, opts.interconnect, opts.peak_tflops, opts.mfu, opts.headroom,
                          expert_comm=opts.expert_comm)  # fmt: skip
        start = time.perf_counter()
        candidates = plan(opts.flavor, cluster, opts.seq_len, opts.global_batch, model=opts.model, space=space)
    except UserError as err:
        print(f"meshloom: error: {err}", file=sys.stderr)
        return 2
    print(
        f"{opts.model} {opts.flavor} on {opts.gpus} x {opts.gpu_memory_gib:g} GiB ({opts.interconnect}), seq {opts.seq_len}, "
        f"global batch {opts.global_batch}, MFU {opts.mfu:g} of {opts.peak_tflops:g} TFLOP/s: {len(candidates)} layouts fit "
        f"(searched in {time.perf_counter() - start:.1f} s); fastest first"
    )
    print(format_table(candidates, opts.top))
    if any(c.layout.ep > 1 for c in candidates):
        print(expert_comm_note(cluster.expert_comm))
    tp_max = math.gcd(opts.gpus, opts.gpus_per_node)
    if tp_max < min(opts.gpus, opts.gpus_per_node):
        print(f"note: every layout uses all {opts.gpus} GPUs, so tensor parallel is limited to degrees dividing both "
              f"{opts.gpus} and --gpus-per-node {opts.gpus_per_node} (at most {tp_max}); a GPU count that divides a node "
              "allows more")
    if opts.output is not None:
        command = "meshloom plan " + shlex.join(a for a in argv if a != "--overwrite")
        note = recipe_note(candidates[0], opts.gpus, command, cluster.expert_comm)
        # A UserError here (the target became unwritable during the search) is one line from the dispatcher.
        write_output_file(opts.output, layout_toml(opts.model, opts.flavor, candidates[0].layout, opts.seq_len, note), opts.overwrite)
        print(f"wrote {opts.output}")
    return 0
