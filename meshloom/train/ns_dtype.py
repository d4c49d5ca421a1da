"""Which dtype Muon's Newton-Schulz iterations run in when ``optimizer.muon_ns_dtype = "auto"``, and why.

On CUDA bf16 is torch.optim.Muon's choice: tensor cores make it fast and it halves the traffic of the update shards.
On a CPU, bf16 matmuls are only fast with native bf16 instructions (AVX512-BF16 or AMX-BF16); without them torch
converts every element and the Newton-Schulz step is about ten times slower than in fp32, so "auto" picks fp32 on
every CPU: it is also the dtype in which a layout's result stays within fp32 rounding of one process's.
"""

from __future__ import annotations

import torch

from meshloom.observe.cpu import native_bf16_flags

NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

def resolve_ns_dtype(setting: str, device_type: str) -> str:
    """The Newton-Schulz dtype name ("bfloat16" or "float32") a setting means on a device type ("cuda", "cpu", ...)."""
    if setting != "auto":
        return setting
    return "bfloat16" if device_type == "cuda" else "float32"


def ns_dtype_reason(setting: str, device_type: str) -> str:
    """One line for the start-up summary: the dtype and why it was chosen."""
    chosen = resolve_ns_dtype(setting, device_type)
    if setting != "auto":
        return f"{chosen} (optimizer.muon_ns_dtype)"
    if device_type == "cuda":
        return "bfloat16 (auto: CUDA)"
    native = native_bf16_flags() if device_type == "cpu" else []
    if native:
        return f"float32 (auto: {device_type}; this CPU has {'/'.join(native)}, set bfloat16 to use it)"
    return f"float32 (auto: {device_type}; no native bf16 matmul here, where bf16 is about 10x slower)"
