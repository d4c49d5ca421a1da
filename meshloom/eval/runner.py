"""`meshloom eval`'s engine: the model under a training layout (FSDP, TP, PP and their mixes), summed losses.

The model is built exactly as the trainer builds it (RunPlan -> `build_model` or the pipeline stages), then
given the source's weights: a DCP checkpoint is resharded to this layout by `dcp.load`, a Hugging Face folder
is read tensor by tensor into each rank's shards. Every rank walks the same windows; each data-parallel rank
takes its block of each global batch, and the last batch is padded with ignored windows. Losses are summed
(never averaged per batch), then summed over ranks, so any layout gives the 1-process numbers up to the order
of float additions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from meshloom.output import Inputs, write_output_file
from meshloom.config.errors import ConfigError, UserError
from meshloom.config.loader import load_config, parse_args, sections
from meshloom.config.schema import Config
from meshloom.eval.data import IGNORE, EvalSet, load_eval_set
from meshloom.inference import loading
from meshloom.parallel.distributed import init_distributed, rank, world_size_from_env
from meshloom.parallel.output_head import ChunkedOutputHead, held_out_loss
from meshloom.planning.run_plan import RunPlan
from meshloom.train.runtime import select_device


# Settings of the saved run that evaluation never uses (no checkpoints are written, nothing is trained).
_EVAL_SETTINGS = ("--checkpoint.enable=false", "--checkpoint.resume=false", "--checkpoint.initial_load_path=",
                  "--training.nonfinite=halt", "--fault_injection.kill_at_step=0")  # fmt: skip


@dataclasses.dataclass
class EvalOptions:
    data: list[str]
    seq_len: int = 0  # 0 = the run's training.seq_len (Hugging Face: min(max_seq_len, 2048))
    batch_size: int = 8  # windows per data-parallel rank and batch
    max_batches: int = 0  # 0 = all
    text_field: str = "text"
    tokenizer: str | None = None
    overrides: tuple[str, ...] = ()  # --section.field VALUE settings (parallelism, training.mixed_precision, ...)
    progress: bool = True


def _config(source: loading.InferenceSource, overrides: tuple[str, ...]) -> Config:
    """The source's run settings (defaults for a Hugging Face folder) plus the command line's."""
    saved = loading.run_config(source) or Config()
    argv = []
    for name, section in sections(saved).items():
        for field in dataclasses.fields(section):
            argv.append(f"--{name}.{field.name}={getattr(section, field.name)}")
    config = load_config(argv + list(_EVAL_SETTINGS) + list(overrides))
    # Only the command line's settings are the user's here; the run's own passed its checks when it trained.
    config.given = {key for key, _ in parse_args(list(overrides))[1]}
    return config


def eval_plan(config: Config, world_size: int, args: Any, device: torch.device | None = None) -> RunPlan:
    """The training RunPlan, with its checks (of `device` when given), for the source's own model shape (which may be
    no flavour)."""
    if config.parallelism.cp > 1:
        raise ConfigError("meshloom eval does not split sequences over ranks: set parallelism.cp = 1")
    return RunPlan.build(config, world_size, device, model_args=args)


def _sum_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE, reduction="sum")


def _summed_loss_of(parts: list[nn.Module]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The summed loss of what the model returns: a run with the chunked loss (loss.chunked) keeps it under
    `held_out_loss`, its head handing hidden states to the loss a chunk of tokens at a time; else whole logits."""
    head = next((m for part in parts for m in part.modules() if isinstance(m, ChunkedOutputHead)), None)
    if head is None:
        return _sum_loss
    return lambda output, labels: head.loss_sum(output, labels) if head.returns_hidden else _sum_loss(output, labels)


def _load_weights(source: loading.InferenceSource, parts: list[nn.Module], plan: RunPlan) -> None:
    if source.hf is not None:
        from meshloom.checkpoint.hf import load_into_model_parts  # noqa: PLC0415

        source.hf.check()
        load_into_model_parts(parts, source.hf)
        return
    from meshloom.checkpoint.reading import check_model_shapes, load_state, read_index, verify  # noqa: PLC0415
    from meshloom.checkpoint.state import ModelState  # noqa: PLC0415

    info, state = source.checkpoint, ModelState(parts)
    metadata = read_index(info.path)
    verify(info)
    expected = {name: t.shape for name, t in state.state_dict().items()}
    check_model_shapes(info.path, metadata, expected, complete_model=plan.dims.pp == 1)
    load_state({"model": state}, info.path)


