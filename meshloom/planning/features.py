"""Every feature of a run, what turns it on and which pairs cannot train together: one declaration, with
setting_scopes.py (where each setting acts).

- `RunPlan.build` reads it through `refuse_conflicts` (and `refuse_idle_settings` of setting_scopes.py, where each
  setting acts), before any process group exists, so train, --dry-run, plan, eval and generate refuse a pair or an
  idle setting the same way, in one line that names both settings and the reason.
- `docs/compatibility.md` is generated from it together with the pairwise matrix (meshloom/testing/matrix.py): every
  pair of the table's features is either proven by a test or refused here (meshloom/testing/compatibility.py).
- A new feature or family is added here, to the matrix's axes and to the table in the same change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from meshloom.config.errors import ConfigError
from meshloom.parallel.document_balance import planned_layout
from meshloom.parallel.pipeline import SCHEDULES
from meshloom.planning.facts import Condition, Facts


# The first torch release whose AOTAutograd fails on a compiled block that is checkpointed whole under tensor parallel
# (tests/test_torch_compile_whole_block_ac_tp.py reproduces it): seen on 2.13.0 (CPU); 2.11.0 trains the same block on
# CUDA and on CPU. 2.12 was not tried and is refused with 2.13.
WHOLE_BLOCK_AC_TP_FAILS_FROM = (2, 12)




@dataclass(frozen=True)
class Feature:
    name: str
    """Short id, used by the matrix and the table."""

    title: str
    """How the table heads its row and column."""

    setting: str
    """The setting that turns it on, as a user writes it (the refusal line names it)."""

    on: Condition
    """Whether a run has it."""

    witness: tuple[str, ...] = ()
    """Command-line settings that turn it on in the parity harness's tiny run (the refusal tests build them)."""


@dataclass(frozen=True)
class Conflict:
    """Two features that cannot train together (or a feature and what it needs but lacks), with the reason."""

    first: str
    second: str
    reason: str
    fix: str
    when: Condition = lambda facts: True
    """A further condition, beyond both features being on."""

    when_witness: tuple[str, ...] = ()
    """Command-line settings that make `when` true in the parity harness's tiny run (the refusal tests add them)."""

    detail: Callable[[Facts], str] = lambda facts: ""
    """The run's own numbers or the family's own reason, appended to `reason` when the run's facts are known."""

    def line(self, facts: Facts | None = None) -> str:
        """The refusal; with the run's facts, a feature that a model has by its shape names the model."""
        model = f"{facts.config.model.name} {facts.config.model.flavor}" if facts else "the model.flavor"
        a, b = (FEATURES[name].setting.format(model=model) for name in (self.first, self.second))
        ta, tb = FEATURES[self.first].title, FEATURES[self.second].title
        detail = self.detail(facts) if facts else ""
        return f"{a} ({ta}) with {b} ({tb}): {self.reason}{detail}; {self.fix}"


def _ft(kind: str) -> Condition:
    return lambda f: f.config.fault_tolerance.enable and f.config.fault_tolerance.semi_sync == kind


