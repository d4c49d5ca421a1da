"""Metric sinks for a training run: console line + progress bar, TensorBoard, metrics.jsonl, W&B.

Only rank 0 writes anything; other ranks get a logger whose methods do nothing, so the trainer can
call it unconditionally.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tqdm import tqdm

from meshloom.config.errors import UserError

# Console formatting of the standard keys, in display order: key -> (label, format).
# Any other key (e.g. "val_loss") is appended after these, in the order given, except keys with a "/" (per-layer
# detail such as "moe/layers.3/entropy"), which go to TensorBoard, metrics.jsonl and W&B only.
_CONSOLE_FORMATS: dict[str, tuple[str, str]] = {
    "loss": ("loss", "{:.4f}"),
    "grad_norm": ("grad_norm", "{:.3g}"),
    "lr": ("lr", "{:.1e}"),
    "tokens_per_second": ("tok/s", "{:,.0f}"),
    "tflops": ("tflops", "{:.3g}"),  # 3 significant digits: a CPU's 0.0123 must not print as 0.01 or 0.00
    "mfu_pct": ("mfu", "{:.1f}%"),
    "memory_gib": ("mem", "{:.2f} GiB"),
}


def format_metrics_line(step: int, metrics: dict[str, float]) -> str:
    """One human-readable line, e.g. 'step 10 | loss 5.1234 | grad_norm 1.23 | lr 3.0e-04 | ...'."""
    parts = [f"step {step}"]
    for key, (label, fmt) in _CONSOLE_FORMATS.items():
        if key in metrics:
            value = metrics[key]
            # Past 3 digits .3g would switch to 1.23e+03; whole numbers read better there.
            text = f"{value:,.0f}" if fmt == "{:.3g}" and abs(value) >= 1000 else fmt.format(value)
            parts.append(f"{label} {text}")
    for key, value in metrics.items():
        if key not in _CONSOLE_FORMATS and "/" not in key:
            # Losses read best with fixed decimals; other extras are of unknown scale.
            fmt = "{:.4f}" if key.endswith("loss") else "{:.4g}"
            parts.append(f"{key} {fmt.format(value)}")
    return " | ".join(parts)


class MetricLogger:
    """Fan out per-step metrics to the console, TensorBoard (run_dir/tb), run_dir/metrics.jsonl and W&B.

    Standard metric keys: loss, grad_norm, lr, tokens_per_second, tflops, mfu_pct, memory_gib.
    Any other float-valued key is logged everywhere too. `initial_step` positions the progress bar
    when resuming.
    """

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        tensorboard: bool,
        wandb: bool,
        progress_bar: bool,
        rank: int = 0,
        initial_step: int = 0,
        wandb_project: str = "meshloom",
        wandb_config: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = rank == 0
        self._bar: tqdm | None = None
        self._tb = None
        self._wandb = None
        self._jsonl = None

        if wandb:
            # Checked on every rank so a misconfigured run fails everywhere, not just on rank 0.
            try:
                import wandb as wandb_module
            except ImportError:
                raise UserError(
                    "metrics.wandb is enabled but the `wandb` package is not installed; "
                    "install it (pip install 'meshloom[wandb]') or set metrics.wandb = false"
                ) from None
        if not self.enabled:
            return

        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Append so a resumed run keeps its earlier history; the report dedupes repeated steps.
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # slow import: only when used

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"))
        if wandb:
            self._wandb = wandb_module
            wandb_module.init(
                project=wandb_project,
                name=self.run_dir.name,
                dir=str(self.run_dir),
                config=wandb_config,
                resume="allow",
            )
        if progress_bar:
            self._bar = tqdm(total=total_steps, initial=initial_step, desc="train", unit="step", dynamic_ncols=True)

    def log_event(self, step: int, event: dict[str, Any]) -> None:
        """A row that is not a metric (e.g. {"event": "resume", ...}): to metrics.jsonl and the console."""
        if not self.enabled:
            return
        assert self._jsonl is not None, "log_event() called after close()"
        self._jsonl.write(json.dumps({"step": step, **event}) + "\n")
        self._jsonl.flush()
        tqdm.write(f"step {step}: " + ", ".join(f"{k}={v}" for k, v in event.items()))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step's metrics in every enabled sink."""
        if not self.enabled:
            return
        assert self._jsonl is not None, "log() called after close()"
        values = {key: float(value) for key, value in metrics.items()}

        line = format_metrics_line(step, values)
        if self._bar is not None:
            tqdm.write(line)  # prints above the bar and redraws it, so the bar stays at the bottom
            if "loss" in values:
                self._bar.set_postfix_str(f"loss {values['loss']:.4f}")
        else:
            print(line, flush=True)

        # NaN/inf are kept (json writes NaN/Infinity) because a diverging loss is worth recording.
        self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self._jsonl.flush()

        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def log_text(self, step: int, tag: str, text: str) -> None:
        """A piece of text (e.g. a generated sample): TensorBoard's text tab and W&B; the caller prints it."""
        if not self.enabled:
            return
        if self._tb is not None:
            self._tb.add_text(tag, text, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({tag: text}, step=step)

    def advance(self, n: int = 1) -> None:
        """Move the progress bar by n steps."""
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        """Flush and close every sink; safe to call twice."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> "MetricLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
