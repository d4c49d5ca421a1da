"""The planner's step-time and memory models against published training runs on H100-class GPUs: predicted tokens/s
per GPU and peak memory for the layout each source states, against the published figures.

    PYTHONPATH=. .venv/bin/python benchmarks/published_runs.py

Pure arithmetic (shape models, memory and step-time estimators); no GPU, no process group. Each row names its source;
where a source leaves a setting out, the assumption is named in `note`. The compute rate of each row is the MFU its
source logged (`mfu_basis` says where), else the planner's default 0.4 with the reason. A logged MFU counts model
FLOPs, while the step-time model runs executed FLOPs (full checkpointing's second forward included) at `Cluster.mfu`,
so the logged figure is scaled by executed / model FLOPs of the row's layout.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from meshloom.models.registry import get_model_args, get_model_spec
from meshloom.models.shape import ShapeModel
from meshloom.planning.comm_estimate import step_flops
from meshloom.planning.layout import Layout, Precision
from meshloom.planning.memory_estimate import GIB, estimate_memory
from meshloom.planning.step_time import Cluster, StepTime, step_time

TORCHTITAN = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"
TITAN_DSV3 = "https://github.com/pytorch/torchtitan/issues/1789"
AUTOMODEL = "https://docs.nvidia.com/nemo/automodel/latest/performance-summary.html"
AUTOMODEL_HIGHLIGHTS = "https://docs.nvidia.com/nemo/automodel/latest/about/key-features.html"
DEEPSEEK_V3 = "https://arxiv.org/abs/2412.19437"
# The planner's default compute rate (meshloom plan --mfu) and why it stands where a source logged none: torchtitan
# states 33-39% MFU for its bf16 Llama 3.1 8B runs on these H100s, with and without compile.
PLANNER_MFU = 0.4
DEFAULT_MFU_BASIS = "planner default 0.4 (torchtitan: 33-39% MFU for 8B bf16 on these GPUs)"
# H100 SXM dense bf16 peak, TFLOP/s (NVIDIA H100 datasheet), the figure the sources' MFUs are taken against.
H100_BF16_TFLOPS = 989.0
# GPU memory the planner's headroom rule is applied to, GiB: torchtitan's H100s report 95 GiB (torchtitan
# docs/performance.md: "NVIDIA H100 GPUs with 95 GiB memory"); NeMo's DGX-H100 and DeepSeek's H800 have 80 GB parts.
TITAN_GPU_GIB = 95.0
H100_80_GIB = 80.0


@dataclass(frozen=True)
class Run:
    """One published training run and the layout that states it."""

    # Row label.
    name: str
    # model.name and model.flavor of the shape model.
    model: str
    flavor: str
    # GPUs of the run.
    gpus: int
    # Tokens per sequence.
    seq_len: int
    # The source's parallel degrees, batch, checkpointing and Float8 as a planner Layout.
    layout: Layout
    # Published tokens per second per GPU.
    tokens_per_s_per_gpu: float
    # Where the figures come from.
    source: str
    # Assumptions where the source is silent.
    note: str = ""
    # Model FLOPs utilisation the source logged (None: the planner default).
    mfu: float | None = None
    # Where `mfu` comes from.
    mfu_basis: str = DEFAULT_MFU_BASIS
    # Published peak memory per GPU in GiB, or None. torchtitan logs the caching allocator's peak reserved bytes
    # (`device_mem_stats.max_reserved_gib` of its DeviceMemoryMonitor, torchtitan/train.py), at least the allocated ones.
    memory_gib: float | None = None
    # Memory of one GPU of the run in GiB, for the headroom rule.
    gpu_memory_gib: float = H100_80_GIB
    # How the run's expert all-to-all is timed (Cluster.expert_comm): DeepEP and DualPipe overlap it.
    expert_comm: str = "overlapped"


def _run(name, model, flavor, gpus, seq, tps, source, note="", mfu=None, mfu_basis=DEFAULT_MFU_BASIS, memory=None,
         gpu_gib=H100_80_GIB, **layout) -> Run:  # fmt: skip
    return Run(name, model, flavor, gpus, seq, Layout(**layout), tps, source, note, mfu, mfu_basis, memory, gpu_gib)


RUNS = [
    _run("Llama 3.1 8B, FSDP 8, compile + Float8", "llama3", "8B", 8, 8192, 8532, TORCHTITAN, "table 1, selective AC",
         memory=76.8, gpu_gib=TITAN_GPU_GIB, dp_shard=8, ac="selective_op", microbatch_size=2, float8=True),
    _run("Llama 3.1 8B, FSDP 8, compile (bf16)", "llama3", "8B", 8, 8192, 6667, TORCHTITAN, "table 1",
         memory=77.0, gpu_gib=TITAN_GPU_GIB, dp_shard=8, ac="selective_op", microbatch_size=2),
    _run("Llama 3.1 70B, FSDP 32 x TP 8, Float8", "llama3", "70B", 256, 8192, 829, TORCHTITAN, "table 4, full AC, no async TP",
         memory=71.9, gpu_gib=TITAN_GPU_GIB, dp_shard=32, tp=8, ac="full", microbatch_size=16, float8=True),
    _run("Llama 3.1 405B, FSDP 8 x TP 8 x PP 8, 1F1B", "llama3", "405B", 512, 8192, 100, TORCHTITAN,
         "table 5, full AC, Float8, async TP; microbatch 1 assumed", memory=82.5, gpu_gib=TITAN_GPU_GIB, dp_shard=8, tp=8,
         pp=8, ac="full", microbatch_size=1, microbatches=32, float8=True),
    _run("Llama 3.1 405B, FSDP 8 x TP 8 x PP 8, Interleaved 1F1B", "llama3", "405B", 512, 8192, 128, TORCHTITAN,
         "table 5; 2 stages per rank, microbatch 1 assumed", memory=72.7, gpu_gib=TITAN_GPU_GIB, dp_shard=8, tp=8, pp=8,
         ac="full", microbatch_size=1, microbatches=32, pipeline_schedule="Interleaved1F1B", stages_per_rank=2, float8=True),
    _run("DeepSeek-V3 16B, FSDP 8 x EP 8", "deepseek_v3", "16B", 8, 4096, 11636, TITAN_DSV3,
         "step-10 log line; local batch 4 and full AC assumed", mfu=0.205, mfu_basis="logged: 20.5% MFU (torchtitan's count)",
         dp_shard=8, ep=8, ac="full", microbatch_size=4),
    _run("Qwen3-30B-A3B, FSDP 8 x EP 8 (NeMo AutoModel)", "qwen3", "30B-A3B", 8, 4096, 11842, AUTOMODEL_HIGHLIGHTS,
         "MBS 4, GA 16 (performance summary), TE + DeepEP; AC unstated: the lightest mode that fits, else full",
         mfu=212 / H100_BF16_TFLOPS, mfu_basis="logged: 212 model TFLOP/s per GPU", dp_shard=8, ep=8, ac="none",
         microbatch_size=4, microbatches=16, grad_accum_steps=16),
    _run("DeepSeek-V3 671B, PP 4 x EP 64, 256 GPUs (NeMo AutoModel)", "deepseek_v3", "671B", 256, 4096, 1002, AUTOMODEL,
         "VP 8 as Interleaved1F1B with 8 stages per rank, LBS 8, full AC assumed", mfu=250 / H100_BF16_TFLOPS,
         mfu_basis="logged: 250 model TFLOP/s per GPU (" + AUTOMODEL_HIGHLIGHTS + ")", dp_shard=64, pp=4, ep=64, ac="full",
         microbatch_size=1, microbatches=8, pipeline_schedule="Interleaved1F1B", stages_per_rank=8),
    _run("DeepSeek-V3 671B, PP 16 x EP 64, 2,048 H800 (DeepSeek)", "deepseek_v3", "671B", 2048, 4096, 1543, DEEPSEEK_V3,
         "180K H800 GPU-hours per trillion tokens (section 1); DualPipe as DualPipeV, batch 15,360 (its final), FP8 "
         "(meshloom's Float8: dense linears only), selective recomputation; microbatch 1 assumed",
         mfu_basis="planner default 0.4 (the report logs no MFU)", dp_shard=128, pp=16, ep=64, ac="selective_op",
         microbatch_size=1, microbatches=120, pipeline_schedule="DualPipeV", stages_per_rank=2, float8=True),
]


def shape_of(run: Run) -> ShapeModel:
    return get_model_spec(run.model).shape_model(get_model_args(run.model, run.flavor))


def compared_layout(run: Run, shape: ShapeModel) -> Layout:
    """The row's layout; for a row whose AC mode the source leaves open (Qwen3), the lightest recomputation the memory
    estimate fits under the headroom rule (none, then selective_op, then full), or full where none fits."""
    if run.name.startswith("Qwen3"):
        for ac in ("none", "selective_op", "full"):
            layout = dataclasses.replace(run.layout, ac=ac)
            if estimate_memory(shape, layout, run.seq_len, Precision("bf16")).peak <= cluster_of(run, layout, shape).usable_bytes:
                return layout
        return dataclasses.replace(run.layout, ac="full")
    return run.layout


def cluster_of(run: Run, layout: Layout, shape: ShapeModel, mfu: float | None = None) -> Cluster:
    """The run's GPUs, at the source's logged MFU turned into the executed-FLOP rate of `layout` (or at `mfu`)."""
    if mfu is None and run.mfu is not None:
        model, executed = step_flops(shape, layout, run.seq_len)
        mfu = run.mfu * executed / model
    rate = PLANNER_MFU if mfu is None else mfu
    return Cluster(run.gpus, 8, run.gpu_memory_gib, mfu=rate, expert_comm=run.expert_comm)


@dataclass(frozen=True)
class Prediction:
    """What the planner predicts for one run."""

    # The layout compared (the row's, or the recomputation its memory forces).
    layout: Layout
    # The step-time breakdown.
    time: StepTime
    # Estimated peak memory per GPU, GiB (allocated by the estimate's count) and on which pipeline rank.
    peak_gib: float
    stage: int
    # Whether the peak fits the planner's headroom rule on the run's GPUs.
    fits: bool


def predict(run: Run, mfu: float | None = None) -> Prediction:
    shape = shape_of(run)
    assert run.layout.world_size == run.gpus, run.name
    layout = compared_layout(run, shape)
    cluster = cluster_of(run, layout, shape, mfu)
    time = step_time(shape, layout, run.seq_len, Precision("bf16"), cluster)
    memory = estimate_memory(shape, layout, run.seq_len, Precision("bf16"))
    return Prediction(layout, time, memory.peak / GIB, memory.stage, memory.peak <= cluster.usable_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mfu", type=float, help="one compute rate for every row instead of each row's")
    args = parser.parse_args()
    print(f"H100 SXM bf16 dense {H100_BF16_TFLOPS:g} TFLOP/s, nvlink_ib (300 / 45 GB/s per GPU); expert all-to-all overlapped "
          "with the expert matmuls (DeepEP / DualPipe); memory: the estimate's peak (allocated) against the published "
          "figure; fits: peak <= 0.9 x the GPU's memory")  # fmt: skip
    print(f"{'run':<56} {'pub tok/s':>9} {'pred':>7} {'ratio':>5} {'mfu':>5} {'pub GiB':>7} {'est GiB':>7} {'ratio':>5} {'fits':>4}  notes")
    for run in RUNS:
        p = predict(run, args.mfu)
        ratio = p.time.tokens_per_s_per_gpu / run.tokens_per_s_per_gpu
        rate = cluster_of(run, p.layout, shape_of(run), args.mfu).mfu
        pub = f"{run.memory_gib:7.1f}" if run.memory_gib else f"{'-':>7}"
        mem_ratio = f"{p.peak_gib / run.memory_gib:5.2f}" if run.memory_gib else f"{'-':>5}"
        print(f"{run.name:<56} {run.tokens_per_s_per_gpu:>9,.0f} {p.time.tokens_per_s_per_gpu:>7,.0f} {ratio:>5.2f} {rate:>5.3f} "
              f"{pub} {p.peak_gib:>7.1f} {mem_ratio} {'yes' if p.fits else 'NO':>4}  {run.note}; MFU: {run.mfu_basis}"
              + (f"; compared with ac {p.layout.ac}" if p.layout != run.layout else ""))
        t = p.time
        print(f"    step {t.step:.2f} s = compute {t.compute:.2f} + exposed " + ", ".join(f"{d} {v:.2f}" for d, v in t.exposed.items() if v)
              + f" + bubble {t.bubble:.2f}; peak on pipeline rank {p.stage}")
    print("sources: " + ", ".join(sorted({run.source for run in RUNS} | {AUTOMODEL_HIGHLIGHTS})))


if __name__ == "__main__":
    main()