_DEFINED = [
    # Layouts (degrees combine).
    Feature("fsdp", "FSDP", "parallelism.dp_shard > 1", lambda f: f.dims.dp_shard > 1, ("--parallelism.dp_shard", "2")),
    Feature("hsdp", "HSDP", "parallelism.dp_replicate > 1", lambda f: f.dims.dp_replicate > 1, ("--parallelism.dp_replicate", "2")),
    Feature("tp", "TP", "parallelism.tp > 1", lambda f: f.dims.tp > 1, ("--parallelism.tp", "2")),
    Feature("pp", "PP", "parallelism.pp > 1", lambda f: f.dims.pp > 1, ("--parallelism.pp", "2")),
    Feature("cp", "CP", "parallelism.cp > 1", lambda f: f.dims.cp > 1, ("--parallelism.cp", "2")),
    Feature(
        "ep", "EP", "parallelism.ep > 1", lambda f: f.dims.ep > 1,
        ("--parallelism.dp_shard", "2", "--parallelism.ep", "2"),
    ),
    # Memory and speed.
    Feature(
        "ac_full", "AC full", "activation_checkpoint.mode = 'full'",
        lambda f: f.config.activation_checkpoint.mode == "full", ("--activation_checkpoint.mode", "full"),
    ),
    Feature(
        "ac_selective", "AC selective", "activation_checkpoint.mode = 'selective_op'",
        lambda f: f.config.activation_checkpoint.mode in ("selective_op", "selective_layer"),
        ("--activation_checkpoint.mode", "selective_op"),
    ),
    Feature("compile", "compile", "compile.enable", lambda f: f.config.compile.enable, ("--compile.enable", "true")),
    Feature("float8", "Float8", "float8.enable", lambda f: f.config.float8.enable, ("--float8.enable", "true")),
    Feature("chunked_loss", "chunked loss", "loss.chunked", lambda f: f.config.loss.chunked, ("--loss.chunked", "true")),
    # Optimizer.
    Feature("muon", "Muon", "optimizer.name = 'Muon'", lambda f: f.config.optimizer.name == "Muon", ("--optimizer.name", "Muon")),
    Feature(
        "qk_clip", "QK-clip", "optimizer.qk_clip_threshold > 0", lambda f: f.config.optimizer.qk_clip_threshold > 0,
        ("--optimizer.qk_clip_threshold", "1.0"),
    ),
    # Data.
    Feature(
        "shards", "shards + stages", "data.dataset = 'shards'", lambda f: f.config.data.dataset == "shards",
        ("--data.dataset", "shards"),
    ),
    Feature(
        "streaming", "streaming", "data.dataset = 'streaming'", lambda f: f.config.data.dataset == "streaming",
        ("--data.dataset", "streaming", "--data.stream", "stream.jsonl"),
    ),
    Feature("document_mask", "document masks", "data.document_mask", lambda f: f.config.data.document_mask, ("--data.document_mask", "true")),
    # Fault tolerance and resume.
    Feature(
        "replica_groups", "replica groups", "fault_tolerance.enable", _ft(""), ("--fault_tolerance.enable", "true"),
    ),
    Feature(
        "diloco", "DiLoCo", "fault_tolerance.semi_sync = 'diloco'", _ft("diloco"),
        ("--fault_tolerance.enable", "true", "--fault_tolerance.semi_sync", "diloco"),
    ),
    Feature(
        "local_sgd", "LocalSGD", "fault_tolerance.semi_sync = 'local_sgd'", _ft("local_sgd"),
        ("--fault_tolerance.enable", "true", "--fault_tolerance.semi_sync", "local_sgd"),
    ),
    # Features the matrix does not vary, with constraints of their own.
    Feature(
        "moe_aux_loss", "sequence-wise balance loss", "moe.aux_loss_coef > 0",
        lambda f: f.n_experts > 0 and f.config.moe.aux_loss_coef > 0,
        ("--model.name", "qwen3", "--model.flavor", "tiny_moe", "--moe.aux_loss_coef", "0.001"),
    ),
    Feature(
        "moe_bias", "MoE bias balancing", "moe.bias_update_rate > 0",
        lambda f: f.n_experts > 0 and f.config.moe.bias_update_rate > 0,
        ("--model.name", "qwen3", "--model.flavor", "tiny_moe", "--moe.bias_update_rate", "0.01"),
    ),
    Feature(
        "expert_loop", "expert loop", "moe.grouped_mm = 'off'", lambda f: f.n_experts > 0 and f.config.moe.grouped_mm == "off",
        ("--model.name", "qwen3", "--model.flavor", "tiny_moe", "--moe.grouped_mm", "off"),
    ),
    Feature(
        "ac_whole_blocks", "AC of whole blocks", "activation_checkpoint.mode = 'full' or 'selective_layer'",
        lambda f: f.config.activation_checkpoint.mode in ("full", "selective_layer"), ("--activation_checkpoint.mode", "full"),
    ),
    Feature(
        "ac_memory_budget", "AC memory budget", "activation_checkpoint.mode = 'memory_budget'",
        lambda f: f.config.activation_checkpoint.mode == "memory_budget", ("--activation_checkpoint.mode", "memory_budget"),
    ),
    Feature(
        "flex_attention", "FlexAttention", "{model}", lambda f: f.attention_kernel == "flex", ("--model.name", "gpt_oss"),
    ),
    Feature(
        "hf_export", "Hugging Face export", "checkpoint.hf_export_interval > 0", lambda f: f.config.checkpoint.hf_export_interval > 0,
        ("--checkpoint.hf_export_interval", "10"),
    ),
    Feature("dense", "a dense model", "{model}", lambda f: f.n_experts == 0, ("--model.name", "llama3")),
    Feature(
        "no_compile", "eager", "compile.enable = false", lambda f: not f.config.compile.enable, ("--compile.enable", "false"),
    ),
    Feature(
        "rollback", "rollback on NaN", "training.nonfinite = 'rollback'", lambda f: f.config.training.nonfinite == "rollback",
        ("--training.nonfinite", "rollback", "--checkpoint.enable", "true"),
    ),
    # What a model is by its shape or its files, with constraints of their own.
    Feature("no_qk_clip", "attention QK-clip cannot rescale per head", "{model}", lambda f: bool(f.qk_clip_refusal), ("--model.name", "qwen3")),
    Feature("tied_embeddings", "tied embeddings", "{model}", lambda f: f.tie_embeddings, ("--model.flavor", "1B", "--model.n_layers", "2")),
    Feature(
        "no_hf_shape", "a model its Hugging Face format cannot hold", "{model}", lambda f: bool(f.hf_export_refusal),
        ("--model.name", "deepseek_v3", "--model.flavor", "16B", "--moe.bias_update_rate", "0"),
    ),
    Feature("mtp", "multi-token prediction", "{model}", lambda f: f.mtp_depth > 0, ("--model.name", "deepseek_v3", "--moe.bias_update_rate", "0")),
    Feature(
        "zero_bubble", "a zero-bubble pipeline schedule", "pipeline.schedule = 'InterleavedZeroBubble', 'ZBVZeroBubble' or 'DualPipeV'",
        lambda f: f.dims.pp > 1 and SCHEDULES[f.config.pipeline.schedule].zero_bubble,
        ("--parallelism.pp", "2", "--pipeline.schedule", "ZBVZeroBubble", "--model.n_layers", "4"),
    ),
    Feature(
        "fsdp_reshard_always", "FSDP resharding after forward", "parallelism.fsdp_reshard_after_forward = 'always'",
        lambda f: f.config.parallelism.fsdp_reshard_after_forward == "always" and (f.dims.fsdp_enabled or f.dims.dp_replicate > 1),
        ("--parallelism.dp_shard", "2", "--training.local_batch_size", "4", "--parallelism.fsdp_reshard_after_forward", "always"),
    ),
    Feature(
        "shared_bos_eos", "a tokenizer whose bos is its eos", "data.tokenizer", lambda f: f.shared_bos_eos,
        ("--data.tokenizer", "{tmp}/shared_bos_eos.json"),
    ),
    Feature(
        "no_checkpoints", "no checkpoints", "checkpoint.enable = false", lambda f: not f.config.checkpoint.enable,
        ("--checkpoint.enable", "false"),
    ),
    Feature(
        "elastic_resize", "elastic resize", "parallelism.resize", lambda f: f.config.parallelism.resize != "none",
        ("--parallelism.resize", "dp_shard"),
    ),
]
FEATURES: dict[str, Feature] = {feature.name: feature for feature in _DEFINED}

