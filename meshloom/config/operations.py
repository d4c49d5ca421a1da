"""The settings of how a run is watched, saved and tested: validation, metrics, checkpoints, profiling,
communication timeouts and fault injection. Part of the run's typed configuration (`schema.Config`); each field's
docstring is its `meshloom train --help` text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class ValidationConfig:
    enable: bool = True
    """Evaluate the loss on the held-out split."""

    freq: int = 0
    """Evaluate every N steps; 0 = only after the last step."""

    steps: int = 4
    """Batches per evaluation."""

    prompts: str = ""
    """A file of prompts (.jsonl with a "prompt" or "text" field, or one prompt a line) continued by the model at
    every evaluation (validation.freq and the last step); the samples go to the console and to TensorBoard as text.
    Empty = no sampling."""

    max_new_tokens: int = 32
    """validation.prompts: tokens generated per prompt."""

    temperature: float = 0.0
    """validation.prompts: 0 = greedy; above 0, sampling seeded with validation.sample_seed (the same every time)."""

    top_k: int = 0
    """validation.prompts: sample among the k most likely tokens (0 = all)."""

    top_p: float = 1.0
    """validation.prompts: sample within the smallest set of tokens of this total probability, in (0, 1]."""

    sample_seed: int = 0
    """validation.prompts: seed of the sampler when temperature > 0."""


@dataclass
class MetricsConfig:
    log_freq: int = 10
    """Log every N steps (and the first and last step)."""

    tensorboard: bool = True
    """Write TensorBoard event files to <dump_folder>/tb."""

    wandb: bool = False
    """Also log to Weights & Biases (needs the wandb package)."""

    progress_bar: bool = True
    """Show a progress bar in the console."""

    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one device for MFU; 0 = the GPU table (by device name and matmul dtype), or on CPU the
    best matmul rate measured on the run's shapes, kept in ~/.cache/meshloom/cpu_peak.json as the best seen and raised
    when a step beats it (MESHLOOM_REFRESH_CPU_PEAK=1 measures again)."""


@dataclass
class CheckpointConfig:
    enable: bool = False
    """Save distributed checkpoints (model, optimizer, LR schedule, data position, RNG, step, config) while training."""

    folder: str = "checkpoint"
    """Checkpoint root, relative to job.dump_folder unless absolute; each save is a step-N subfolder."""

    interval: int = 500
    """Save every N steps, and after the last step."""

    keep_last_k: int = 0
    """Keep only the newest K complete checkpoints; 0 keeps all."""

    async_mode: Literal["disabled", "async"] = "disabled"
    """disabled: the step waits for the whole save; async: it waits only for the copy to host memory while a
    background thread writes the files."""

    resume: bool = False
    """Continue from the latest complete checkpoint under checkpoint.folder (an error if there is none)."""

    fallback_on_corrupt: bool = False
    """On resume, if the latest checkpoint cannot be read, load the previous complete one instead of stopping."""

    initial_load_path: str = ""
    """Weights to start from when not resuming: a meshloom checkpoint (seed checkpoint, another run) or a
    Hugging Face model folder; optimizer, schedule and data start fresh."""

    initial_load_format: Literal["dcp", "hf"] = "dcp"
    """Format of initial_load_path: dcp (a meshloom checkpoint) or hf (config.json + safetensors)."""

    hf_export_interval: int = 0
    """Write a Hugging Face folder (config.json, tokenizer files, safetensors) to <dump_folder>/hf/step-N every N
    steps and after the last step, from the sharded training state under any layout; 0 = never."""

    hf_export_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Weight dtype of the Hugging Face exports."""


@dataclass
class ProfilingConfig:
    enable: bool = False
    """Write torch.profiler traces of the steps below (open in Perfetto or TensorBoard) to
    <dump_folder>/profile/steps_<first>-<last>/rank<R>.pt.trace.json."""

    start_step: int = 3
    """First traced step (the step before it warms the profiler up)."""

    num_steps: int = 2
    """Traced steps from start_step on."""

    memory_snapshot: bool = False
    """CUDA: allocator snapshots (pytorch.org/memory_viz) over the traced steps and on out-of-memory, in
    <dump_folder>/memory_snapshot/; CPU: a memory timeline from the profiler, next to the traces."""


@dataclass
class CommConfig:
    init_timeout_seconds: float = 300.0
    """Collective timeout from process-group start through the first step (which includes one-off work such as
    compilation and the first checkpoint load)."""

    train_timeout_seconds: float = 100.0
    """Collective timeout after the first step: a rank that stalls longer than this fails the run."""

    flight_recorder: bool = True
    """On a collective timeout, a fatal error or SIGTERM, each rank writes its Flight Recorder trace and stack to
    <dump_folder>/flight_recorder/attempt-N/ (read them with `meshloom analyze-hang`)."""


@dataclass
class FaultInjectionConfig:
    """Testing hooks that break a run on purpose (chaos and recovery tests); every one is off by default."""

    attempt: int = 0
    """The torchrun restart attempt (TORCHELASTIC_RESTART_COUNT) in which kill, sleep and slow faults fire, so the
    restarted run recovers."""

    rank: int = 1
    """The global rank that is killed, sleeps or is slow."""

    kill_at_step: int = 0
    """SIGKILL `rank` right after this step (0 = never)."""

    kill_during_save: int = 0
    """SIGKILL `rank` inside the checkpoint save of this step, after its files are written and before the save is
    committed (0 = never)."""

    sleep_at_step: int = 0
    """`rank` sleeps sleep_seconds before the loss all-reduce of this step (0 = never): a hang."""

    sleep_seconds: float = 0.0
    """How long the sleep of sleep_at_step lasts."""

    slow_seconds: float = 0.0
    """`rank` spins the CPU this long in every step: a straggler."""

    flip_bit_at_step: int = 0
    """Right after this step's update, flip the lowest bit of the first element of flip_bit_parameter's local tensor
    on `rank` (0 = never): silent data corruption for fault_tolerance.replica_check_interval to find."""

    flip_bit_parameter: str = ""
    """The parameter or persistent buffer (an MoE layer's expert_bias) flip_bit_at_step corrupts, by its name in
    model.named_parameters() or model.state_dict(); empty = the first parameter."""

    nan_sample_id: int = -1
    """A step whose batch holds this dataset sample id gets a NaN gradient in nan_parameter, in every attempt:
    a bad batch (-1 = never)."""

    nan_parameter: str = ""
    """The parameter whose gradient nan_sample_id turns into NaN, by its name in model.named_parameters() (e.g.
    "layers.0.attention.wo.weight" in llama3); empty = the model's first parameter with a gradient."""
