"""The block a run prints once before its first step: what is being trained, where, on what, and where it goes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from meshloom.config.schema import Config
from meshloom.observe.cpu import cpu_has_native_bf16
from meshloom.parallel.dims import DEGREE_NAMES, MESH_DIMS
from meshloom.parallel.resize import describe_resize
from meshloom.train.ns_dtype import ns_dtype_reason


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def _data_source(config: Config) -> str:
    d = config.data
    if d.dataset == "shards":
        return f"prepared shards {d.shards}"
    if d.dataset == "streaming":
        return f"stream {d.stream}"
    return f"text files under {d.path}" if d.path else "the built-in corpus (this interpreter's standard library)"


def bf16_cpu_warning(mixed_precision: str, device: str) -> str | None:
    """A note when bf16 is chosen on a CPU that emulates bf16 matmuls (no avx512_bf16 / amx_bf16), else None."""
    if mixed_precision != "bf16" or not device.startswith("cpu") or cpu_has_native_bf16() is not False:
        return None
    return (
        "this CPU has no native bf16 matmul (no avx512_bf16 / amx_bf16 flag), so bf16 matmuls run several times "
        'slower than fp32 here; set training.mixed_precision = "fp32"'
    )


def startup_summary(
    config: Config,
    run_dir: Path,
    total_params: int,
    active_params: float,
    degrees: dict[str, int],
    world_size: int,
    device: str,
    tokens_per_step: int,
    grad_accum_steps: int,
    checkpoint_root: Path,
    start_step: int,
    kernels: Sequence[str] = (),
) -> str:
    m, t = config.model, config.training
    active = f" ({_count(active_params)} active per token)" if active_params < total_params else ""
    layout = " x ".join(f"{name} {degrees[name]}" for name in DEGREE_NAMES if degrees.get(name, 1) > 1) or "one process"
    mesh = ", ".join(f"{name}={degrees[name]}" for name in MESH_DIMS)
    dtype = "bf16 autocast / fp32 master weights" if t.mixed_precision == "bf16" else "fp32"
    checkpoints = f"{checkpoint_root} (every {config.checkpoint.interval} steps)" if config.checkpoint.enable else "off"
    lines = [
        "meshloom run",
        f"  run folder     {run_dir}",
        f"  model          {m.name} {m.flavor}, {_count(total_params)} parameters{active}",
        f"  layout         {layout} on {world_size} rank(s); mesh {mesh}",
        f"  device         {device}, {dtype}",
        f"  data           {_data_source(config)}, tokenizer {config.data.tokenizer}",
        f"  tokens/step    {tokens_per_step:,} ({t.seq_len} tokens x {tokens_per_step // t.seq_len} sequences"
        + (f", {grad_accum_steps} accumulation steps)" if grad_accum_steps > 1 else ")"),
        f"  steps          {start_step} -> {t.steps}",
        f"  checkpoints    {checkpoints}",
        f"  resize         {describe_resize(config.parallelism)}",
    ]
    lines += [f"  kernel         {choice}" for choice in kernels]
    if (warning := bf16_cpu_warning(t.mixed_precision, device)) is not None:
        lines.append(f"  note           {warning}")
    if config.optimizer.name == "Muon":
        device_type = device.split(":")[0]
        lines.insert(5, f"  newton-schulz  {ns_dtype_reason(config.optimizer.muon_ns_dtype, device_type)}")
    if config.job.description:
        lines.insert(1, f"  description    {config.job.description}")
    return "\n".join(lines)
