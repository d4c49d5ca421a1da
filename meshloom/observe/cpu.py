"""What this machine's CPU is and can do, read from /proc/cpuinfo (Linux); unknown elsewhere."""

from __future__ import annotations

import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")

# x86 flags for bf16 matmul in hardware (AVX512-BF16, AMX-BF16); Arm lists "bf16" among its Features.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def _cpuinfo_field(names: tuple[str, ...]) -> str | None:
    """The value of the first line of /proc/cpuinfo whose key is one of `names`, or None where it cannot be read."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in names:
            return value.strip()
    return None


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC ..."), or what `platform` knows where /proc/cpuinfo has none."""
    return _cpuinfo_field(("model name",)) or platform.processor() or platform.machine() or "unknown cpu"


def cpu_flags() -> frozenset[str] | None:
    """The first CPU's feature flags (x86 "flags", Arm "Features"), or None where they cannot be read."""
    value = _cpuinfo_field(("flags", "features"))
    return None if value is None else frozenset(value.split())


def cpu_has_native_bf16() -> bool | None:
    """Whether the CPU multiplies bf16 matrices in hardware; None where its flags are unknown (not Linux).

    Without it (an AVX2-only x86, for one) torch emulates bf16 matmuls, which then run several times slower
    than fp32, so bf16 autocast and bf16 Newton-Schulz steps lose instead of gaining.
    """
    flags = cpu_flags()
    return None if flags is None else bool(native_bf16_flags())


def native_bf16_flags() -> list[str]:
    """The native bf16 matmul flags this CPU advertises (empty where there are none or its flags are unknown)."""
    flags = cpu_flags() or frozenset()
    return [flag for flag in NATIVE_BF16_FLAGS if flag in flags]
