"""The range of every numeric setting, in one table: `check_ranges` refuses a value outside it in one line.

Every int and float field of the schema has an entry here (tests/test_setting_rules.py walks the schema and tries
each bound). Floats must also be finite. Ints without a natural upper bound are capped at int64's largest value,
which is what torch and numpy take (a seed of 2**70 would otherwise end in an overflow deep inside torch).
Bounds that depend on another setting (fault_tolerance.replica_id < group_size) stay in validate.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from meshloom.config.errors import ConfigError

INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Range:
    """Accepted values: low .. high (each bound open or closed), plus `sentinels` with a meaning of their own."""

    low: float
    high: float = INT64_MAX
    low_open: bool = False
    high_open: bool = False
    sentinels: tuple[int, ...] = ()
    note: str = ""
    """What a special value means, shown in the refusal, e.g. "0 = off"."""

    say_positive: bool = False
    """State an integer range from 1 as "positive" rather than ">= 1"."""

    def admits(self, value: float) -> bool:
        if value in self.sentinels:
            return True
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def words(self) -> str:
        """The range as the refusal states it: "positive", ">= 0", "lie in [0, 1)"."""
        if self.high == INT64_MAX:
            positive = (self.low == 0 and self.low_open) or (self.low == 1 and self.say_positive)
            text = "positive" if positive else f">= {_num(self.low)}"
            if self.low_open and self.low != 0:
                text = f"> {_num(self.low)}"
        else:
            text = f"lie in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}{')' if self.high_open else ']'}"
        return text


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _positive(note: str = "") -> Range:
    """An integer count of at least 1, stated as "positive"."""
    return Range(1, note=note, say_positive=True)


def _nonneg(note: str = "") -> Range:
    return Range(0, note=note)


def _positive_float(note: str = "") -> Range:
    return Range(0, INT64_MAX, low_open=True, note=note)


def _fraction(low_open: bool = False, high_open: bool = False, note: str = "") -> Range:
    return Range(0, 1, low_open=low_open, high_open=high_open, note=note)


RANGES: dict[str, Range] = {
    "model.n_layers": _nonneg("0 = the flavour's"),
    "model.mtp_depth": Range(0, sentinels=(-1,), note="-1 = the flavour's"),
    "training.steps": _positive(),
    "training.local_batch_size": _positive(),
    "training.global_batch_size": Range(1, sentinels=(-1,), note="derive it", say_positive=True),
    "training.seq_len": _positive(),
    "loss.chunk_tokens": _positive(),
    "training.max_norm": _nonneg("0 disables clipping"),
    "training.seed": _nonneg(),
    "training.max_rollbacks": _nonneg(),
    "optimizer.lr": _positive_float(),
    "optimizer.beta1": _fraction(high_open=True),
    "optimizer.beta2": _fraction(high_open=True),
    "optimizer.eps": _positive_float(),
    "optimizer.weight_decay": _nonneg(),
    "optimizer.muon_lr": _nonneg("0 = optimizer.lr"),
    "optimizer.muon_momentum": _fraction(high_open=True),
    "optimizer.muon_ns_steps": Range(1, 100, high_open=True, note="5 is the usual"),
    "optimizer.qk_clip_threshold": _nonneg("0 = off"),
    "lr_scheduler.warmup_steps": _nonneg(),
    "lr_scheduler.decay_ratio": _fraction(low_open=True),
    "lr_scheduler.min_lr_ratio": _fraction(),
    "data.max_bytes": _nonneg("0 = no cap"),
    "data.vocab_size": Range(258, note="256 bytes + bos/eos"),
    "data.validation_fraction": _fraction(high_open=True),
    "data.stream_workers": _nonneg("0 = tokenize in the training loop"),
    "parallelism.dp_replicate": Range(1),
    "parallelism.dp_shard": Range(1, sentinels=(-1,), note="infer"),
    "parallelism.tp": Range(1),
    "parallelism.pp": Range(1),
    "parallelism.cp": Range(1),
    "parallelism.cp_document_chunks": Range(1),
    "parallelism.ep": Range(1),
    "pipeline.microbatches": _nonneg("0 = automatic"),
    "pipeline.stages_per_rank": _nonneg("0 = automatic"),
    "validation.freq": _nonneg("0 = only at the end"),
    "validation.steps": _positive(),
    "validation.max_new_tokens": Range(1),
    "validation.temperature": _nonneg("0 = greedy"),
    "validation.top_k": _nonneg("0 = no top-k cut"),
    "validation.top_p": _fraction(low_open=True, note="1 = no nucleus cut"),
    "validation.sample_seed": _nonneg(),
    "metrics.log_freq": _positive(),
    "metrics.peak_tflops": _nonneg("0 = auto"),
    "checkpoint.interval": _positive(),
    "checkpoint.keep_last_k": _nonneg("0 keeps all"),
    "checkpoint.hf_export_interval": _nonneg("0 = no exports"),
    "activation_checkpoint.every_k_layers": Range(1),
    "activation_checkpoint.memory_budget": _fraction(),
    "moe.bias_update_rate": _nonneg("0 = off"),
    "moe.aux_loss_coef": _nonneg("0 = off"),
    "moe.z_loss_coef": _nonneg("0 = off"),
    "profiling.start_step": Range(1, note="steps count from 1"),
    "profiling.num_steps": Range(1),
    "comm.init_timeout_seconds": _positive_float(),
    "comm.train_timeout_seconds": _positive_float(),
    "fault_injection.attempt": _nonneg(),
    "fault_injection.rank": _nonneg(),
    "fault_injection.kill_at_step": _nonneg("0 = never"),
    "fault_injection.kill_during_save": _nonneg("0 = never"),
    "fault_injection.sleep_at_step": _nonneg("0 = never"),
    "fault_injection.sleep_seconds": _nonneg(),
    "fault_injection.slow_seconds": _nonneg(),
    "fault_injection.flip_bit_at_step": _nonneg("0 = never"),
    "fault_injection.nan_sample_id": Range(0, sentinels=(-1,), note="never"),
    "fault_tolerance.replica_id": _nonneg(),
    "fault_tolerance.group_size": Range(1),
    "fault_tolerance.min_replicas": Range(1),
    "fault_tolerance.timeout_seconds": _positive_float(),
    "fault_tolerance.quorum_timeout_seconds": _positive_float(),
    "fault_tolerance.connect_timeout_seconds": _positive_float(),
    "fault_tolerance.start_wait_seconds": _nonneg(),
    "fault_tolerance.replica_check_interval": _nonneg("0 = never"),
    "fault_tolerance.sync_every": Range(1),
    "fault_tolerance.outer_lr": _positive_float(),
    "fault_tolerance.outer_momentum": _fraction(high_open=True),
}


def refusal(key: str, value: float) -> str:
    """The one line for `key = value` outside its range."""
    spec = RANGES[key]
    if isinstance(value, float) and not math.isfinite(value):
        return f"{key} must be a finite number, got {value}; give an ordinary number such as 0.5"
    if spec.high == INT64_MAX and value > spec.high:
        return f"{key} must be at most {INT64_MAX} (int64's largest), got {value}"
    sentinel = f" or {spec.sentinels[0]}" if spec.sentinels else ""
    note = f" ({spec.note})" if spec.note else ""
    return f"{key} must {'' if spec.words().startswith('lie') else 'be '}{spec.words()}{sentinel}{note}, got {value}"


def check_ranges(config) -> None:
    """ConfigError for the first numeric setting outside its range (in schema order)."""
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        for f in dataclasses.fields(values):
            key = f"{section.name}.{f.name}"
            value = getattr(values, f.name)
            if key in RANGES and not RANGES[key].admits(value):
                raise ConfigError(refusal(key, value))
