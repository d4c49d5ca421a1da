"""Value checks that need no model, data or devices: they run before anything is built."""

from __future__ import annotations

from meshloom.config.errors import ConfigError
from meshloom.config.ranges import check_ranges
from meshloom.config.schema import Config


def attention_mask_kind(config: Config) -> str:
    """The attention mask a run asks for: "document" with data.document_mask, else "causal"."""
    return "document" if config.data.document_mask else "causal"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(config: Config) -> None:
    """Every numeric setting within its range (config/ranges.py), then the bounds that depend on another setting."""
    check_ranges(config)
    if config.parallelism.cp > 1:
        _check_context_parallel(config)
    _check_fault_tolerance(config)  # even without enable, so a wrong value is named before it is refused as idle


def _check_fault_tolerance(config: Config) -> None:
    ft = config.fault_tolerance
    _require(
        ft.replica_id < ft.group_size,
        f"fault_tolerance.replica_id must lie in [0, group_size={ft.group_size}), got {ft.replica_id}",
    )
    _require(
        ft.min_replicas <= ft.group_size,
        f"fault_tolerance.min_replicas must lie in [1, group_size={ft.group_size}], got {ft.min_replicas}",
    )


def _check_context_parallel(config: Config) -> None:
    cp, seq_len = config.parallelism.cp, config.training.seq_len
    par = config.parallelism
    if par.cp_document_balance:
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
