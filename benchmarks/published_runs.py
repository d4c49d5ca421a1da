"""The planner's step-time model against published training runs on H100s: predicted tokens/s per GPU for the
layout each source states, at one stated MFU assumption, divided into the published figure.

    PYTHONPATH=. .venv/bin/python benchmarks/published_runs.py [--mfu 0.4]

Pure arithmetic (shape models, memory and step-time estimators); no GPU, no process group. Sources are listed with
each row; where a source leaves a setting out, the assumption is named in `note`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from meshloom.models.registry import get_model_args, get_model_spec
from meshloom.planning.layout import Layout, Precision
from meshloom.planning.memory_estimate import GIB, estimate_memory
from meshloom.planning.step_time import Cluster, step_time

TORCHTITAN = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"
TITAN_DSV3 = "https://github.com/pytorch/torchtitan/issues/1789"
AUTOMODEL = "https://docs.nvidia.com/nemo/automodel/latest/performance-summary.html"


@dataclass(frozen=True)
class Run:
    name: str
    model: str
    flavor: str
    gpus: int
    seq_len: int
    layout: Layout
    tokens_per_s_per_gpu: float
    source: str
    note: str = ""


def _run(name, model, flavor, gpus, seq, tps, source, note="", **layout) -> Run:
    return Run(name, model, flavor, gpus, seq, Layout(**layout), tps, source, note)


RUNS = [
    _run("Llama 3.1 8B, FSDP 8, compile + Float8", "llama3", "8B", 8, 8192, 8532, TORCHTITAN, "table 1, selective AC",
         dp_shard=8, ac="selective_op", microbatch_size=2, float8=True),
    _run("Llama 3.1 8B, FSDP 8, compile (bf16)", "llama3", "8B", 8, 8192, 6667, TORCHTITAN, "table 1",
         dp_shard=8, ac="selective_op", microbatch_size=2),
    _run("Llama 3.1 70B, FSDP 32 x TP 8, Float8", "llama3", "70B", 256, 8192, 829, TORCHTITAN, "table 4, full AC, no async TP",
         dp_shard=32, tp=8, ac="full", microbatch_size=16, float8=True),
    _run("Llama 3.1 405B, FSDP 8 x TP 8 x PP 8, 1F1B", "llama3", "405B", 512, 8192, 100, TORCHTITAN,
         "table 5, full AC, Float8, async TP; microbatch 1 assumed", dp_shard=8, tp=8, pp=8, ac="full", microbatch_size=1,
         microbatches=32, float8=True),
    _run("Llama 3.1 405B, FSDP 8 x TP 8 x PP 8, Interleaved 1F1B", "llama3", "405B", 512, 8192, 128, TORCHTITAN,
         "table 5; 2 stages per rank, microbatch 1 assumed", dp_shard=8, tp=8, pp=8, ac="full", microbatch_size=1,
         microbatches=32, pipeline_schedule="Interleaved1F1B", stages_per_rank=2, float8=True),
    _run("DeepSeek-V3 16B, FSDP 8 x EP 8", "deepseek_v3", "16B", 8, 4096, 11636, TITAN_DSV3,
         "step-10 log line (20.5% MFU by torchtitan's count); local batch 4 and full AC assumed", dp_shard=8, ep=8,
         ac="full", microbatch_size=4),
    _run("Qwen3-30B-A3B, FSDP 8 x EP 8 (NeMo AutoModel)", "qwen3", "30B-A3B", 8, 4096, 12040, AUTOMODEL,
         "MBS 4, GA 16, TE + DeepEP; no AC assumed", dp_shard=8, ep=8, ac="none", microbatch_size=4, microbatches=16,
         grad_accum_steps=16),
    _run("DeepSeek-V3 671B, PP 4 x EP 64, 256 GPUs (NeMo AutoModel)", "deepseek_v3", "671B", 256, 4096, 1002, AUTOMODEL,
         "VP 8 as Interleaved1F1B with 8 stages per rank, LBS 8, full AC assumed", dp_shard=64, pp=4, ep=64, ac="full",
         microbatch_size=1, microbatches=8, pipeline_schedule="Interleaved1F1B", stages_per_rank=8),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mfu", type=float, default=0.4, help="share of the 989 TFLOP/s bf16 peak the compute reaches")
    args = parser.parse_args()
    print(f"predicted at MFU {args.mfu} of 989 TFLOP/s (H100 SXM bf16 dense), nvlink_ib (300 / 45 GB/s per GPU)")
    print(f"{'run':<58} {'published':>9} {'predicted':>9} {'pred/pub':>8} {'peak GiB':>8}  note")
    for run in RUNS:
        spec = get_model_spec(run.model)
        shape = spec.shape_model(get_model_args(run.model, run.flavor))
        assert run.layout.world_size == run.gpus, run.name
        cluster = Cluster(run.gpus, 8, 80, mfu=args.mfu)
        time = step_time(shape, run.layout, run.seq_len, Precision("bf16"), cluster)
        peak = estimate_memory(shape, run.layout, run.seq_len, Precision("bf16")).peak / GIB
        ratio = time.tokens_per_s_per_gpu / run.tokens_per_s_per_gpu
        print(f"{run.name:<58} {run.tokens_per_s_per_gpu:>9,.0f} {time.tokens_per_s_per_gpu:>9,.0f} {ratio:>8.2f} {peak:>8.1f}  {run.note}")
    print("sources: " + ", ".join(sorted({run.source for run in RUNS})))


if __name__ == "__main__":
    main()
