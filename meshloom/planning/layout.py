"""A `Layout`: one way to run a model (degrees, checkpointing, microbatching) as the estimators see it; and
the conversions between a run's settings and a layout."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshloom.config.errors import ConfigError
from meshloom.config.schema import Config
from meshloom.parallel.pipeline import even_stage_split

if TYPE_CHECKING:
    from meshloom.planning.run_plan import RunPlan

FP32 = 4
# Modes `meshloom plan` chooses from; the estimate also covers selective_layer (every k-th block in full).
AC_MODES = ("none", "selective_op", "full")
ESTIMATED_AC_MODES = AC_MODES + ("selective_layer",)


@dataclass(frozen=True)
class Layout:
    """One way to run a model: parallel degrees, checkpointing mode and how a step is cut into microbatches.

    `microbatch_size` sequences go through each forward; each data-parallel rank runs `microbatches` of them
    per optimizer step (gradient accumulation, or the pipeline's microbatches when pp > 1).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ac: str = "none"
    microbatch_size: int = 1
    microbatches: int = 1
    pipeline_schedule: str = "1F1B"
    # selective_layer: blocks k, 2k, 3k, ... (counting from 1 over the whole model) are checkpointed.
    every_k_layers: int = 1
    # Expert parallel: borrows its ranks from dp_shard x cp (it adds none to the world size).
    ep: int = 1
    # Model stages on each pipeline rank (pipeline.stages_per_rank as the plan resolved it).
    stages_per_rank: int = 1
    # Blocks of each pipeline stage, in stage order (pipeline.split_points, or the even split); () = the even split
    # of meshloom.parallel.pipeline.
    stage_layer_counts: tuple[int, ...] = ()
    # Optimizer steps are cut into this many pipeline steps (or forward/backward passes when pp = 1) per data-parallel
    # rank; `microbatches` counts them all (pipeline microbatches x grad_accum_steps).
    grad_accum_steps: int = 1
    # optimizer.name: AdamW keeps two moments per parameter, Muon one momentum buffer per hidden matrix.
    optimizer: str = "AdamW"
    # float8.enable: the blocks' linear layers in float8 (torchao's Float8Linear).
    float8: bool = False
    # FSDP frees a block's gathered weights after its forward (False: kept to the end of backward, as the
    # zero-bubble pipeline schedules require).
    reshard_after_forward: bool = True
    # float8.recipe: "tensorwise" or "rowwise" scaling (what Float8Linear saves for backward differs).
    float8_recipe: str = "tensorwise"
    # Under FSDP, Float8 weights are all-gathered in float8 (tensorwise with float8.fsdp_float8_all_gather only);
    # otherwise in the compute dtype and cast inside each linear.
    float8_all_gather: bool = True
    # compile.enable: each block compiled (its saved tensors are what AOTAutograd's partitioner keeps) and the loss too.
    compile: bool = False
    # loss.chunk_tokens when loss.chunked, else 0: the output projection and the loss run in chunks of this many tokens.
    loss_chunk_tokens: int = 0

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def fsdp(self) -> int:
        """Ranks that shard parameters: dp_shard x cp (context-parallel ranks also shard the weights)."""
        return self.dp_shard * self.cp

    @property
    def expert_fsdp(self) -> int:
        """Ranks that shard each expert's weights: what dp_shard x cp leaves after ep."""
        return self.fsdp // self.ep

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def pipeline_microbatches(self) -> int:
        """Microbatches of one pipeline step (1 without a pipeline: each microbatch is its own forward/backward)."""
        return self.microbatches // self.grad_accum_steps if self.pp > 1 else 1

    @property
    def local_batch_size(self) -> int:
        """training.local_batch_size: sequences one pipeline step (or one forward) takes on a data-parallel rank."""
        return self.microbatch_size * self.pipeline_microbatches

    def describe(self) -> str:
        names = ("dp_replicate", "dp_shard", "tp", "pp", "cp") + (("ep",) if self.ep > 1 else ())
        degrees = [f"{name}={getattr(self, name)}" for name in names]
        ac = f"{self.ac}(k={self.every_k_layers})" if self.ac == "selective_layer" else self.ac
        text = ",".join(degrees) + f" ac={ac} mbs={self.microbatch_size}x{self.microbatches}"
        if self.pp > 1:
            text += f" {self.pipeline_schedule}"
        if self.optimizer != "AdamW":
            text += f" {self.optimizer}"
        text += f" loss_chunk={self.loss_chunk_tokens}" if self.loss_chunk_tokens else ""
        text += f" float8 {self.float8_recipe}" if self.float8 else ""
        return text + (" compile" if self.compile else "")

    def block_ac_modes(self, block_ids: range) -> list[str]:
        """The checkpointing mode of each block, by its index in the whole model (the rule of
        `meshloom.parallel.activation_checkpoint.checkpointed_block_ids`)."""
        if self.ac == "selective_layer":
            return ["full" if (i + 1) % self.every_k_layers == 0 else "none" for i in block_ids]
        return [self.ac] * len(block_ids)


@dataclass(frozen=True)
class Precision:
    """bf16 = FSDP's MixedPrecisionPolicy (or autocast without FSDP); fp32 everywhere otherwise."""

    mixed_precision: str = "fp32"
    reduce_dtype_bytes: int = FP32
    # The device kind whose kernels run the model ("cuda" or "cpu"): on CPU, SDPA has no fused kernel for unequal
    # query and value head sizes, nor FlexAttention a trainable one, and their eager paths keep what a fused kernel
    # does not (ShapeModel.with_math_attention).
    device: str = "cuda"
    # Bytes per element of the sharded parameters, their reduced gradients and the optimizer's moments: meshloom keeps
    # fp32 masters; a framework that builds the model in bf16 (NeMo AutoModel's `from_config`) keeps all three in bf16.
    master_bytes: int = FP32
    # Bytes per element of the logits the loss takes and of the loss's vocabulary-wide tensors: meshloom upcasts them
    # to fp32; a loss without the upcast (AutoModel's MaskedCrossEntropy with fp32_upcast false) runs in bf16.
    loss_bytes: int = FP32
    # Whether routed experts that FSDP leaves whole (dp_shard x cp / ep = 1) are still FSDP units: meshloom wraps them,
    # so its fp32 masters are cast and gathered by the unit. NeMo AutoModel leaves them out of FSDP (its MoE
    # parallelizer shards experts only over an ep_shard mesh larger than 1 and passes them to the block as ignored
    # parameters), so their gradients are autograd's, in the parameters' dtype, and nothing gathers them.
    fsdp_wraps_whole_experts: bool = True
    # Whether compile (Layout.compile) compiles the loss too: meshloom's build_loss_fn does (unless loss parallel
    # keeps it eager); torchtitan's train.py of December 2024 left it eager ("compiling loss function causes CUDA
    # errors, turning off for now").
    compiled_loss: bool = True

    @property
    def compute_bytes(self) -> int:
        return 2 if self.mixed_precision == "bf16" else FP32


def layout_of(plan: RunPlan) -> Layout:
    """The layout a planned run uses."""
    config, dims = plan.config, plan.dims
    ac = config.activation_checkpoint.mode
    if ac not in ESTIMATED_AC_MODES:
        raise ConfigError(
            f"activation_checkpoint.mode = {ac!r} has no memory model; estimates cover {', '.join(ESTIMATED_AC_MODES)}"
        )
    every_k_layers = config.activation_checkpoint.every_k_layers if ac == "selective_layer" else 1
    pipe = plan.pipeline
    reshard = config.parallelism.fsdp_reshard_after_forward != "never"
    if pipe is not None:
        microbatch_size = config.training.local_batch_size // pipe.microbatches
        microbatches = pipe.microbatches * plan.grad_accum_steps
        schedule, stages_per_rank = pipe.schedule, pipe.stages_per_rank
        counts = tuple(len(layers) for layers in pipe.stage_layers)
        reshard = pipe.fsdp_reshard_after_forward != "never"
    else:
        microbatch_size, microbatches, schedule = config.training.local_batch_size, plan.grad_accum_steps, "1F1B"
        stages_per_rank, counts = 1, ()
    return Layout(
        dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.cp, ac, microbatch_size, microbatches, schedule,
        every_k_layers, dims.ep, stages_per_rank, counts, plan.grad_accum_steps, config.optimizer.name,
        config.float8.enable, reshard, config.float8.recipe, config.float8.fsdp_float8_all_gather, config.compile.enable, config.loss.chunk_tokens if config.loss.chunked else 0,
    )  # fmt: skip


def precision_from_config(config: Config, device: str | None = None) -> Precision:
    """The precision of a run, its kernels counted for `device` ("cuda" or "cpu"); by default training.device, with
    "auto" counted as GPUs: layouts are planned and dry-run on hosts without the GPUs they are for."""
    reduce_bytes = 2 if config.parallelism.fsdp_reduce_dtype == "bfloat16" else 4
    device = device or ("cpu" if config.training.device == "cpu" else "cuda")
    return Precision(config.training.mixed_precision, reduce_bytes, device)


def layout_settings(layout: Layout) -> dict[str, dict[str, object]]:
    """TOML sections that make a run use `layout` (global batch = microbatch size x microbatches x dp)."""
    settings: dict[str, dict[str, object]] = {
        "parallelism": {
            "dp_replicate": layout.dp_replicate,
            "dp_shard": layout.dp_shard,
            "tp": layout.tp,
            "pp": layout.pp,
            "cp": layout.cp,
            "ep": layout.ep,
        },
        "training": {
            "local_batch_size": layout.local_batch_size,
            "global_batch_size": layout.microbatch_size * layout.microbatches * layout.dp,
        },
        "optimizer": {"name": layout.optimizer},
        "activation_checkpoint": {"mode": layout.ac},
        "float8": {"enable": layout.float8},
    }
    # Only the Float8 settings that act on this layout (a setting that cannot act is refused, setting_scopes.py).
    if layout.float8:
        settings["float8"]["recipe"] = layout.float8_recipe
        if layout.float8_recipe == "tensorwise" and (layout.dp_shard * layout.cp > 1 or layout.dp_replicate > 1):
            settings["float8"]["fsdp_float8_all_gather"] = layout.float8_all_gather
    if layout.ac == "selective_layer":
        settings["activation_checkpoint"]["every_k_layers"] = layout.every_k_layers
    if layout.loss_chunk_tokens:
        settings["loss"] = {"chunked": True, "chunk_tokens": layout.loss_chunk_tokens}
    if layout.pp > 1:
        pipeline: dict[str, object] = {
            "schedule": layout.pipeline_schedule,
            "microbatches": layout.pipeline_microbatches,
            "stages_per_rank": layout.stages_per_rank,
        }
        counts = list(layout.stage_layer_counts)
        if counts and counts != even_stage_split(sum(counts), len(counts), layout.pp, layout.stages_per_rank):
            starts = [sum(layout.stage_layer_counts[:i]) for i in range(1, len(layout.stage_layer_counts))]
            pipeline["split_points"] = ",".join(map(str, starts))
        settings["pipeline"] = pipeline
    return settings


def layout_config(base: Config, layout: Layout) -> Config:
    """`base` with the settings of `layout` (those of `layout_settings`), without parsing any text."""
    sections = {}
    for name, values in layout_settings(layout).items():
        sections[name] = dataclasses.replace(getattr(base, name), **values)
    return dataclasses.replace(base, **sections)
