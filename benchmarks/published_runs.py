"""The planner's step-time and memory models against published training runs on H100-class GPUs: predicted tokens/s
per GPU and peak memory for the layout each source states, against the published figures.

    PYTHONPATH=. .venv/bin/python benchmarks/published_runs.py

Pure arithmetic (shape models, memory and step-time estimators); no GPU, no process group. Each row names its source;
where a source leaves a setting out, the assumption is named in `note`. The compute rate of each row is the MFU its
source logged (`mfu_basis` says where), else the planner's default 0.4 with the reason. An MFU counts model FLOPs (both
torchtitan's, which the default stands on, and the logged ones), while the step-time model runs executed FLOPs (full
checkpointing's second forward included) at `Cluster.mfu`, so the figure is scaled by executed / model FLOPs of the
row's layout.

Memory: the estimate's peak counts tensors (`torch.cuda.max_memory_allocated()`); what torchtitan logs is
`torch.cuda.max_memory_reserved()`, the caching allocator's segments, so the estimate's reserved bytes (the peak times
the allocator's measured reserve, meshloom.planning.allocator) are compared with it. The CUDA context and NCCL's buffers
lie outside both and enter the fit rule only (meshloom.planning.gpu_memory).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from dataclasses import dataclass

from meshloom.models.registry import get_model_args, get_model_spec
from meshloom.models.shape import ShapeModel
from meshloom.planning.comm_estimate import step_flops
from meshloom.planning.gpu_memory import device_bytes
from meshloom.planning.layout import Layout, Precision
from meshloom.planning.memory_estimate import GIB, estimate_memory
from meshloom.planning.step_time import Cluster, StepTime, step_time

TORCHTITAN = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"
# The torchtitan commit those runs name (its "Versions and Dates"): the defaults the table leaves unstated are its.
TITAN_COMMIT = "https://github.com/pytorch/torchtitan/tree/9dec370ad26b5f8e9a7333a0e36165018262644b"
TITAN_DSV3 = "https://github.com/pytorch/torchtitan/issues/1789"
AUTOMODEL = "https://docs.nvidia.com/nemo/automodel/latest/performance-summary.html"
DEEPSEEK_V3 = "https://arxiv.org/abs/2412.19437"
# The benchmark configs AutoModel's performance summary links (examples/llm_benchmark/qwen/qwen3_moe_30b_te_deepep.yaml,
# examples/llm_benchmark/deepseek/deepseek_v3_te_deepep.yaml; read at NVIDIA-NeMo/Automodel 36044ad).
AUTOMODEL_CONFIGS = "https://github.com/NVIDIA-NeMo/Automodel/tree/main/examples/llm_benchmark"
AUTOMODEL_SETTINGS = ("its config: activation_checkpointing true (full AC), MoE reshard_after_forward false, "
                      "MaskedCrossEntropy with fp32_upcast false, no model dtype (bf16); experts outside FSDP (ep_shard 1)")  # fmt: skip
# AutoModel builds the model in bf16 (`NeMoAutoModelForCausalLM.from_config`: torch_dtype "auto" is torch.bfloat16), so
# the sharded parameters, their reduced gradients and Adam's moments are bf16; FSDP's MixedPrecisionPolicy reduces in
# fp32 (nemo_automodel/components/moe/parallelizer.py), so the unsharded gradients it accumulates are fp32, as the
# estimate has them (its default defer_fsdp_grad_sync keeps them unsharded until the last microbatch, and its pipeline
# patch does the same across the schedule's microbatches). Routed experts go into FSDP only where an ep_shard mesh
# larger than 1 shards them; with dp_shard = ep (both rows) they are the block's ignored parameters, bf16 and never
# gathered. The loss takes the bf16 logits without the fp32 upcast.
AUTOMODEL_PRECISION = Precision("bf16", master_bytes=2, loss_bytes=2, fsdp_wraps_whole_experts=False)
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
# H800 links, bytes/s per GPU: NVLink 160 GB/s and InfiniBand 50 GB/s (DeepSeek-V3 report, section 3.2.2).
H800_BANDWIDTH = (160e9, 50e9)
# torchtitan at that commit: pipeline_parallel_microbatches defaults to the pipeline degree
# (torchtitan/parallelisms/pipeline_llama.py), and its split gives the first and last stage base = layers // stages
# blocks and the middle stages one more each while layers remain (pipelining_utils.generate_split_points).
TITAN_405B_SPLIT_1F1B = (15, 16, 16, 16, 16, 16, 16, 15)
TITAN_405B_SPLIT_INTERLEAVED = (7,) + (8,) * 14 + (7,)


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
    # The source's selective checkpointing is torchtitan's op policy, which recomputes every second matmul
    # (`titan_op_policy`), not meshloom's selective_op, which keeps them all.
    titan_op_sac: bool = False
    # The source states no checkpointing mode meshloom has (none, or its own recomputation): compared with the lightest
    # mode that fits under the fit rule (none, then selective_op, then full), as a planner would have to run it.
    ac_open: bool = False
    # Per-GPU link bandwidths (inside a node, between nodes) where they are not the H100's (Cluster.bandwidth).
    bandwidth: tuple[float, float] | None = None
    # The run's dtypes: bf16 compute with fp32 masters and an fp32 loss (torchtitan's, meshloom's) unless stated.
    precision: Precision = Precision("bf16")


def _run(name, model, flavor, gpus, seq, tps, source, note="", mfu=None, mfu_basis=DEFAULT_MFU_BASIS, memory=None,
         gpu_gib=H100_80_GIB, titan_op_sac=False, ac_open=False, bandwidth=None, precision=Precision("bf16"),
         **layout) -> Run:  # fmt: skip
    return Run(name, model, flavor, gpus, seq, Layout(**layout), tps, source, note, mfu, mfu_basis, memory, gpu_gib,
               titan_op_sac=titan_op_sac, ac_open=ac_open, bandwidth=bandwidth, precision=precision)  # fmt: skip


# torchtitan's train.py at that commit compiles the blocks only: "TODO: compiling loss function causes CUDA errors,
# turning off for now".
TITAN_PRECISION = Precision("bf16", compiled_loss=False)
TITAN_SAC = "table 1: selective AC (torchtitan's op policy, every second matmul recomputed), local batch 2"
TITAN_PP = ("table 5: local batch 32 as 8 microbatches of 4 (torchtitan's default: as many as the pipeline degree), "
            "torchtitan's stage split, FSDP not resharding after forward under PP, full AC, Float8, async TP (which "
            "torchtitan runs under compile only)")  # fmt: skip

RUNS = [
    _run("Llama 3.1 8B, FSDP 8 (eager)", "llama3", "8B", 8, 8192, 5762, TORCHTITAN, TITAN_SAC, memory=82.4,
         gpu_gib=TITAN_GPU_GIB, titan_op_sac=True, dp_shard=8, ac="selective_op", microbatch_size=2, precision=TITAN_PRECISION),
    _run("Llama 3.1 8B, FSDP 8, compile (bf16)", "llama3", "8B", 8, 8192, 6667, TORCHTITAN, TITAN_SAC + "; compile",
         memory=77.0, gpu_gib=TITAN_GPU_GIB, titan_op_sac=True, dp_shard=8, ac="selective_op", microbatch_size=2,
         compile=True, precision=TITAN_PRECISION),
    _run("Llama 3.1 8B, FSDP 8, compile + Float8", "llama3", "8B", 8, 8192, 8532, TORCHTITAN, TITAN_SAC + "; compile",
         memory=76.8, gpu_gib=TITAN_GPU_GIB, titan_op_sac=True, dp_shard=8, ac="selective_op", microbatch_size=2,
         float8=True, compile=True, precision=TITAN_PRECISION),
    _run("Llama 3.1 70B, FSDP 32 x TP 8, Float8", "llama3", "70B", 256, 8192, 829, TORCHTITAN,
         "table 4: local batch 16 in one forward (no accumulation at that commit), full AC, compile, no async TP",
         memory=71.9, gpu_gib=TITAN_GPU_GIB, dp_shard=32, tp=8, ac="full", microbatch_size=16, float8=True, compile=True, precision=TITAN_PRECISION),
    _run("Llama 3.1 405B, FSDP 8 x TP 8 x PP 8, 1F1B", "llama3", "405B", 512, 8192, 100, TORCHTITAN, TITAN_PP,
         memory=82.5, gpu_gib=TITAN_GPU_GIB, dp_shard=8, tp=8, pp=8, ac="full", microbatch_size=4, microbatches=8,
         stage_layer_counts=TITAN_405B_SPLIT_1F1B, reshard_after_forward=False, float8=True, compile=True, precision=TITAN_PRECISION),
    _run("Llama 3.1 405B, FSDP 8 x TP 8 x PP 8, Interleaved 1F1B", "llama3", "405B", 512, 8192, 128, TORCHTITAN,
         TITAN_PP + "; 2 stages per rank", memory=72.7, gpu_gib=TITAN_GPU_GIB, dp_shard=8, tp=8, pp=8, ac="full",
         microbatch_size=4, microbatches=8, pipeline_schedule="Interleaved1F1B", stages_per_rank=2,
         stage_layer_counts=TITAN_405B_SPLIT_INTERLEAVED, reshard_after_forward=False, float8=True, compile=True, precision=TITAN_PRECISION),
    _run("DeepSeek-V3 16B, FSDP 8 x EP 8", "deepseek_v3", "16B", 8, 4096, 11636, TITAN_DSV3,
         "step-10 log line; local batch 4 and full AC assumed", mfu=0.205, mfu_basis="logged: 20.5% MFU (torchtitan's count)",
         dp_shard=8, ep=8, ac="full", microbatch_size=4),
    _run("Qwen3-30B-A3B, FSDP 8 x EP 8 (NeMo AutoModel)", "qwen3", "30B-A3B", 8, 4096, 12040, AUTOMODEL,
         "MBS 4, GA 16, TE + DeepEP; " + AUTOMODEL_SETTINGS, mfu=277 / H100_BF16_TFLOPS,
         mfu_basis="logged: 277 model TFLOP/s per GPU", precision=AUTOMODEL_PRECISION, dp_shard=8, ep=8, ac="full",
         reshard_after_forward=False, microbatch_size=4, microbatches=16, grad_accum_steps=16),
    _run("DeepSeek-V3 671B, PP 4 x EP 64, 256 GPUs (NeMo AutoModel)", "deepseek_v3", "671B", 256, 4096, 1002, AUTOMODEL,
         "VP 8 as Interleaved1F1B with 8 stages per rank, LBS 8 as 8 microbatches of 1, GA 1, TE + DeepEP; "
         + AUTOMODEL_SETTINGS, mfu=250 / H100_BF16_TFLOPS, mfu_basis="logged: 250 model TFLOP/s per GPU",
         precision=AUTOMODEL_PRECISION, dp_shard=64, pp=4, ep=64, ac="full", reshard_after_forward=False,
         microbatch_size=1, microbatches=8, pipeline_schedule="Interleaved1F1B", stages_per_rank=8),
    _run("DeepSeek-V3 671B, PP 16 x EP 64, 2,048 H800 (DeepSeek)", "deepseek_v3", "671B", 2048, 4096, 1543, DEEPSEEK_V3,
         "180K H800 GPU-hours per trillion tokens (section 1); DualPipe as DualPipeV, batch 15,360 (its final), FP8 "
         "(meshloom's Float8: dense linears only), H800 links; its recomputation (RMSNorm, MLA up-projections) and FP8 "
         "activation caching are not meshloom modes; microbatch 1 assumed", mfu_basis="planner default 0.4 (the report "
         "logs no MFU)", ac_open=True, bandwidth=H800_BANDWIDTH, dp_shard=128, pp=16, ep=64, microbatch_size=1,
         microbatches=120, pipeline_schedule="DualPipeV", stages_per_rank=2, float8=True),
]


def titan_op_policy(shape: ShapeModel) -> ShapeModel:
    """`shape` with selective_op as torchtitan's op policy keeps a block (torchtitan/parallelisms/parallelize_llama.py
    at TITAN_COMMIT: every aten.mm output is saved except every second one of a block, attention's outputs and the
    reduce-scatters are saved). The block's dense matrices, in the order its forward multiplies them (Llama 3:
    wq, wk, wv, wo, w1, w3, w2), lose the outputs of the 2nd, 4th, 6th: a column-parallel one its 1/tp share, a
    row-parallel one its full-size partial sum (its reduce-scattered result stays saved)."""
    kept = shape.block_activation_bytes_per_token

    def block_activation_bytes_per_token(layer: int, ac: str, tp: int, act_bytes: int) -> float:
        saved = kept(layer, ac, tp, act_bytes)
        if ac != "selective_op":
            return saved
        matrices = [p for p in shape.block_params(layer) if len(p.shape) == 2 and not p.expert]
        recomputed = sum(act_bytes * (p.shape[0] / tp if p.tp_dim == 0 else p.shape[0]) for p in matrices[1::2])
        return saved - recomputed

    titan = copy.copy(shape)
    titan.block_activation_bytes_per_token = block_activation_bytes_per_token  # type: ignore[method-assign]
    return titan


def shape_of(run: Run) -> ShapeModel:
    shape = get_model_spec(run.model).shape_model(get_model_args(run.model, run.flavor))
    return titan_op_policy(shape) if run.titan_op_sac else shape


def compared_layout(run: Run, shape: ShapeModel) -> Layout:
    """The row's layout; for a row whose checkpointing is not one of meshloom's modes (`Run.ac_open`), the lightest
    mode that fits under the fit rule (none, then selective_op, then full), or full where none fits."""
    if run.ac_open:
        for ac in ("none", "selective_op", "full"):
            layout = dataclasses.replace(run.layout, ac=ac)
            peak = estimate_memory(shape, layout, run.seq_len, run.precision).peak
            if cluster_of(run, layout, shape).fits(peak, layout):
                return layout
        return dataclasses.replace(run.layout, ac="full")
    return run.layout


def cluster_of(run: Run, layout: Layout, shape: ShapeModel, mfu: float | None = None) -> Cluster:
    """The run's GPUs, at the MFU (logged, else the planner default) turned into the executed-FLOP rate of `layout`,
    or at `mfu` as given."""
    if mfu is None:
        model, executed = step_flops(shape, layout, run.seq_len)
        mfu = (run.mfu or PLANNER_MFU) * executed / model
    return Cluster(run.gpus, 8, run.gpu_memory_gib, mfu=mfu, expert_comm=run.expert_comm, bandwidth=run.bandwidth)


@dataclass(frozen=True)
class Prediction:
    """What the planner predicts for one run."""

    # The layout compared (the row's, or the recomputation its memory forces).
    layout: Layout
    # The step-time breakdown.
    time: StepTime
    # Estimated tensor peak per GPU (allocated), GiB, and on which pipeline rank.
    peak_gib: float
    stage: int
    # What the caching allocator reserves for that peak (meshloom.planning.allocator), GiB: what torchtitan logs.
    reserved_gib: float
    # The peak with the CUDA context and NCCL's buffers (meshloom.planning.gpu_memory), GiB.
    device_gib: float
    # Whether it fits the planner's rule (Cluster.fits) on the run's GPUs.
    fits: bool


def predict(run: Run, mfu: float | None = None) -> Prediction:
    shape = shape_of(run)
    assert run.layout.world_size == run.gpus, run.name
    layout = compared_layout(run, shape)
    cluster = cluster_of(run, layout, shape, mfu)
    time = step_time(shape, layout, run.seq_len, run.precision, cluster)
    memory = estimate_memory(shape, layout, run.seq_len, run.precision)
    device = device_bytes(memory.peak, layout)
    return Prediction(layout, time, memory.peak / GIB, memory.stage, memory.reserved / GIB, device / GIB,
                      cluster.fits(memory.peak, layout))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mfu", type=float, help="one compute rate for every row instead of each row's")
    args = parser.parse_args()
    print(f"H100 SXM bf16 dense {H100_BF16_TFLOPS:g} TFLOP/s, nvlink_ib (300 / 45 GB/s per GPU; H800 rows 160 / 50); expert "
          "all-to-all overlapped (DeepEP: behind the expert matmuls; DualPipe: behind all compute); mfu: the executed-FLOP "
          "rate; memory: the estimate's reserved bytes (its tensor peak x the allocator's measured reserve) against the published "
          "figure (torchtitan: max reserved); device: with "
          "the CUDA context and NCCL's buffers; fits: device <= 0.9 x the GPU's memory")  # fmt: skip
    print(f"{'run':<56} {'pub tok/s':>9} {'pred':>7} {'ratio':>5} {'mfu':>5} {'pub GiB':>7} {'est GiB':>7} {'ratio':>5} "
          f"{'device':>6} {'fits':>4}  notes")  # fmt: skip
    for run in RUNS:
        p = predict(run, args.mfu)
        ratio = p.time.tokens_per_s_per_gpu / run.tokens_per_s_per_gpu
        rate = cluster_of(run, p.layout, shape_of(run), args.mfu).mfu
        pub = f"{run.memory_gib:7.1f}" if run.memory_gib else f"{'-':>7}"
        mem_ratio = f"{p.reserved_gib / run.memory_gib:5.2f}" if run.memory_gib else f"{'-':>5}"
        print(f"{run.name:<56} {run.tokens_per_s_per_gpu:>9,.0f} {p.time.tokens_per_s_per_gpu:>7,.0f} {ratio:>5.2f} {rate:>5.3f} "
              f"{pub} {p.reserved_gib:>7.1f} {mem_ratio} {p.device_gib:>6.1f} {'yes' if p.fits else 'NO':>4}  {run.note}; "
              f"MFU: {run.mfu_basis}" + (f"; compared with ac {p.layout.ac}" if p.layout != run.layout else ""))  # fmt: skip
        t = p.time
        print(f"    step {t.step:.2f} s = compute {t.compute:.2f} + exposed " + ", ".join(f"{d} {v:.2f}" for d, v in t.exposed.items() if v)
              + f" + bubble {t.bubble:.2f}; peak on pipeline rank {p.stage}")
    print("sources: " + ", ".join(sorted({run.source for run in RUNS} | {TITAN_COMMIT})))


if __name__ == "__main__":
    main()