def _cp_chunk(f: Facts) -> int:
    """Tokens in one context-parallel chunk of a sequence."""
    return f.config.training.seq_len // planned_layout(f.dims.cp, f.config.parallelism).num_chunks


_REPLICA_KINDS = ("replica_groups", "diloco", "local_sgd")

CONFLICTS: tuple[Conflict, ...] = (
    *(
        Conflict(
            kind, "hsdp",
            "the replica groups are the replicate dimension, so a group cannot replicate inside itself",
            "set parallelism.dp_replicate = 1 and launch fault_tolerance.group_size groups instead",
        )
        for kind in _REPLICA_KINDS
    ),
    *(
        Conflict(
            kind, "streaming",
            "a group that joins late or restarts receives a live group's stream position, which belongs to another "
            "data-parallel rank's stream and cannot be taken over",
            "use data.dataset = 'shards' (prepared with `meshloom prepare`), whose position any group can take",
        )
        for kind in _REPLICA_KINDS
    ),
    *(
        Conflict(
            kind, "pp",
            "semi-synchronous training syncs one whole model per group, not pipeline stages",
            "set parallelism.pp = 1 or fault_tolerance.semi_sync = ''",
        )
        for kind in ("diloco", "local_sgd")
    ),
    *(
        Conflict(
            kind, "moe_bias",
            "each group trains alone between syncs, and the syncs average parameters only, so every group's expert "
            "biases follow its own token counts and drift apart",
            "set moe.bias_update_rate = 0 (balance with moe.aux_loss_coef) or fault_tolerance.semi_sync = ''",
        )
        for kind in ("diloco", "local_sgd")
    ),
    *(
        Conflict(
            kind, "qk_clip",
            "the sync runs inside the optimizer step and QK-clip rescales after it with each group's own maxima, so "
            "the groups' weights differ after every sync that clips",
            "set optimizer.qk_clip_threshold = 0 or fault_tolerance.semi_sync = ''",
        )
        for kind in ("diloco", "local_sgd")
    ),
    *(
        Conflict(
            kind, "rollback",
            "a rollback would reload a disk checkpoint in one group only",
            "choose training.nonfinite = 'halt' or 'skip_step'",
        )
        for kind in _REPLICA_KINDS
    ),
    Conflict(
        "qk_clip", "no_qk_clip",
        "QK-clip rescales each attention head's query and key projections, and this model family does not offer it",
        "set optimizer.qk_clip_threshold = 0", detail=lambda f: f" ({f.qk_clip_refusal})",
    ),
    Conflict(
        "pp", "tied_embeddings",
        "this model ties its output projection to the embedding, but pipeline parallelism puts them on different stages",
        "use an untied model flavour or set parallelism.pp = 1",
    ),
    Conflict(
        "hf_export", "no_hf_shape",
        "the exports would not hold this model", "set checkpoint.hf_export_interval = 0 or use a flavour the format holds",
        detail=lambda f: f" ({f.hf_export_refusal})",
    ),
    Conflict(
        "mtp", "cp",
        "multi-token prediction reads labels past a context-parallel chunk's end from the next chunk only, so a chunk "
        "must hold at least as many tokens as it looks ahead",
        "use a longer training.seq_len or a smaller parallelism.cp",
        when=lambda f: f.mtp_depth > _cp_chunk(f), when_witness=("--training.seq_len", "4"),
        detail=lambda f: f" (it looks {f.mtp_depth} tokens ahead; training.seq_len = {f.config.training.seq_len} makes chunks of {_cp_chunk(f)})",
    ),
    Conflict(
        "zero_bubble", "fsdp_reshard_always",
        "these schedules compute weight gradients after FSDP would reshard the parameters, which gives wrong gradients "
        "in torch 2.13 (loss off by 3e-4 to 9e-2 within 5 steps)",
        "set parallelism.fsdp_reshard_after_forward = default (kept gathered for these schedules) or never, or pick a "
        "schedule without zero bubble (1F1B, Interleaved1F1B, ...)",
    ),
    Conflict(
        "document_mask", "shared_bos_eos",
        "the built-in dataset finds where documents start at each bos, and this tokenizer uses one id for bos and eos",
        "use data.dataset = 'shards' (its index stores the starts) or a tokenizer with distinct bos and eos",
        when=lambda f: f.config.data.dataset == "builtin",
    ),
    Conflict(
        "rollback", "no_checkpoints",
        "a rollback reloads the latest checkpoint, and this run saves none",
        "set --checkpoint.enable true (with a checkpoint.interval) or choose training.nonfinite = 'halt' or 'skip_step'",
    ),
    Conflict(
        "elastic_resize", "streaming",
        "a resized run has another number of data-parallel ranks, and each streaming rank's read position belongs "
        "to its own slice of the stream",
        "use data.dataset = 'shards', whose position is reshared over any number of ranks, or parallelism.resize = 'none'",
    ),
    Conflict(
        "dense", "ep",
        "expert parallel splits the routed experts of a mixture-of-experts model, and this model has none",
        "set parallelism.ep = 1, or pick a mixture-of-experts flavour",
    ),
    Conflict(
        "flex_attention", "compile",
        "torch compiles FlexAttention on CPU for inference only (no backward), so its training cannot be compiled there",
        "set compile.enable = false on CPU, or train on CUDA",
        when=lambda f: f.on_cpu,
    ),
    Conflict(
        "hf_export", "moe_bias",
        "this family's Hugging Face format has no place for the balancing bias, so the exports would route tokens "
        "differently",
        "set moe.bias_update_rate = 0 (balance with moe.aux_loss_coef instead) or checkpoint.hf_export_interval = 0",
        when=lambda f: not f.hf_balancing_bias,
    ),
    Conflict(
        "moe_aux_loss", "cp",
        "the sequence-wise balance loss needs whole sequences, which context parallel splits",
        "set moe.aux_loss_coef = 0 (and balance with the routing bias, e.g. moe.bias_update_rate = 0.001) or parallelism.cp = 1",
    ),
    Conflict(
        "ac_whole_blocks", "compile",
        "under tensor parallel, torch's AOTAutograd fails on a compiled block that is checkpointed whole (the "
        "recomputed region saves the DeviceMesh of its DTensors as if it were a tensor; seen on torch 2.13, refused "
        "from 2.12 on, torch 2.11 trains it)",
        "use activation_checkpoint.mode = 'selective_op' with compile under tensor parallel, or compile.enable = false",
        when=lambda f: f.dims.tp > 1 and f.torch_release >= WHOLE_BLOCK_AC_TP_FAILS_FROM, when_witness=("--parallelism.tp", "2"),
    ),
    Conflict(
        "expert_loop", "compile",
        "the loop over experts has data-dependent sizes, which compile's fullgraph blocks cannot trace",
        "set moe.grouped_mm to 'auto' or 'on', or compile.enable = false",
    ),
    Conflict(
        "ac_memory_budget", "no_compile",
        "the memory budget is carried out by torch.compile's partitioner",
        "set compile.enable = true, or use activation_checkpoint.mode 'selective_op' or 'full' in eager",
    ),
)


def active(f: Facts) -> list[str]:
    """The declared features this run has, in declaration order."""
    return [feature.name for feature in _DEFINED if feature.on(f)]


def refuse_conflicts(f: Facts) -> None:
    """ConfigError naming both features for the first declared pair this run combines."""
    on = set(active(f))
    for conflict in CONFLICTS:
        if conflict.first in on and conflict.second in on and conflict.when(f):
            raise ConfigError(conflict.line(f))
