"""The typed configuration of a run: one dataclass per concern (how a run is watched, saved and tested is in
operations.py).

Each field's docstring (the string literal under it) is the user-facing help text:
`meshloom train --help` reads it from this file, so keep them short and true.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from meshloom.config.fault_tolerance import FaultToleranceConfig
from meshloom.config.kernels import KernelsConfig
from meshloom.config.loss import LossConfig
from meshloom.config.operations import (CheckpointConfig, CommConfig, FaultInjectionConfig, MetricsConfig,
                                       ProfilingConfig, ValidationConfig)


@dataclass
class JobConfig:
    dump_folder: str = "runs/debug"
    """Run folder: metrics.jsonl, TensorBoard events, checkpoints and diagnostics go here."""

    description: str = ""
    """Free text shown at start-up and stored with the run."""


@dataclass
class ModelConfig:
    name: str = "llama3"
    """Model family in the registry (`meshloom train --help` lists the built-in ones under model.flavor)."""

    flavor: str = "debug"
    """Size preset of the family (`meshloom train --help` lists every built-in family's presets below this line)."""

    plugin: str = ""
    """A Python module to import before the family is looked up, so that it can register families of its own with
    meshloom.models.registry.register_model (e.g. "my_project.models"); empty = built-in families only."""

    n_layers: int = 0
    """Number of transformer blocks, overriding the flavour's; 0 keeps the flavour's value."""

    mtp_depth: int = -1
    """Multi-token prediction modules (families that have them, e.g. deepseek_v3), overriding the flavour's;
    0 = none, -1 keeps the flavour's value."""


@dataclass
class TrainingConfig:
    steps: int = 200
    """Number of optimizer steps."""

    local_batch_size: int = 8
    """Sequences per forward pass on each data-parallel rank (one microbatch)."""

    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks; -1 = local_batch_size x data-parallel degree.
    A multiple of that product turns into gradient accumulation."""

    seq_len: int = 256
    """Tokens per sequence; at most the model flavour's max_seq_len."""

    max_norm: float = 1.0
    """Gradient clipping threshold on the global L2 norm; 0 disables clipping (the norm is still logged and checked)."""

    seed: int = 42
    """Seed for weight init, data order and every RNG."""

    deterministic: bool = False
    """Use deterministic algorithms only (bitwise-reproducible runs, somewhat slower)."""

    mixed_precision: Literal["fp32", "bf16"] = "fp32"
    """Compute dtype: fp32, or bf16 autocast with fp32 master weights."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: auto picks CUDA when present, else CPU."""

    nonfinite: Literal["halt", "skip_step", "rollback"] = "halt"
    """On a NaN/inf loss or gradient norm: halt (write a diagnostic dump and stop), skip_step (drop the update) or
    rollback (write the dump, reload the latest checkpoint and skip the offending batch; needs checkpoint.enable)."""

    max_rollbacks: int = 3
    """nonfinite = rollback: stop as halt does after this many rollbacks in one run."""


@dataclass
class OptimizerConfig:
    name: Literal["AdamW", "Muon"] = "AdamW"
    """AdamW for every parameter, or Muon for hidden weight matrices (and each expert matrix) with AdamW for the
    rest (embeddings, output head, norms, biases, routers), both on the same LR schedule."""

    lr: float = 8e-4
    """Peak learning rate, reached at the end of warm-up."""

    beta1: float = 0.9
    """AdamW first-moment decay."""

    beta2: float = 0.95
    """AdamW second-moment decay."""

    eps: float = 1e-8
    """AdamW epsilon."""

    weight_decay: float = 0.1
    """Decoupled weight decay; never applied to norms or biases."""

    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"
    """Kernel choice: auto = fused on CUDA, foreach elsewhere."""

    muon_lr: float = 0.0
    """Muon only: peak learning rate of the Muon matrices; 0 = optimizer.lr (right for muon_adjust_lr = match_rms_adamw)."""

    muon_momentum: float = 0.95
    """Muon only: momentum of the Muon matrices' update."""

    muon_nesterov: bool = True
    """Muon only: use Nesterov momentum."""

    muon_ns_steps: int = 5
    """Muon only: Newton-Schulz iterations that orthogonalise each update (in optimizer.muon_ns_dtype)."""

    muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Muon only: dtype of the Newton-Schulz iterations (and of the update shards sent to the rank that runs them).
    auto = bfloat16 on CUDA (torch.optim.Muon's choice: half the traffic, fast on GPUs) and float32 on CPU (bf16 matmul
    there is about 10x slower without native bf16 instructions, and fp32 keeps a layout's result within fp32 rounding of
    one process's, where bf16 rounding turns last-bit gradient differences into visible loss drift)."""

    muon_adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Muon only: per-matrix learning-rate scale, 0.2*sqrt(max(m, n)) so updates match AdamW's RMS (reuse AdamW's lr and
    weight decay), or sqrt(max(1, m/n)) as in the original Muon (wants a larger muon_lr)."""

    qk_clip_threshold: float = 0.0
    """QK-clip (Kimi K2's MuonClip) with any optimizer: after each update, scale the query and key rows of every attention
    head whose largest logit (q.k/sqrt(head_dim)) this step exceeded tau down to at most tau; 0 = off (K2 used 100)."""


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = 20
    """Steps of linear warm-up from near zero to optimizer.lr."""

    decay_type: Literal["linear", "cosine", "wsd"] = "cosine"
    """Shape after warm-up: linear or cosine decay to the minimum, or warmup-stable-decay."""

    decay_ratio: float = 0.2
    """wsd only: fraction of all steps spent in the final linear decay."""

    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of optimizer.lr."""


@dataclass
class DataConfig:
    path: str = ""
    """Folder of text files to train on; empty = the built-in corpus (this interpreter's standard-library source)."""

    glob: str = "**/*.txt"
    """Files of data.path to read (ignored for the built-in corpus, which reads *.py)."""

    max_bytes: int = 12_000_000
    """Read at most this many bytes of the corpus (whole files, in sorted order); 0 = no cap."""

    tokenizer: str = "builtin"
    """builtin (byte-level BPE trained on the corpus and cached), a HF tokenizer.json, or a tiktoken BPE file."""

    vocab_size: int = 2048
    """Vocabulary of the built-in BPE; must not exceed the model's vocab_size."""

    validation_fraction: float = 0.02
    """Share of documents held out for validation (chosen by a hash of the document id; in shards its index,
    when streaming its text)."""

    cache_dir: str = ""
    """Where the trained tokenizer and token arrays are cached; empty = ~/.cache/meshloom."""

    dataset: Literal["builtin", "shards", "streaming"] = "builtin"
    """builtin: data.path (or the built-in corpus) tokenized in memory; shards: folders made by `meshloom prepare`
    (data.shards); streaming: data.stream read with `datasets` streaming while training."""

    shards: str = ""
    """dataset=shards: prepared folders, comma-separated, each optionally weighted as FOLDER:WEIGHT (default 1)."""

    sampling: Literal["document", "chunk"] = "document"
    """dataset=shards: document = shuffle documents each epoch, then pack them; chunk = pack in stored order,
    shuffle the seq_len windows."""

    document_mask: bool = False
    """Attention stays inside each packed document (block-diagonal causal mask)."""

    stream: str = ""
    """dataset=streaming: a .jsonl/.json/.parquet/.arrow/.txt file, folder or glob read with `datasets` streaming, or
    hf:NAME."""

    stream_workers: int = 0
    """dataset=streaming: threads that tokenize the stream ahead of training (a reader thread keeps them fed, in
    order); 0 = read and tokenize in the training loop when a batch is needed."""

    text_field: str = "text"
    """Field holding a document's text in .jsonl/.parquet/`datasets` records (prepare and streaming)."""

    bad_input: Literal["error", "skip"] = "error"
    """A non-UTF-8 line, missing text field, empty document or one longer than a shard: error (stop, naming it)
    or skip (drop and count it)."""

    stages: list[dict[str, Any]] = field(default_factory=list)
    """dataset=shards: mixture stages after the data.shards weights, in order. Each is a table with start_step (or
    start_tokens), weights (source name -> positive weight; a source left out is not drawn) and optionally
    transition = "linear" with transition_steps (or transition_tokens); the default transition is a step."""

    max_epochs: dict[str, int] = field(default_factory=dict)
    """dataset=shards: epochs a source may serve, by source name (its folder's name), e.g. {code = 2}; unlisted = no
    limit. What happens then is data.on_exhausted."""

    on_exhausted: Literal["repeat", "drop"] = "repeat"
    """A source that has served data.max_epochs: repeat (another epoch in a new seeded order) or drop (it leaves the
    mixture and its share goes to the other sources). Either is logged."""

    allow_mixture_change: bool = False
    """Resume with other data.shards weights, data.stages or data.max_epochs than the checkpoint's: each source
    continues where it was and the new mixture applies from the resume point on (logged)."""


@dataclass
class ParallelismConfig:
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP's replicate dimension); parameters are not sharded across it."""

    dp_shard: int = -1
    """FSDP shard degree; -1 = whatever the world size leaves after the other degrees."""

    tp: int = 1
    """Tensor-parallel degree, with sequence parallel on the norms and loss parallel on the output."""

    pp: int = 1
    """Pipeline-parallel degree."""

    cp: int = 1
    """Context-parallel degree (sequence split across ranks)."""

    resize: Literal["none", "dp_shard", "dp_replicate"] = "none"
    """How the layout follows a world size other than the degrees give (elastic runs: torchrun --nnodes MIN:MAX
    after a node is lost or rejoins). none = the degrees as set (dp_shard = -1 still takes what is left);
    dp_shard = keep dp_replicate, tp, pp, cp and let dp_shard absorb the change; dp_replicate = keep dp_shard, tp,
    pp, cp and let the number of HSDP replicas change (dp_shard must be a number). Set training.global_batch_size
    to keep the batch, and with it the loss curve, when the data-parallel degree changes."""

    cp_load_balance: bool = True
    """With cp > 1: split each sequence head-tail (rank r holds chunks r and 2*cp-1-r of 2*cp), which gives every
    rank equal causal-attention work; false = cp contiguous chunks. training.seq_len must divide into the chunks."""

    cp_document_balance: bool = False
    """With cp > 1 and data.document_mask: cut each batch into cp x cp_document_chunks chunks and deal them to the cp
    ranks by attention work given where its documents fall (the visible query-key pairs of each chunk), instead of
    cp_load_balance's fixed split. The metric cp_attention_imbalance (largest / mean rank work) shows the effect."""

    cp_document_chunks: int = 4
    """Chunks per cp rank for cp_document_balance: more balance finer but make more, smaller attention blocks.
    training.seq_len must divide into cp x cp_document_chunks chunks."""

    ep: int = 1
    """Expert-parallel degree (mixture-of-experts models only): each MoE layer's routed experts are split over ep ranks
    borrowed from dp_shard x cp (no extra ranks), tokens travel to their experts and back by all-to-all, and FSDP
    shards each expert over the dp_shard x cp / ep ranks left. Must divide the routed experts and dp_shard x cp."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward: default = yes except the root module, which backward needs first."""

    fsdp_reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of FSDP gradient reduce-scatter; parameters are gathered in training.mixed_precision's dtype."""

    fsdp_cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory (CUDA only saves memory)."""

    loss_parallel: bool = True
    """With tp > 1, compute the loss on vocabulary-sharded logits instead of gathering them."""

    init: Literal["auto", "full", "sharded"] = "auto"
    """full: each rank initialises the whole model from training.seed, then shards it, so any layout starts from
    the 1-process weights; sharded: build on meta and initialise only local shards (large models);
    auto: full below 2B parameters."""


@dataclass
class PipelineConfig:
    schedule: Literal[
        "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
    ] = "1F1B"
    """Pipeline schedule when parallelism.pp > 1 (torch.distributed.pipelining); ZBVZeroBubble and DualPipeV
    place two stages per rank in a V."""

    microbatches: int = 0
    """Microbatches each pipeline step splits training.local_batch_size into (must divide it);
    0 = local_batch_size, one sequence per microbatch."""

    stages_per_rank: int = 0
    """Model stages on each pipeline rank; 0 = 1 for GPipe and 1F1B, 2 for the others (V schedules need exactly 2)."""

    split_points: str = ""
    """Layers that start a new stage, comma-separated, by index or name (e.g. "3,6" or "layers.3,layers.6"),
    pp x stages_per_rank - 1 of them; empty = split the layers evenly."""


@dataclass
class CompileConfig:
    enable: bool = False
    """Compile each transformer block (fullgraph) and the loss with torch.compile (inductor). Compiled kernels are
    cached on disk (TORCHINDUCTOR_CACHE_DIR, or compile.cache_dir), so later runs start faster."""

    cache_dir: str = ""
    """Inductor's on-disk cache; empty = TORCHINDUCTOR_CACHE_DIR if set, else torch's default
    (<temp folder>/torchinductor_<user>)."""

    async_tp: bool = False
    """CUDA only, with parallelism.tp > 1 and compile.enable: overlap tensor-parallel collectives with matmuls
    (symmetric memory plus inductor's micro-pipeline TP pass)."""


@dataclass
class ActivationCheckpointConfig:
    mode: Literal["none", "full", "selective_layer", "selective_op", "memory_budget"] = "none"
    """none; full (recompute every block in backward); selective_layer (every k-th block, see every_k_layers);
    selective_op (keep the outputs of save_ops, recompute the rest); memory_budget (compile's partitioner keeps
    a fraction of activations, see memory_budget; needs compile.enable)."""

    every_k_layers: int = 2
    """selective_layer: checkpoint blocks k, 2k, 3k, ... (counting from 1)."""

    save_ops: str = "default"
    """selective_op: comma-separated ops whose outputs are kept, e.g. "aten.mm,aten._scaled_dot_product_flash_attention_for_cpu";
    default = matmuls plus every attention kernel (CUDA and CPU), Float8 matmuls and amax reductions."""

    memory_budget: float = 0.5
    """memory_budget: fraction of activation memory to keep (0 = recompute as much as possible, 1 = keep all)."""


@dataclass
class Float8Config:
    enable: bool = False
    """Train the transformer blocks' linear layers in float8 (torchao). The output projection and any layer whose
    (tensor-parallel local) dims are not multiples of 16 stay in high precision."""

    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """Scaling granularity: one scale per tensor (fastest) or per row (more accurate)."""

    fsdp_float8_all_gather: bool = True
    """tensorwise with FSDP: all-gather weights in float8, with one amax/scale all-reduce per step for all weights."""


@dataclass
class MoEConfig:
    """Training settings of mixture-of-experts layers (ignored by dense models)."""

    bias_update_rate: float = 0.001
    """Aux-loss-free balancing: after each optimizer step every MoE layer's per-expert routing bias moves by this much,
    up for experts that got fewer tokens than the mean over the global batch, down for more (DeepSeek-V3: 0.001);
    0 = no balancing bias."""

    aux_loss_coef: float = 0.0
    """Weight of the sequence-wise auxiliary balance loss (DeepSeek-V3's, e.g. 1e-4); 0 = off."""

    z_loss_coef: float = 0.0
    """Weight of the router z-loss (mean squared log-sum-exp of the router logits, e.g. 1e-3); 0 = off."""

    grouped_mm: Literal["auto", "on", "off"] = "auto"
    """Routed experts: on = one torch._grouped_mm per weight, off = a loop over experts, auto = grouped where the
    device and dtype allow it (CPU fp32/bf16, CUDA bf16 on sm90+)."""


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    float8: Float8Config = field(default_factory=Float8Config)
    moe: MoEConfig = field(default_factory=MoEConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    fault_injection: FaultInjectionConfig = field(default_factory=FaultInjectionConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)

    def __post_init__(self) -> None:
        # The keys the user gave, even at their default value (a setting that cannot act is refused however it was
        # written); None: not built from user input. Not a field, so never saved or compared.
        self.given: set[str] | None = None
