"""What `meshloom plan` prints and writes: the top layouts with their memory and step-time breakdowns, and the
best one as a TOML recipe."""

from __future__ import annotations

import dataclasses

from meshloom.planning.comm_estimate import COMM_DIMS
from meshloom.planning.layout import Layout, layout_settings
from meshloom.planning.memory_estimate import GIB
from meshloom.planning.planner import Candidate

MEMORY_PARTS = ("params", "grads", "optimizer", "gathered", "activations", "transient")


def _layout_line(layout: Layout) -> str:
    degrees = " ".join(f"{name} {getattr(layout, name)}" for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"))
    batch = f"microbatch {layout.microbatch_size} x {layout.microbatches}"
    if layout.pp > 1:
        batch += f" ({layout.pipeline_schedule}, {layout.pipeline_microbatches} per pipeline step"
        batch += f", {layout.grad_accum_steps} steps accumulated)" if layout.grad_accum_steps > 1 else ")"
    elif layout.grad_accum_steps > 1:
        batch += " (accumulated)"
    extras = f"ac {layout.ac}, {layout.optimizer}" + (", float8" if layout.float8 else "")
    extras += f", chunked loss ({layout.loss_chunk_tokens} tokens)" if layout.loss_chunk_tokens else ""
    return f"{degrees} | {batch} | {extras}"


def format_candidate(rank: int, candidate: Candidate) -> str:
    m, t = candidate.memory, candidate.time
    memory = "  ".join(f"{part} {getattr(m, part) / GIB:.1f}" for part in MEMORY_PARTS)
    stage = f", pipeline rank {m.stage}" if candidate.layout.pp > 1 else ""
    exposed = ", ".join(f"{dim} {t.exposed[dim]:.3f}" for dim in COMM_DIMS if t.comm[dim] > 0)
    return "\n".join([
        f"#{rank}  {_layout_line(candidate.layout)}",
        f"    memory GiB: {memory}  peak {m.peak / GIB:.1f}{stage}",
        f"    step {t.step:.3f} s = compute {t.compute:.3f} + exposed comm {sum(t.exposed.values()):.3f} "
        f"({exposed or 'none'}) + bubble {t.bubble:.3f}; {t.tokens_per_s_per_gpu:,.0f} tokens/s per GPU",
    ])


def distinct_layouts(candidates: list[Candidate], top: int) -> list[Candidate]:
    """The first `top` candidates that differ in more than the AC mode, the optimizer, Float8 or the loss (the
    fastest variant of each); the variants are ranked among themselves in the full list."""
    seen, chosen = set(), []
    for candidate in candidates:
        key = dataclasses.replace(candidate.layout, ac="none", optimizer="AdamW", float8=False, loss_chunk_tokens=0)
        if key not in seen:
            seen.add(key)
            chosen.append(candidate)
            if len(chosen) == top:
                break
    return chosen


def format_table(candidates: list[Candidate], top: int) -> str:
    return "\n".join(format_candidate(i, c) for i, c in enumerate(distinct_layouts(candidates, top), 1))


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def layout_toml(model: str, flavor: str, layout: Layout, seq_len: int, note: str) -> str:
    """A ready recipe: model, batch, degrees, optimizer, Float8, checkpointing mode and pipeline settings of `layout`;
    `note` (one or more lines) heads it as comments."""
    settings = layout_settings(layout)
    settings["training"] = {"seq_len": seq_len, "mixed_precision": "bf16", **settings["training"]}
    sections = {"model": {"name": model, "flavor": flavor}, **settings}
    lines = [f"# {line}" if line else "#" for line in note.splitlines()]
    for name, values in sections.items():
        lines.append(f"\n[{name}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def expert_comm_note(mode: str) -> str:
    """What a plan assumes of expert all-to-all (Cluster.expert_comm)."""
    if mode == "overlapped":
        return ("expert all-to-all assumed overlapped with the expert matmuls (DeepEP-like; under DualPipeV with all of the "
                "paired chunk's compute, as DualPipe; only the remainder is exposed); meshloom's own dispatch does not "
                "overlap: --expert-comm exposed plans for it")
    return "expert all-to-all assumed exposed (meshloom's own dispatch, no overlap)"


def recipe_note(candidate: Candidate, gpus: int, command: str, expert_comm: str = "overlapped") -> str:
    """The header of a planned recipe: how it was made and what the planner predicts for it."""
    m, t = candidate.memory, candidate.time
    return "\n".join([
        f"Made by: {command}",
        f"Layout: {candidate.layout.describe()}",
        f"Predicted peak memory: {m.peak / GIB:.1f} GiB per GPU (params {m.params / GIB:.1f}, grads {m.grads / GIB:.1f}, "
        f"optimizer {m.optimizer / GIB:.1f}, gathered {m.gathered / GIB:.1f}, activations {m.activations / GIB:.1f})",
        f"Predicted step: {t.step:.3f} s on {gpus} GPUs, {t.tokens_per_s_per_gpu:,.0f} tokens/s per GPU",
        *([expert_comm_note(expert_comm)] if candidate.layout.ep > 1 else []),
    ])
