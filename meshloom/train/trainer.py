"""The training loop. Each concern it touches lives in its own module; this file only wires them."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from meshloom.checkpoint.dcp import Checkpointer, checkpoint_root
from meshloom.checkpoint.hf_export import HFExporter
from meshloom.checkpoint.resume_settings import apply_settings_after_load, hyperparameters
from meshloom.checkpoint.state import TrainingParts, TrainProgress
from meshloom.config.errors import ConfigError
from meshloom.config.schema import Config
from meshloom.data.build import DataBundle, build_data, check_data_config, check_data_lasts
from meshloom.data.loader import Batch
from meshloom.data.tokenizer import check_builtin_vocab_fits
from meshloom.inference.training_samples import build_prompt_sampler, check_sampling_config
from meshloom.observe import flight_recorder
from meshloom.observe.logging import MetricLogger
from meshloom.observe.cpu_peak import remeasured_cpu_peak, training_matmul_shapes
from meshloom.observe.metrics import Throughput, peak_flops_per_second, peak_memory_bytes
from meshloom.observe.profiler import StepProfiler
from meshloom.observe.stragglers import RankStepTimes
from meshloom.observe.summary import startup_summary
from meshloom.parallel.context import batch_sharder
from meshloom.parallel.document_balance import context_layout
from meshloom.parallel.dims import DEGREE_NAMES, MESH_DIMS
from meshloom.parallel.distributed import (
    init_distributed,
    rank,
    restart_attempt,
    set_collective_timeout,
    share_error,
    world_size_from_env,
)
from meshloom.parallel.float8 import sync_float8_scales
from meshloom.parallel.grad_clip import clip_grads_, global_grad_norm
from meshloom.parallel.output_head import held_out_loss
from meshloom.parallel.tensor import loss_parallel_context
from meshloom.planning.run_plan import RunPlan
from meshloom.tensors import local_tensor
from meshloom.train.fault import resume_after_restart
from meshloom.train.fault_injection import FaultInjector
from meshloom.train.loss import build_training_loss
from meshloom.train.lr import build_lr_scheduler
from meshloom.train.model_setup import build_model
from meshloom.train.moe_balance import MoEBalancer
from meshloom.train.nonfinite import NonFinitePolicy, is_finite
from meshloom.train.optim import OptimizerGroup, build_optimizer
from meshloom.train.pipeline_step import PipelineRunner, build_pipeline
from meshloom.train.qk_clip import QKClip
from meshloom.train.replica_state import ReplicaState
from meshloom.train.replicas import join_replica_groups, replica_run_dir
from meshloom.train.run_folder import check_run_folder, continuation_event, write_run_config
from meshloom.train.runtime import seed_everything, select_device


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    skipped: bool
    sample_ids: list[int]
    rolled_back_from: int | None = None  # nonfinite = rollback: the failed step; training continues from the reloaded one
    aux: dict[str, float] = field(default_factory=dict)  # the model's own auxiliary losses (ModelSpec.aux_losses), unweighted
    retried: bool = False  # fault tolerance: a replica group failed during the step, which runs again


class Trainer:
    def __init__(self, config: Config):
        # Cheap checks first: nothing heavy is built until the whole setup is known to be valid.
        self.config, self.run_dir = config, Path(replica_run_dir(config))
        self.device = select_device(config.training.device)
        self.plan = RunPlan.build(config, world_size_from_env(), self.device)
        self.model_args, self.dims, self.grad_accum_steps = self.plan.model_args, self.plan.dims, self.plan.grad_accum_steps
        check_data_config(config.data)
        check_builtin_vocab_fits(config.data, self.model_args.vocab_size)
        self.sample_prompts = check_sampling_config(config)  # validation.prompts
        resume_after_restart(config, checkpoint_root(config, self.run_dir))
        check_run_folder(config, self.run_dir, restart_attempt())
        self.faults = FaultInjector(config.fault_injection)
        self.checkpointer = Checkpointer(self.plan, self.run_dir, before_commit=self.faults.during_save)
        self.progress = TrainProgress(self.plan.tokens_per_step)
        self._join_process_group()
        seed_everything(config.training.seed, config.training.deterministic)
        self.data = self._build_data()
        self._build_model()
        self.moe = MoEBalancer(self.model_parts, self.plan, self.replicas.reduce_over_quorum)
        self.optimizers = [build_optimizer(part, config.optimizer, self.device, self.plan.spec.adamw_only) for part in self.model_parts]
        # One optimizer per pipeline stage, so a checkpoint pairs each stage with its own optimizer state.
        self.optimizer = self.optimizers[0] if self.pipeline is None else OptimizerGroup(self.optimizers)
        self.qk_clip = QKClip.build(
            self.plan.spec, self.model_parts, config.optimizer.qk_clip_threshold, self.dims,
            self.replicas.reduce_over_quorum,
        )  # fmt: skip
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.lr_scheduler, config.training.steps)
        self.nonfinite = NonFinitePolicy(config.training, self.run_dir, self.model, self.checkpointer)
        self.checkpointer.bind(TrainingParts(
            self.model_parts, self.optimizers, self.lr_scheduler, self.progress, self.data.train, self.dp_rank
        ))  # fmt: skip
        before = hyperparameters(self.optimizers)
        self.checkpointer.load()  # resume, or an initial load of weights
        if self.checkpointer.loaded_from is not None:  # a resume acts on the optimizer's and schedule's new settings
            apply_settings_after_load(self.optimizers, self.lr_scheduler, before)
        check_data_lasts(self.data.train, config.training.steps, self.tokens_per_step * self.replicas.group_size // config.training.seq_len)
        self._build_observers()
        self.replicas.bind(ReplicaState(self.checkpointer.parts), self.logger)
        self.sampler = build_prompt_sampler(self.plan, self.sample_prompts, self.data.tokenizer, self.model_parts, self.device, self.logger)
        self.hf_exporter = HFExporter(self.plan, self.run_dir, self.model_parts, self.data.tokenizer, lambda: self.checkpointer.lineage)

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def tokens_per_step(self) -> int:
        return self.plan.tokens_per_step

    def _join_process_group(self) -> None:
        """Flight recorder, the process group and the device mesh; this rank's place in the data-parallel group."""
        if self.config.comm.flight_recorder and self.plan.world_size > 1:
            flight_recorder.install(self.run_dir, lambda: {"steps_completed": self.step})
        self.world_size = init_distributed(self.device, self.config.comm.init_timeout_seconds)
        assert self.world_size == self.plan.world_size, "the launcher's world size changed under the plan"
        self.dp_rank = 0
        if self.dims.is_distributed:
            self.dims.build_mesh(self.device.type)
            self.dp_rank = self.dims.mesh("dp").get_local_rank()
        samples_per_step = self.config.training.local_batch_size * self.plan.dp * self.grad_accum_steps
        # fault_tolerance: an early heartbeat
        self.replicas = join_replica_groups(self.config, self.dims, self.device, samples_per_step)
        # Context parallel: every rank of a cp group reads the same samples and keeps its shard of each sequence.
        self.shard_batch = batch_sharder(self.dims, context_layout(self.dims, self.config.parallelism))

    def _build_data(self) -> DataBundle:
        """Rank 0 fills the tokenizer and token caches first, so the other ranks only read them."""
        tc = self.config.training
        # Replica groups read consecutive slices of each global batch, like one larger data-parallel group.
        groups = self.replicas.group_size
        self.data_rank = self.replicas.replica_id * self.plan.dp + self.dp_rank
        build = lambda: build_data(
            self.config.data, tc.seq_len, tc.local_batch_size, self.data_rank, self.plan.dp * groups, tc.seed, self.config.validation.enable,
            samples_per_step=self.tokens_per_step * groups // tc.seq_len,
        )
        if rank() == 0:
            try:
                data = build()
            except ValueError as err:
                share_error(str(err))  # the other ranks raise it too instead of waiting forever
                raise
            share_error(None)
        elif (message := share_error(None)) is not None:
            raise ConfigError(message)
        else:
            data = build()
        # Checked before the process group: the built-in BPE's size against data.vocab_size, a file's by RunPlan.build.
        assert data.tokenizer.vocab_size <= self.model_args.vocab_size, (data.tokenizer.vocab_size, self.model_args.vocab_size)
        return data

    def _build_model(self) -> None:
        """The model (or this rank's pipeline stages) with real weights, parallelized, and its loss."""
        self.pipeline: PipelineRunner | None = None
        if self.plan.pipeline is not None:
            self.pipeline = build_pipeline(self.plan, self.device, self._compute_context)
            self.model = self.pipeline.model
            self.model_parts = list(self.model)
        else:
            self.model = build_model(self.plan, self.device)
            self.model_parts = [self.model]
        self.fsdp = any(isinstance(module, FSDPModule) for module in self.model.modules())
        self.loss_parallel = self.plan.loss_parallel
        self.loss_fn = build_training_loss(self.plan, self.model_parts)

    def _build_observers(self) -> None:
        """Throughput and MFU, step-time spread, profiler and metric logging; rank 0 writes the run's config."""
        config = self.config
        self.step_times = RankStepTimes(self.device)
        # MFU's peak: on CPU measured on this run's matmul shapes, dtype and threads, and raised when a window beats it.
        dtype, override, on_cpu = self.plan.compute_dtype, config.metrics.peak_tflops or None, self.device.type == "cpu"
        tokens = config.training.local_batch_size * config.training.seq_len // self.dims.cp
        shapes = training_matmul_shapes(self.plan.shape().block_params(0), tokens, self.dims.tp) if on_cpu else ()
        peak = peak_flops_per_second(self.device, dtype, override, shapes)
        remeasure = functools.partial(remeasured_cpu_peak, dtype, shapes) if on_cpu and override is None else None
        flops_per_token = self.plan.shape().flops_per_token(config.training.seq_len)
        self.throughput = Throughput(flops_per_token, peak, num_devices=self.world_size, remeasure_peak=remeasure)
        self.rank = rank()
        self.profiler = StepProfiler(config.profiling, self.run_dir, self.rank, self.device)
        self.logger = MetricLogger(
            self.run_dir, config.training.steps, config.metrics.tensorboard, config.metrics.wandb, config.metrics.progress_bar,
            self.rank, self.step,
        )  # fmt: skip
        if self.rank == 0:
            write_run_config(config, self.run_dir, self.step)
            print(self._summary(), flush=True)
        if (event := continuation_event(self.checkpointer.loaded_from, restart_attempt())) is not None:
            self.logger.log_event(self.step, event)

    def _summary(self) -> str:
        shape = self.plan.shape()
        degrees = {name: getattr(self.dims, name) for name in DEGREE_NAMES + MESH_DIMS}
        return startup_summary(
            self.config, self.run_dir, shape.num_params(), shape.active_params(), degrees, self.world_size,
            str(self.device), self.tokens_per_step, self.grad_accum_steps, self.checkpointer.root, self.step,
            self.plan.kernels.lines,
        )  # fmt: skip

    def _autocast(self) -> contextlib.AbstractContextManager:
        # Under FSDP the MixedPrecisionPolicy casts parameters instead.
        if self.plan.compute_dtype != torch.float32 and not self.fsdp:
            return torch.autocast(self.device.type, dtype=self.plan.compute_dtype)
        return contextlib.nullcontext()

    def _compute_context(self) -> contextlib.AbstractContextManager:
        """Where forward and backward run: autocast (bf16 without FSDP) and loss parallel (TP)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self._autocast())
        stack.enter_context(loss_parallel_context(self.loss_parallel))
        return stack

    def forward_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss to train on, its detached parts in `self.loss_fn.names` order)."""
        # Document ids (data.document_mask) go by keyword, and only when present; so do the labels, for a model
        # with auxiliary losses of its own.
        labels = labels.to(self.device)
        extra = {} if document_ids is None else {"document_ids": document_ids.to(self.device)}
        if self.loss_fn.aux_weights:
            extra["labels"] = labels
        with self._autocast():
            output = self.model(inputs.to(self.device), **extra)
        return self.loss_fn(output, labels)

    def train_step(self) -> StepResult:
        """One optimizer step over `grad_accum_steps` microbatches."""
        self.model.train()
        parts = torch.zeros(len(self.loss_fn.names), device=self.device)  # next-token loss, then auxiliary losses
        sample_ids: list[int] = []
        self.replicas.start_step(self.step)
        self.nonfinite.skip_offending_batch(self.step + 1, self.data.train, self.grad_accum_steps)
        for micro in range(self.grad_accum_steps):
            batch = self.shard_batch(self.data.train.next_batch())
            sample_ids += batch.sample_ids.tolist()
            if self.pipeline is not None:
                parts += self.pipeline.train_step(batch.inputs, batch.labels, batch.document_ids, self.grad_accum_steps)
                continue
            if self.fsdp:
                # Reduce gradients once per step, not once per microbatch.
                self.model.set_requires_gradient_sync(micro == self.grad_accum_steps - 1)
            with loss_parallel_context(self.loss_parallel):
                loss, micro_parts = self.forward_loss(batch.inputs, batch.labels, batch.document_ids)
                (loss / self.grad_accum_steps).backward()
            parts += micro_parts
        parts /= self.grad_accum_steps
        self.faults.after_backward(self.model, sample_ids)
        self.faults.before_loss_reduce(self.step + 1)
        if self.dims.is_distributed:
            # Each data-parallel rank saw different samples: report the global mean.
            dist.all_reduce(parts, op=dist.ReduceOp.AVG, group=self.dims.mesh("dp_cp").get_group())

        pp_mesh = self.dims.mesh("pp") if self.pipeline is not None else None
        if self.pipeline is not None:
            self.pipeline.finish_backward()
        parts = self.replicas.average(self.model_parts, parts)
        # Before the commit: a replica group that fails during these reductions makes every group run the step again.
        self.moe.reduce_step_stats()
        self.qk_clip.reduce_maxima()
        norm_params = self.pipeline.norm_parameters() if self.pipeline is not None else self.model.parameters()
        grad_norm_tensor = global_grad_norm(norm_params, pp_mesh)
        grad_norm = float(grad_norm_tensor)
        loss_value, *aux_values = parts.tolist()
        aux = dict(zip(self.loss_fn.names[1:], aux_values))
        lr = self.lr_scheduler.get_last_lr()[0]
        if not self.replicas.should_commit():
            self.moe.after_step(updated=False)
            self.qk_clip.discard()  # the step runs again and tracks its maxima afresh
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(loss_value, grad_norm, lr, True, sample_ids, aux=aux, retried=True)
        self.progress.step += 1

        skipped, failed_step = False, None
        if not is_finite(loss_value, grad_norm):
            skipped, failed_step = True, self.step
            self.qk_clip.discard()  # its attention maxima belong to an update that did not happen
            if self.nonfinite.handle(self.step, loss_value, grad_norm, sample_ids) is None:
                failed_step = None  # the update was dropped in place; the step counts
        else:
            if self.config.training.max_norm > 0:
                clip_grads_(self.model.parameters(), self.config.training.max_norm, grad_norm_tensor)
            self.optimizer.step()
            self.qk_clip.after_update()
            sync_float8_scales(self.model, self.config.float8, self.fsdp)
            self.lr_scheduler.step()
        self.moe.after_step(updated=not skipped)
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_value, grad_norm, lr, skipped, sample_ids, failed_step, aux=aux)

    @torch.no_grad()
    def validate(self) -> float | None:
        loader = self.data.validation
        if loader is None or not self.config.validation.enable:
            return None
        self.model.eval()
        # The chunked loss takes the held-out loss a chunk at a time too: no logits over all tokens.
        with held_out_loss(self.model_parts):
            losses = [self._held_out_loss(loader.next_batch()) for _ in range(self.config.validation.steps)]
        # Every evaluation sees the same held-out batches, so values are comparable over time.
        loader.rewind()
        return sum(losses) / len(losses)

    def _held_out_loss(self, batch: Batch) -> float:
        """The mean loss of one held-out global batch."""
        batch = self.shard_batch(batch)
        if self.pipeline is not None:
            loss = self.pipeline.eval_loss(batch.inputs, batch.labels, batch.document_ids)
        else:
            with loss_parallel_context(self.loss_parallel):
                loss, _ = self.forward_loss(batch.inputs, batch.labels, batch.document_ids)
        loss = local_tensor(loss)
        if self.dims.is_distributed:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dims.mesh("dp_cp").get_group())
        return float(loss)

    def _should_log(self) -> bool:
        return self.step == 1 or self.step % self.config.metrics.log_freq == 0 or self.step == self.config.training.steps

    def _should_validate(self) -> bool:
        freq = self.config.validation.freq
        return self.step == self.config.training.steps or (freq > 0 and self.step % freq == 0)

    def train(self) -> list[float]:
        """Run to `training.steps`; returns the per-step losses."""
        losses = []
        first_step = self.step
        self.throughput.reset()
        self.profiler.start(self.step)
        while self.step < self.config.training.steps:
            self.step_times.start()
            result = self.train_step()
            self.step_times.stop()
            if result.retried:
                continue
            self.profiler.step(self.step)
            if result.rolled_back_from is not None:  # the steps after the reloaded checkpoint are trained again
                self.logger.log(result.rolled_back_from, {"loss": result.loss, "grad_norm": result.grad_norm, "rolled_back_to": self.step})
                del losses[max(0, self.step - first_step) :]
                continue
            losses.append(result.loss)
            if self.step == first_step + 1:  # one-off start-up work is done: a stall from now on is a hang
                set_collective_timeout(self.config.comm.train_timeout_seconds)
            self.throughput.update(self.tokens_per_step)
            self.logger.advance()
            metrics: dict[str, float] = {}
            if self._should_validate() and (val_loss := self.validate()) is not None:
                metrics["val_loss"] = val_loss
            if self._should_log():
                metrics.update(
                    loss=result.loss,
                    **result.aux,
                    grad_norm=result.grad_norm,
                    lr=result.lr,
                    **self.throughput.report().as_metrics(),
                    memory_gib=peak_memory_bytes(self.device) / 2**30,
                    **self.step_times.report(),
                    **self.moe.metrics(),
                    **self.qk_clip.metrics(),
                    **self.data.metrics(),
                    **self.shard_batch.metrics(),
                    **self.replicas.metrics(),
                )
                if result.skipped:
                    metrics["skipped_step"] = 1.0
            if metrics:
                self.logger.log(self.step, metrics)
            for event in self.data.events():  # a source ran out (repeats or leaves), or the mixture changed on resume
                self.logger.log_event(self.step, event)
            if self.sampler is not None and self._should_validate():
                self.sampler.sample(self.step)
            self.checkpointer.maybe_save()
            self.hf_exporter.maybe_export(self.step)
            self.faults.flip_bit(self.step, self.model_parts)
            self.replicas.check(self.step, self.model_parts)
            self.faults.after_step(self.step)
        self.profiler.stop()
        self.replicas.shutdown()
        self.hf_exporter.close()
        self.logger.close()
        return losses
