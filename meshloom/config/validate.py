"""Value checks that need no model, data or devices: they run before anything is built."""

from __future__ import annotations

from meshloom.config.errors import ConfigError
from meshloom.config.schema import Config


def attention_mask_kind(config: Config) -> str:
    """The attention mask a run asks for: "document" with data.document_mask, else "causal"."""
    return "document" if config.data.document_mask else "causal"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(config: Config) -> None:
    t, o, lr, d, m = config.training, config.optimizer, config.lr_scheduler, config.data, config.metrics
    v = config.validation
    _require(t.steps > 0, f"training.steps must be positive, got {t.steps}; set e.g. --training.steps 100")
    _require(t.local_batch_size > 0, f"training.local_batch_size must be positive, got {t.local_batch_size}")
    _require(
        t.global_batch_size == -1 or t.global_batch_size > 0,
        f"training.global_batch_size must be positive or -1 (derive it), got {t.global_batch_size}",
    )
    _require(t.seq_len > 0, f"training.seq_len must be positive, got {t.seq_len}")
    _require(
        config.loss.chunk_tokens > 0, f"loss.chunk_tokens must be positive, got {config.loss.chunk_tokens}; e.g. --loss.chunk_tokens 1024"
    )
    _require(t.max_norm >= 0, f"training.max_norm must be >= 0 (0 disables clipping), got {t.max_norm}")
    _require(o.lr > 0, f"optimizer.lr must be positive, got {o.lr}")
    _require(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, f"optimizer.beta1/beta2 must lie in [0, 1), got {o.beta1}, {o.beta2}")
    _require(o.eps > 0, f"optimizer.eps must be positive, got {o.eps}")
    _require(o.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {o.weight_decay}")
    _require(o.muon_lr >= 0, f"optimizer.muon_lr must be >= 0 (0 = optimizer.lr), got {o.muon_lr}")
    _require(0 <= o.muon_momentum < 1, f"optimizer.muon_momentum must lie in [0, 1), got {o.muon_momentum}")
    _require(
        1 <= o.muon_ns_steps < 100,
        f"optimizer.muon_ns_steps must lie in [1, 100) (5 is the usual), got {o.muon_ns_steps}",
    )
    _require(o.qk_clip_threshold >= 0, f"optimizer.qk_clip_threshold must be >= 0 (0 = off), got {o.qk_clip_threshold}")
    _require(lr.warmup_steps >= 0, f"lr_scheduler.warmup_steps must be >= 0, got {lr.warmup_steps}")
    _require(0 < lr.decay_ratio <= 1, f"lr_scheduler.decay_ratio must lie in (0, 1], got {lr.decay_ratio}")
    _require(0 <= lr.min_lr_ratio <= 1, f"lr_scheduler.min_lr_ratio must lie in [0, 1], got {lr.min_lr_ratio}")
    _require(d.max_bytes >= 0, f"data.max_bytes must be >= 0 (0 = no cap), got {d.max_bytes}")
    _require(d.stream_workers >= 0, f"data.stream_workers must be >= 0 (0 = tokenize in the training loop), got {d.stream_workers}")
    _require(d.vocab_size >= 258, f"data.vocab_size must be at least 258 (256 bytes + bos/eos), got {d.vocab_size}")
    _require(0 <= d.validation_fraction < 1, f"data.validation_fraction must lie in [0, 1), got {d.validation_fraction}")
    _require(m.log_freq > 0, f"metrics.log_freq must be positive, got {m.log_freq}")
    _require(m.peak_tflops >= 0, f"metrics.peak_tflops must be >= 0 (0 = auto), got {m.peak_tflops}")
    _require(v.freq >= 0, f"validation.freq must be >= 0 (0 = only at the end), got {v.freq}")
    _require(v.steps > 0, f"validation.steps must be positive, got {v.steps}")
    par = config.parallelism
    for name in ("dp_replicate", "tp", "pp", "cp", "ep"):
        value = getattr(par, name)
        _require(value >= 1, f"parallelism.{name} must be >= 1, got {value}")
    _require(par.dp_shard == -1 or par.dp_shard >= 1, f"parallelism.dp_shard must be >= 1 or -1 (infer), got {par.dp_shard}")
    _require(config.model.n_layers >= 0, f"model.n_layers must be >= 0 (0 = the flavour's), got {config.model.n_layers}")
    for name in ("microbatches", "stages_per_rank"):
        value = getattr(config.pipeline, name)
        _require(value >= 0, f"pipeline.{name} must be >= 0 (0 = automatic), got {value}")
    c, f = config.comm, config.fault_injection
    _require(c.init_timeout_seconds > 0, f"comm.init_timeout_seconds must be positive, got {c.init_timeout_seconds}")
    _require(c.train_timeout_seconds > 0, f"comm.train_timeout_seconds must be positive, got {c.train_timeout_seconds}")
    _require(t.max_rollbacks >= 0, f"training.max_rollbacks must be >= 0, got {t.max_rollbacks}")
    _require(
        t.nonfinite != "rollback" or config.checkpoint.enable,
        "training.nonfinite = 'rollback' reloads the latest checkpoint, but checkpoint.enable is false; "
        "set --checkpoint.enable true (with a checkpoint.interval) or choose halt / skip_step",
    )
    _require(f.sleep_seconds >= 0 and f.slow_seconds >= 0, "fault_injection.sleep_seconds and slow_seconds must be >= 0")
    ck = config.checkpoint
    _require(ck.interval > 0, f"checkpoint.interval must be positive, got {ck.interval}")
    _require(ck.keep_last_k >= 0, f"checkpoint.keep_last_k must be >= 0 (0 keeps all), got {ck.keep_last_k}")
    moe = config.moe
    for name in ("bias_update_rate", "aux_loss_coef", "z_loss_coef"):
        _require(getattr(moe, name) >= 0, f"moe.{name} must be >= 0 (0 = off), got {getattr(moe, name)}")
    if par.cp > 1:
        _check_context_parallel(config)
    _check_fault_tolerance(config)  # even without enable, so a wrong value is named before it is refused as idle


def _check_fault_tolerance(config: Config) -> None:
    ft = config.fault_tolerance
    _require(ft.group_size >= 1, f"fault_tolerance.group_size must be >= 1, got {ft.group_size}")
    _require(
        0 <= ft.replica_id < ft.group_size,
        f"fault_tolerance.replica_id must lie in [0, group_size={ft.group_size}), got {ft.replica_id}",
    )
    _require(
        1 <= ft.min_replicas <= ft.group_size,
        f"fault_tolerance.min_replicas must lie in [1, group_size={ft.group_size}], got {ft.min_replicas}",
    )
    for name in ("timeout_seconds", "quorum_timeout_seconds", "connect_timeout_seconds"):
        _require(getattr(ft, name) > 0, f"fault_tolerance.{name} must be positive, got {getattr(ft, name)}")
    _require(ft.sync_every >= 1, f"fault_tolerance.sync_every must be >= 1, got {ft.sync_every}")
    _require(ft.outer_lr > 0, f"fault_tolerance.outer_lr must be positive, got {ft.outer_lr}")
    _require(0 <= ft.outer_momentum < 1, f"fault_tolerance.outer_momentum must lie in [0, 1), got {ft.outer_momentum}")
    _require(ft.start_wait_seconds >= 0, f"fault_tolerance.start_wait_seconds must be >= 0, got {ft.start_wait_seconds}")
    _require(
        ft.replica_check_interval >= 0,
        f"fault_tolerance.replica_check_interval must be >= 0 (0 = never), got {ft.replica_check_interval}",
    )


def _check_context_parallel(config: Config) -> None:
    cp, seq_len = config.parallelism.cp, config.training.seq_len
    par = config.parallelism
    if par.cp_document_balance:
        _require(par.cp_document_chunks >= 1, f"parallelism.cp_document_chunks must be >= 1, got {par.cp_document_chunks}")
        chunks = cp * par.cp_document_chunks
        _require(
            seq_len % chunks == 0,
            f"training.seq_len={seq_len} must be divisible by parallelism.cp x parallelism.cp_document_chunks = {chunks} "
            f"(the document-aware split); use a multiple of {chunks} or fewer parallelism.cp_document_chunks",
        )
        return
    balanced = par.cp_load_balance
    chunks = 2 * cp if balanced else cp
    _require(
        seq_len % chunks == 0,
        f"training.seq_len={seq_len} must be divisible by {'2 x ' if balanced else ''}parallelism.cp = {chunks} "
        f"({'load-balanced split' if balanced else 'contiguous split'}); use a multiple of {chunks}"
        + (" or set parallelism.cp_load_balance = false" if balanced else ""),
    )
