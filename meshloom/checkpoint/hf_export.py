"""Hugging Face folders written while training (`checkpoint.hf_export_interval`), from the sharded state.

    every rank:  each tensor of its parts, gathered whole over its stage's FSDP/TP ranks (DTensor.full_tensor)
                 and copied to host memory by the stage's first rank
    pp > 1:      the first ranks of the stages send their parts to global rank 0 (gather_object over "pp")
    rank 0:      a background thread writes <dump_folder>/hf/.step-N.tmp-<pid>/ (write_hf_folder + tokenizer
                 files + meshloom_export.json), then renames it to step-N/

Training waits only for the gather and the host copy (as an async DCP save waits for its staging copy); the
files are written while it goes on. The host copy is a snapshot, so later optimizer steps cannot reach the files.

meshloom_export.json records which run made the export: the run lineage of its checkpoints (a resumed run
continues the lineage it loaded, as its checkpoint step folders do). An export is replaced only by a run of the
same lineage (a resumed or restarted run writing the same step again). A step-N folder without that record, or
with another lineage's, is never overwritten: one the run would export into is refused at start-up
(`refuse_foreign_exports`), and one that appears later is left as it is, with a warning.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from meshloom.checkpoint.folders import EXPORT_MARKER
from meshloom.checkpoint.hf import DTYPES, write_hf_folder
from meshloom.config.errors import ConfigError
from meshloom.config.schema import Config
from meshloom.parallel.distributed import rank
from meshloom.planning.run_plan import RunPlan

HF_EXPORT_DIR = "hf"


def _first_of_stage(plan: RunPlan) -> bool:
    """Whether this rank is the first of its pipeline stage's FSDP/TP/CP ranks (all but the pp coordinate are 0)."""
    if not plan.dims.is_distributed:
        return True
    return all(c == 0 for c in plan.dims.mesh("world").get_coordinate()[1:])


def gather_full_state(model_parts: list[nn.Module], plan: RunPlan) -> dict[str, torch.Tensor] | None:
    """Every tensor of the whole model, unsharded, as host-memory copies on global rank 0; None on other ranks.
    Every rank must call it (the gathers are collectives)."""
    keep = _first_of_stage(plan)
    state: dict[str, torch.Tensor] = {}
    for part in model_parts:
        local = get_model_state_dict(part)
        for name in sorted(local):  # the same order on every rank of a stage: the gathers pair up
            tensor = local[name]
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if keep:
                state[name] = full.detach().to("cpu", copy=True)
    if plan.dims.pp > 1:
        if not keep:
            return None
        parts: list[Any] | None = [None] * plan.dims.pp if rank() == 0 else None
        dist.gather_object(state, parts, group=plan.dims.mesh("pp").get_group(), group_dst=0)
        if rank() != 0:
            return None
        state = {name: t for part in parts for name, t in part.items()}
    return state if rank() == 0 else None


def tokenizer_files(data_tokenizer: str, tokenizer: Any) -> tuple[dict[str, bytes], str]:
    """(files for the export folder, a note on them). tokenizer.json for the built-in BPE and Hugging Face files;
    a tiktoken file is copied under its own name (transformers cannot read it as a fast tokenizer)."""
    source = Path(data_tokenizer)
    special = {"bos_token": None, "eos_token": None}
    inner = getattr(tokenizer, "_tok", None)
    if inner is not None:
        text = source.read_bytes() if data_tokenizer != "builtin" else inner.to_str().encode("utf-8")
        special = {"bos_token": inner.id_to_token(tokenizer.bos_id), "eos_token": inner.id_to_token(tokenizer.eos_id)}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "clean_up_tokenization_spaces": False}
        return {"tokenizer.json": text, "tokenizer_config.json": json.dumps(config, indent=1).encode()}, "tokenizer.json"
    return {source.name: source.read_bytes()}, f"tiktoken file copied as {source.name} (not a transformers tokenizer.json)"


def export_steps(config: Config, start: int) -> list[int]:
    """The steps after `start` that `HFExporter.maybe_export` writes."""
    interval, last = config.checkpoint.hf_export_interval, config.training.steps
    return [s for s in range(start + 1, last + 1) if s % interval == 0 or s == last] if interval else []


