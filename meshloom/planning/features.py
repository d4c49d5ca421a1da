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

import torch

from meshloom.config.errors import ConfigError
from meshloom.config.schema import Config
from meshloom.parallel.dims import ParallelDims


@dataclass(frozen=True)
class Facts:
    """What the declaration's conditions may look at: the settings, the degrees and the model's kind."""

    config: Config
    dims: ParallelDims
    n_experts: int
    attention_kernel: str = "sdpa"
    """The family's attention kernel (ModelSpec.attention_kernel)."""

    hf_balancing_bias: bool = True
    """Whether the family's Hugging Face format holds the MoE balancing bias (models/hf_adapter.py)."""

    mixers: tuple[str, ...] = ()
    """Each block's token mixer (ModelSpec.block_mixers): "sdpa", "flex" or "gated_delta"."""

    @property
    def on_cpu(self) -> bool:
        """Whether the run trains on CPU (training.device, "auto" on a machine without CUDA)."""
        device = self.config.training.device
        return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


Condition = Callable[[Facts], bool]


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

    def line(self, facts: Facts | None = None) -> str:
        """The refusal; with the run's facts, a feature that a model has by its shape names the model."""
        model = f"{facts.config.model.name} {facts.config.model.flavor}" if facts else "the model.flavor"
        a, b = (FEATURES[name].setting.format(model=model) for name in (self.first, self.second))
        ta, tb = FEATURES[self.first].title, FEATURES[self.second].title
        return f"{a} ({ta}) with {b} ({tb}): {self.reason}; {self.fix}"


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
    Feature(
        "elastic_resize", "elastic resize", "parallelism.resize", lambda f: f.config.parallelism.resize != "none",
        ("--parallelism.resize", "dp_shard"),
    ),
]
FEATURES: dict[str, Feature] = {feature.name: feature for feature in _DEFINED}

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
        "set moe.aux_loss_coef = 0 or parallelism.cp = 1",
    ),
    Conflict(
        "ac_whole_blocks", "compile",
        "under tensor parallel, torch 2.13's AOTAutograd fails on a compiled block that is checkpointed whole (the "
        "recomputed region saves the DeviceMesh of its DTensors as if it were a tensor)",
        "use activation_checkpoint.mode = 'selective_op' with compile under tensor parallel, or compile.enable = false",
        when=lambda f: f.dims.tp > 1, when_witness=("--parallelism.tp", "2"),
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
