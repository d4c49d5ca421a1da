"""Routing metrics of mixture-of-experts layers: per layer for TensorBoard, a one-line summary for the console.

Per layer (``moe/<block>/<metric>``; the console leaves out keys with a "/"), all over the last optimizer step's
global batch:

* ``load_max_mean``: the busiest expert's token count over the mean count (1 = perfectly balanced);
* ``entropy``: the mean entropy, in nats, of a token's normalised routing scores (ln E = undecided);
* ``bias_spread``: the largest minus the smallest balancing bias;
* ``aux_loss`` / ``z_loss``: the mean sequence-wise balance loss and router z-loss, when their weight is not 0.

Summary: ``moe_load_max`` (worst layer), ``moe_entropy`` (mean over layers), ``moe_bias_spread`` (largest), and
the mean ``moe_aux_loss`` / ``moe_z_loss`` when enabled.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshloom.models.common.moe import STAT_NAMES


def layer_metrics(counts: torch.Tensor, stats: torch.Tensor, bias: torch.Tensor) -> dict[str, float]:
    """Metrics of one layer from its global token counts [E], summed statistics (STAT_NAMES) and current bias."""
    values = dict(zip(STAT_NAMES, stats.tolist(), strict=True))
    mean = float(counts.mean())
    forwards = max(values["forwards"], 1.0)
    return {
        "load_max_mean": float(counts.max()) / mean if mean > 0 else 0.0,
        "entropy": values["entropy"] / max(values["tokens"], 1.0),
        "bias_spread": float(bias.max() - bias.min()),
        "aux_loss": values["aux_loss"] / forwards,
        "z_loss": values["z_loss"] / forwards,
    }


def gather_pipeline(per_layer: dict[str, dict[str, float]], pp_group) -> dict[str, dict[str, float]]:
    """Every pipeline rank's layers, on every pipeline rank (a collective over the pp group: call it everywhere)."""
    if pp_group is None:
        return per_layer
    gathered: list[dict[str, dict[str, float]] | None] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(gathered, per_layer, group=pp_group)
    merged: dict[str, dict[str, float]] = {}
    for part in gathered:
        merged.update(part or {})
    return merged


def _layer_key(name: str) -> str:
    return name.removesuffix(".moe")


def metric_dict(per_layer: dict[str, dict[str, float]], aux_loss: bool, z_loss: bool) -> dict[str, float]:
    """Per-layer keys plus the summary, in layer order; aux/z-loss values only when those losses are on."""
    skipped = {name for name, on in (("aux_loss", aux_loss), ("z_loss", z_loss)) if not on}
    layers = sorted(per_layer, key=lambda name: [int(p) if p.isdigit() else p for p in name.split(".")])
    if not layers:
        return {}
    out = {
        "moe_load_max": max(per_layer[n]["load_max_mean"] for n in layers),
        "moe_entropy": sum(per_layer[n]["entropy"] for n in layers) / len(layers),
        "moe_bias_spread": max(per_layer[n]["bias_spread"] for n in layers),
    }
    for name in ("aux_loss", "z_loss"):
        if name not in skipped:
            out[f"moe_{name}"] = sum(per_layer[n][name] for n in layers) / len(layers)
    for n in layers:
        out.update({f"moe/{_layer_key(n)}/{key}": value for key, value in per_layer[n].items() if key not in skipped})
    return out