def export_lineage(folder: Path) -> str | None:
    """The run lineage that made the export in `folder`, or None (not an export, or one that does not say)."""
    try:
        lineage = json.loads((folder / EXPORT_MARKER).read_text()).get("lineage")
    except (OSError, ValueError, AttributeError):
        return None
    return lineage if isinstance(lineage, str) else None


def refuse_foreign_exports(config: Config, run_dir: Path, start: int, lineage: str | None) -> None:
    """A <run>/hf/step-N this run would export into, but that no export of this run's lineage made, is refused
    now, before the training that would reach it (as a foreign checkpoint step folder is). `lineage` is the one
    the run continues (None for a fresh start: then every existing export is another run's)."""
    steps = export_steps(config, start)
    root = Path(run_dir) / HF_EXPORT_DIR
    if steps and root.exists() and not root.is_dir():
        raise ConfigError(f"{root} is a file, but checkpoint.hf_export_interval exports into that folder; move the file or set the interval to 0")
    for step in steps:
        folder = root / f"step-{step}"
        if not folder.exists():
            continue
        if not (folder / EXPORT_MARKER).is_file():
            raise ConfigError(
                f"{folder} already exists and was not made by an export, which this run would write at step {step}; "
                f"move it out of {root} (it is never overwritten) or change checkpoint.hf_export_interval"
            )
        if lineage is None or export_lineage(folder) != lineage:
            raise ConfigError(
                f"{folder} is another run's export, which this run would write at step {step}; "
                f"move it out of {root} (it is never overwritten) or change checkpoint.hf_export_interval"
            )


class HFExporter:
    """`maybe_export(step)` after every step; `close()` at the end of training waits for the last write."""

    def __init__(self, plan: RunPlan, run_dir: Path, model_parts: list[nn.Module], tokenizer: Any, lineage: Callable[[], str]):
        """`lineage` gives the run lineage at the time of a write (a resume sets it when its checkpoint loads)."""
        config = plan.config
        self.lineage = lineage
        self.interval, self.plan, self.parts = config.checkpoint.hf_export_interval, plan, model_parts
        self.root = Path(run_dir) / HF_EXPORT_DIR
        self.dtype = DTYPES[config.checkpoint.hf_export_dtype]
        self.files, self.files_note = ({}, "") if not self.interval or rank() != 0 else tokenizer_files(config.data.tokenizer, tokenizer)
        self.base_config = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self.blocking_seconds: list[float] = []

    def maybe_export(self, step: int) -> None:
        if self.interval and (step % self.interval == 0 or step >= self.plan.config.training.steps):
            self.export(step)

    def export(self, step: int) -> None:
        start = time.perf_counter()  # training is blocked from here
        self.wait()  # one write in flight at a time
        state = gather_full_state(self.parts, self.plan)
        blocking = time.perf_counter() - start
        self.blocking_seconds.append(blocking)
        if state is None:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshloom-hf-export")
        self._pending = self._executor.submit(self._write, step, state, start, blocking, self.lineage())

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    def _write(self, step: int, state: dict[str, torch.Tensor], start: float, blocking: float, lineage: str) -> None:
        final = self.root / f"step-{step}"
        if final.exists() and export_lineage(final) != lineage:
            warnings.warn(f"hf export: {final} exists and was not written by an export of this run; left as it is, step {step} not exported", stacklevel=1)
            return
        tmp = self.root / f".step-{step}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        write_hf_folder(state, self.plan.spec, self.plan.model_args, tmp, self.dtype, base_config=self.base_config)
        for name, data in self.files.items():
            (tmp / name).write_bytes(data)
        total = time.perf_counter() - start
        marker = {"step": step, "written_by": "meshloom training export", "lineage": lineage, "dtype": str(self.dtype).removeprefix("torch."),
                  "tokenizer": self.files_note, "blocking_seconds": round(blocking, 6), "total_seconds": round(total, 6)}  # fmt: skip
        (tmp / EXPORT_MARKER).write_text(json.dumps(marker, indent=1))
        if final.exists() and export_lineage(final) == lineage:  # an earlier export of this step by this lineage: ours to replace
            shutil.rmtree(final)
        os.replace(tmp, final)
        tqdm.write(f"hf export: step {step} written to {final}: training blocked {blocking:.3f} s, total {total:.3f} s")
