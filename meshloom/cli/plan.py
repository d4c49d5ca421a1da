"""`meshloom plan`: rank the layouts of a GPU cluster by estimated step time; write the best as a TOML recipe.

    meshloom plan --model deepseek_v3 --flavor 671B --gpus 1024 --gpus-per-node 8 --gpu-memory-gib 80 \\
        --seq-len 4096 --global-batch 4096 --output layout.toml

The estimates and the search are `meshloom.planning.planner`'s; this is the command line around them.
"""

from __future__ import annotations

import math
import shlex
import sys
import time
from pathlib import Path

from meshloom.cli.numbers import fraction, number, positive_float, positive_int, CommandParser
from meshloom.output import check_output_file, write_output_file
from meshloom.config.errors import UserError
from meshloom.config.loss import DEFAULT_CHUNK_TOKENS
from meshloom.planning.layout import AC_MODES
from meshloom.planning.memory_estimate import OPTIMIZERS
from meshloom.planning.plan_report import expert_comm_note, format_table, layout_toml, recipe_note
from meshloom.planning.planner import PLAN_SCHEDULES, SearchSpace, plan
from meshloom.planning.step_time import EXPERT_COMM_MODES, INTERCONNECTS, Cluster


# The range of each numeric option (meshloom/cli/numbers.py).
NUMBERS = {
    # Bounds beyond any cluster, so that the search stays short (the planner also refuses a search it cannot finish).
    "--gpus": (int, positive_int(high=2**20)),
    "--gpus-per-node": (int, positive_int(high=1024)),
    "--gpu-memory-gib": (float, positive_float()),
    "--seq-len": (int, positive_int()),
    "--global-batch": (int, positive_int(high=2**20)),
    "--mfu": (float, fraction()),
    "--peak-tflops": (float, positive_float()),
    "--headroom": (float, fraction()),
    "--top": (int, positive_int()),
}


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    chosen = tuple(filter(None, (item.strip() for item in text.split(","))))
    unknown = [item for item in chosen if item not in allowed]
    if unknown or not chosen:
        raise UserError(f"{flag} {text!r}: choose a comma-separated list from {', '.join(allowed)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = CommandParser(prog="meshloom plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3", help="model family (model.name), e.g. llama3, qwen3, deepseek_v3")
    parser.add_argument("--flavor", required=True, help="the family's flavour, e.g. llama3's 8B, 70B, 405B")
    parser.add_argument("--gpus", type=number(NUMBERS, "--gpus"), required=True, help="number of GPUs; the plan uses exactly this many")
    parser.add_argument("--gpus-per-node", type=number(NUMBERS, "--gpus-per-node"), default=8)
    parser.add_argument("--gpu-memory-gib", type=number(NUMBERS, "--gpu-memory-gib"), default=80.0)
    parser.add_argument("--interconnect", default="nvlink_ib", choices=sorted(INTERCONNECTS))
    parser.add_argument("--seq-len", type=number(NUMBERS, "--seq-len"), default=8192)
    parser.add_argument("--global-batch", type=number(NUMBERS, "--global-batch"), required=True, help="sequences per optimizer step")
    parser.add_argument("--mfu", type=number(NUMBERS, "--mfu"), default=0.4, help="share of peak FLOP/s the compute reaches")
    parser.add_argument("--peak-tflops", type=number(NUMBERS, "--peak-tflops"), default=989.0, help="dense bf16 TFLOP/s of one GPU")
    parser.add_argument("--headroom", type=number(NUMBERS, "--headroom"), default=0.9, help="usable share of GPU memory")
    parser.add_argument("--expert-comm", default="overlapped", choices=EXPERT_COMM_MODES,
                        help="expert all-to-all hidden behind the expert matmuls up to their time (DeepEP-like), or "
                        "wholly exposed (meshloom's own dispatch)")  # fmt: skip
    parser.add_argument("--ac", default=",".join(AC_MODES), help="activation-checkpointing modes to try")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="optimizers to try (optimizer.name)")
    parser.add_argument("--float8", default="both", choices=("both", "on", "off"), help="whether to try Float8")
    parser.add_argument("--chunked-loss", default="both", choices=("both", "on", "off"),
                        help=f"whether to try the chunked loss (loss.chunked, {DEFAULT_CHUNK_TOKENS}-token chunks)")
    parser.add_argument("--schedules", default=",".join(PLAN_SCHEDULES), help="pipeline schedules to try")
    parser.add_argument("--split-points", default="", help="pipeline.split_points every pipelined layout must use")
    parser.add_argument("--top", type=number(NUMBERS, "--top"), default=5)
    parser.add_argument("--output", type=Path, help="write the best layout as a TOML recipe here")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    try:
        opts = parser.parse_args(argv)
        if opts.output is not None:
            check_output_file(opts.output, opts.overwrite)  # before the search
        space = SearchSpace(
            _choices(opts.ac, AC_MODES, "--ac"),
            _choices(opts.optimizers, OPTIMIZERS, "--optimizers"),
            {"both": (False, True), "on": (True,), "off": (False,)}[opts.float8],
            _choices(opts.schedules, PLAN_SCHEDULES, "--schedules"),
            opts.split_points,
            {"both": (0, DEFAULT_CHUNK_TOKENS), "on": (DEFAULT_CHUNK_TOKENS,), "off": (0,)}[opts.chunked_loss],
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