class _Model:
    """Summed loss of one local batch, whatever the layout."""

    def __init__(self, plan: RunPlan, device: torch.device):
        from meshloom.train.model_setup import build_model, build_pipeline_stages  # noqa: PLC0415
        from meshloom.train.loss import TrainingLoss  # noqa: PLC0415
        from meshloom.train.pipeline_step import PipelineRunner  # noqa: PLC0415

        self.plan, self.device = plan, device
        low_precision = plan.compute_dtype != torch.float32
        autocast = lambda: torch.autocast(device.type, dtype=plan.compute_dtype) if low_precision else contextlib.nullcontext()  # noqa: E731
        self.autocast = autocast
        self.runner = None
        if plan.pipeline is not None:
            pp_mesh = plan.dims.mesh("pp")
            stage_ids = plan.pipeline.stages_of(pp_mesh.get_local_rank())
            self.parts = build_pipeline_stages(plan, device, stage_ids)
            loss = TrainingLoss(_summed_loss_of(self.parts), {})
            self.runner = PipelineRunner(plan.pipeline, self.parts, stage_ids, pp_mesh, device, autocast, loss)
        else:
            self.parts = [build_model(plan, device)]
        self.summed_loss = _summed_loss_of(self.parts)
        for part in self.parts:
            part.eval()

    @torch.no_grad()
    def loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with held_out_loss(self.parts):
            if self.runner is not None:
                # eval_loss is the mean over microbatches of each one's summed loss; times their number, the batch's sum.
                return self.runner.eval_loss(inputs, labels, None) * self.plan.pipeline.microbatches
            with self.autocast():
                output = self.parts[0](inputs.to(self.device))
            return self.summed_loss(output, labels.to(self.device))


def evaluate(source_path: str | Path, options: EvalOptions) -> dict[str, Any]:
    """Loss (nats per predicted token), perplexity and bits per byte; the same dict on every rank."""
    began = time.perf_counter()
    source = loading.resolve(source_path)
    spec, args = loading.model_args(source)
    config = _config(source, options.overrides)
    seq_len = options.seq_len or (min(args.max_seq_len, 2048) if source.hf is not None else config.training.seq_len)
    if not 1 <= seq_len <= args.max_seq_len:
        raise UserError(f"--seq-len {seq_len} must be between 1 and the model's max_seq_len {args.max_seq_len}")
    if options.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {options.batch_size}")
    config.training = dataclasses.replace(config.training, seq_len=seq_len, local_batch_size=options.batch_size, global_batch_size=-1)
    config.parallelism.loss_parallel = False  # whole logits on every tensor-parallel rank: a plain summed loss
    config.model.name, config.model.n_layers = spec.name, args.n_layers
    device = select_device(config.training.device)
    plan = eval_plan(config, world_size_from_env(), args, device)
    tokenizer = loading.load_tokenizer(source, options.tokenizer)
    if tokenizer.vocab_size > args.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {args.vocab_size}; pass the model's own --tokenizer")
    eval_set = load_eval_set(options.data, tokenizer, config.data, options.text_field)

    init_distributed(device, config.comm.init_timeout_seconds)
    if plan.dims.is_distributed:
        plan.dims.build_mesh(device.type)
    model = _Model(plan, device)
    _load_weights(source, model.parts, plan)
    totals, complete = _run(model, plan, eval_set, options)
    nats, tokens = float(totals[0]), int(totals[1])
    assert not complete or tokens == eval_set.predicted_tokens, "every token is predicted exactly once"
    evaluated_bytes = eval_set.bytes if complete else None  # bytes are known only for the whole set
    result = {
        "source": source.describe(), "data": eval_set.name, "documents": eval_set.documents, "tokens": tokens,
        "bytes": evaluated_bytes, "seq_len": seq_len, "loss": nats / tokens, "perplexity": math.exp(nats / tokens),
        "bits_per_byte": nats / math.log(2) / evaluated_bytes if evaluated_bytes else None,
        "world_size": plan.world_size, "layout": {n: getattr(plan.dims, n) for n in ("dp_replicate", "dp_shard", "tp", "pp")},
        "seconds": time.perf_counter() - began,
    }  # fmt: skip
    return result


def _run(model: _Model, plan: RunPlan, eval_set: EvalSet, options: EvalOptions) -> tuple[torch.Tensor, bool]:
    """(summed nats, predicted tokens) over all ranks, and whether every window was evaluated."""
    inputs, labels = eval_set.windows(plan.config.training.seq_len)
    local, dp = options.batch_size, plan.dims.dp
    dp_rank = plan.dims.mesh("dp").get_local_rank() if plan.dims.is_distributed else 0
    per_step = local * dp
    all_steps = -(-len(inputs) // per_step)
    steps = min(all_steps, options.max_batches) if options.max_batches else all_steps
    totals = torch.zeros(2, dtype=torch.float64, device=model.device)  # summed nats, predicted tokens
    bar = tqdm(total=steps, desc="eval", unit="batch", disable=not options.progress or rank() != 0, dynamic_ncols=True)
    for step in range(steps):
        start = step * per_step + dp_rank * local
        x, y = inputs[start : start + local], labels[start : start + local]
        if len(x) < local:  # the last global batch: pad with windows whose every label is ignored
            pad = local - len(x)
            x = torch.cat([x, torch.zeros(pad, x.shape[1], dtype=x.dtype)])
            y = torch.cat([y, torch.full((pad, y.shape[1]), IGNORE, dtype=y.dtype)])
        totals[0] += model.loss_sum(x, y).double()
        totals[1] += int((y != IGNORE).sum())
        bar.update(1)
    bar.close()
    if plan.dims.is_distributed and dp > 1:
        dist.all_reduce(totals, group=plan.dims.mesh("dp").get_group())
    return totals, steps == all_steps


def write_result(result: dict[str, Any], output: Path, overwrite: bool = False, inputs: Inputs = ()) -> Path:
    return write_output_file(output, json.dumps(result, indent=1) + "\n", overwrite, inputs)
