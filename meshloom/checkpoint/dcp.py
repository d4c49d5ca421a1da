"""Distributed checkpoints of a training run: save (sync or async), atomic commit, resume, initial loads.

Folder layout and the commit marker live in `folders.py`, what a checkpoint holds in `state.py`, checks
and safe reading in `reading.py`. A run talks to one `Checkpointer`: built early from the run plan (it only
checks settings and files), then `bind(parts)` once model, optimizer and data exist, `load()`, and
`maybe_save()` after every step. It never sees the trainer: only the parts it saves.
"""

from __future__ import annotations

import datetime
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from tqdm import tqdm

from meshloom.checkpoint import folders
from meshloom.checkpoint.folders import CheckpointInfo
from meshloom.checkpoint.hf import HFFolder, load_into_model_parts
from meshloom.checkpoint.hf_export import refuse_foreign_exports
from meshloom.checkpoint.resume_settings import refuse_what_a_resume_cannot_honour
from meshloom.checkpoint.integrity import checkpoint_files, compute_checksums
from meshloom.checkpoint.interrupts import interrupts_deferred
from meshloom.checkpoint.offline import write_side_files
from meshloom.checkpoint.reading import (
    CorruptCheckpointError,
    check_model_shapes,
    distributed,
    load_state,
    read_index,
    verify,
)
from meshloom.checkpoint.state import DataState, ModelState, OptimizerState, RngState, TrainingParts, TrainState
from meshloom.config.errors import ConfigError
from meshloom.config.schema import Config
from meshloom.data.build import state_reshards
from meshloom.parallel.dims import DEGREE_NAMES
from meshloom.parallel.distributed import rank
from meshloom.planning.run_plan import RunPlan


def checkpoint_root(config: Config, run_dir: Path) -> Path:
    """checkpoint.folder, relative to the run folder unless absolute."""
    folder = Path(config.checkpoint.folder)
    return folder if folder.is_absolute() else Path(run_dir) / folder


def _world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def _say(message: str) -> None:
    if rank() == 0:
        tqdm.write(f"checkpoint: {message}")


@dataclass
class _PendingSave:
    step: int
    finished: Future  # resolves once the files are written, checksummed and committed


class Checkpointer:
    def __init__(self, plan: RunPlan, run_dir: Path, before_commit: Callable[[int], None] | None = None):
        """Checks settings and files only; nothing heavy is read or built yet.

        before_commit(step) runs on every rank once a save's files are written, before it is committed (a hook for
        fault-injection tests)."""
        self.plan = plan
        self.config = config = plan.config
        c = self.settings = config.checkpoint
        self.root = checkpoint_root(config, run_dir)
        complete, _ = folders.list_checkpoints(self.root)
        if c.resume and not complete:
            found = folders.describe_without_complete(self.root)
            raise ConfigError(
                f"checkpoint.resume is set but {self.root} holds no complete checkpoint{found}; start without "
                "--checkpoint.resume, or point job.dump_folder / checkpoint.folder at the run to continue"
            )
        if c.enable and not c.resume and complete:
            raise ConfigError(
                f"{self.root} already holds checkpoints up to step {complete[-1].step}; pass --checkpoint.resume true to "
                "continue from them, or choose another job.dump_folder"
            )
        self.initial: HFFolder | CheckpointInfo | None = None
        if c.initial_load_path and not c.resume:
            self.initial = self._open_initial(c.initial_load_path, c.initial_load_format)
        self._precheck(complete)
        if c.enable:
            self._refuse_foreign_folders(complete)
        continued = folders.lineage_of(complete[-1].path) if c.resume and complete else None
        refuse_foreign_exports(config, run_dir, complete[-1].step if c.resume and complete else 0, continued)
        # The run lineage whose step folders this run may replace and prune: a fresh one, or on resume the one of
        # the checkpoint it continues (set when that is loaded).
        self.lineage = uuid.uuid4().hex
        self._pending: _PendingSave | None = None
        self._async_group: dist.ProcessGroup | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stager: DefaultStager | None = None
        self._before_commit = before_commit or (lambda step: None)
        self.parts: TrainingParts | None = None
        # The checkpoint a resume continued from (None: a fresh start, or an initial load of weights only).
        self.loaded_from: Path | None = None

    @staticmethod
    def _open_initial(path: str, fmt: str) -> HFFolder | CheckpointInfo:
        try:
            return HFFolder(path) if fmt == "hf" else folders.open_checkpoint(Path(path))
        except ValueError as err:
            hint = "" if fmt == "hf" else "; for a Hugging Face folder set checkpoint.initial_load_format = 'hf'"
            raise ConfigError(f"checkpoint.initial_load_path: {err}{hint}") from None

    def _precheck(self, complete: list[CheckpointInfo]) -> None:
        """Compare what will be loaded with the configured model's shapes before anything heavy is built."""
        spec, args = self.plan.spec, self.plan.model_args
        if isinstance(self.initial, HFFolder):
            if self.initial.spec.name != spec.name:
                raise ConfigError(
                    f"checkpoint.initial_load_path {self.initial.path} holds a {self.initial.spec.name} model, but "
                    f"model.name = {spec.name!r}; set model.name = {self.initial.spec.name!r} and a matching model.flavor"
                )
            differences = spec.hf.shape_differences(args, self.initial.args)
            if differences:
                raise ConfigError(
                    f"checkpoint.initial_load_path {self.initial.path} does not match model.flavor="
                    f"{self.config.model.flavor!r} (Hugging Face vs flavor): {'; '.join(differences)}; pick the matching flavor"
                )
            self.initial.check()
            return
        target = complete[-1] if self.settings.resume else self.initial
        if target is None:
            return
        if self.settings.resume:
            refuse_what_a_resume_cannot_honour(self.config, target.path)  # before the checkpoint's shapes are compared
            if complete[0].step >= self.config.training.steps:  # whichever one loads: the same verdict, early
                self._check_steps_left(target.path, target.step)
            self._check_data_degree(target)
        try:
            metadata = read_index(target.path)
        except CorruptCheckpointError:
            return  # reported, or fallen back from, when loading
        if self.settings.resume:
            self._check_optimizer(target.path, metadata)
        with torch.device("meta"):
            model = spec.model_cls(args)
        check_model_shapes(target.path, metadata, {n: t.shape for n, t in model.state_dict().items()}, complete_model=True)

    def _refuse_foreign_folders(self, complete: list[CheckpointInfo]) -> None:
        """A step folder this run would save into but did not start is refused now, not after the training before it."""
        start = complete[-1].step if self.settings.resume and complete else 0
        last, interval = self.config.training.steps, self.settings.interval
        scheduled = {s for s in range(start + 1, last + 1) if s % interval == 0 or s == last}
        lineage = folders.lineage_of(complete[-1].path) if self.settings.resume and complete else None
        foreign = folders.foreign_step_folders(self.root, lineage, scheduled)
        if foreign:
            raise ConfigError(
                f"{foreign[0]} already exists and was not made by this run, which would save step {foreign[0].name[5:]} "
                f"there; move it out of {self.root} (it is never overwritten) or choose another checkpoint.folder"
            )

    def _check_optimizer(self, path: Path, metadata: Metadata) -> None:
        """An optimizer's state carries over only to the same optimizer: say so, rather than a missing key."""
        keys = [k for k in metadata.state_dict_metadata if k.startswith("optimizer.")]
        if not keys:
            return  # weights only
        saved = "Muon" if any(k.endswith("momentum_buffer") for k in keys) else "AdamW"
        if saved != self.config.optimizer.name:
            raise ConfigError(
                f"checkpoint.resume: {path} holds {saved} optimizer state, but optimizer.name = "
                f"{self.config.optimizer.name!r}; resume with --optimizer.name {saved}, or start fresh from its weights "
                f"with --checkpoint.initial_load_path {path} and a new job.dump_folder"
            )

    def _check_steps_left(self, path: Path, step: int) -> None:
        if step >= self.config.training.steps:
            raise ConfigError(
                f"checkpoint.resume: the latest checkpoint, {path}, is at step {step}, and training.steps = "
                f"{self.config.training.steps}, so there is nothing left to train; raise --training.steps above {step}"
            )

    def _check_data_degree(self, target: CheckpointInfo) -> None:
        """A loader whose position is per data-parallel rank resumes only under the degree it was saved with."""
        try:
            layout = target.marker.get("layout")
        except ValueError:
            return  # a damaged marker is reported, or fallen back from, when loading
        if state_reshards(self.config.data) or not layout:
            return
        saved = layout.get("dp_replicate", 1) * layout.get("dp_shard", 1)
        if saved != self.plan.dp:
            raise ConfigError(
                f"{target.path} was saved with data-parallel degree {saved} (world size {target.marker.get('world_size')}), "
                f"this run has {self.plan.dp} (world size {self.plan.world_size}); data.dataset = {self.config.data.dataset!r} keeps "
                f"a read position per data-parallel rank, which cannot be resharded. Resume with dp_replicate x dp_shard "
                f"= {saved}, or prepare the data with `meshloom prepare` (data.dataset = 'shards' resumes under any degree)"
            )

    # ----------------------------------------------------------------- binding and loading

    def bind(self, parts: TrainingParts) -> None:
        """The state to save and load: model parts with their optimizers, LR schedule, progress and data position."""
        self.parts = parts
        self.model_state = ModelState(parts.model_parts)
        self.app_state: dict[str, Any] = {
            "model": self.model_state,
            "optimizer": OptimizerState(parts.model_parts, parts.optimizers),
            "train": TrainState(parts.progress, parts.lr_scheduler),
            "data": DataState.of_rank(parts.data_loader, parts.dp_rank),
        }
        self.rng_state = RngState(rank())

    def load(self) -> None:
        """Resume, or apply the initial load (if configured); `bind` first."""
        assert self.parts is not None, "bind() the training parts first"
        if self.settings.resume:
            self._resume()
            if self.loaded_from is not None:
                self._check_steps_left(self.loaded_from, self.parts.progress.step)
        elif isinstance(self.initial, HFFolder):
            start = time.perf_counter()
            load_into_model_parts(self.parts.model_parts, self.initial)
            _say(f"loaded Hugging Face weights from {self.initial.path} in {time.perf_counter() - start:.2f} s")
        elif isinstance(self.initial, CheckpointInfo):
            self._load_checkpoint(self.initial, weights_only=True)

    def _load_checkpoint(self, info: CheckpointInfo, weights_only: bool | None) -> None:
        """weights_only None: as the checkpoint's marker says (a weights-only save has nothing else)."""
        start = time.perf_counter()
        try:
            marker = info.marker
        except ValueError as err:
            raise CorruptCheckpointError(str(err)) from None
        weights_only = info.weights_only if weights_only is None else weights_only
        metadata = read_index(info.path)
        verify(info)
        expected = {name: t.shape for name, t in self.model_state.state_dict().items()}
        check_model_shapes(info.path, metadata, expected, complete_model=self.plan.dims.pp == 1)
        state: dict[str, Any] = {"model": self.model_state}
        if not weights_only:
            state.update(self.app_state)
            state["data"] = self.app_state["data"].entry_to_load(metadata.state_dict_metadata)
            # Random streams belong to ranks: continue them only when every rank has its predecessor.
            if marker.get("world_size") == _world_size() and f"rng.{self.rng_state.key}.torch" in metadata.state_dict_metadata:
                state["rng"] = self.rng_state
        load_state(state, info.path)
        if not weights_only:
            self.loaded_from = info.path
            if (lineage := folders.lineage_of(info.path)) is not None:
                self.lineage = lineage
        what = "weights" if weights_only else "full state"
        _say(f"loaded {what} of step {info.step} from {info.path} in {time.perf_counter() - start:.2f} s")

    def _resume(self) -> None:
        complete, _ = folders.list_checkpoints(self.root)
        for i in range(len(complete) - 1, -1, -1):
            info = complete[i]
            try:
                self._load_checkpoint(info, weights_only=None)
                return
            except CorruptCheckpointError as err:
                if i == 0:
                    raise CorruptCheckpointError(f"{err}; no earlier complete checkpoint is left in {self.root}") from None
                if not self.settings.fallback_on_corrupt:
                    raise CorruptCheckpointError(
                        f"{err}; set checkpoint.fallback_on_corrupt = true to resume from the previous complete "
                        f"checkpoint ({complete[i - 1].path.name}) instead, or remove {info.path}"
                    ) from None
                _say(f"WARNING: {err}; falling back to {complete[i - 1].path.name}")

    def reload_latest(self) -> int | None:
        """Load the latest complete checkpoint again (a rollback); returns its step, or None if there is none yet."""
        self.wait()
        if not folders.list_checkpoints(self.root)[0]:
            return None
        self._resume()
        return self.parts.progress.step

    # ----------------------------------------------------------------- saving

    def maybe_save(self) -> None:
        """After each step: commit a finished background save; save when the interval (or the last step) is reached."""
        if self._pending is not None and self._pending.finished.done():
            self.wait()
        if not self.settings.enable:
            return
        step = self.parts.progress.step
        last = step >= self.config.training.steps
        if step % self.settings.interval == 0 or last:
            self.save(step, wait=last)

    def save(self, step: int, wait: bool = False) -> None:
        with interrupts_deferred():
            self._save(step, wait)

    def _save(self, step: int, wait: bool) -> None:
        start = time.perf_counter()  # training is blocked from here, including any wait for the previous save
        self.wait()  # one save in flight at a time
        path = folders.step_dir(self.root, step)
        if rank() == 0:
            if path.exists():
                if not folders.owned_by(path, self.lineage):
                    raise ConfigError(
                        f"{path} already exists and was not made by this run; move it out of {self.root} (it is never "
                        "overwritten) or choose another checkpoint.folder"
                    )
                folders.remove(path)  # left by a crashed or superseded save of this run
            folders.claim(path, self.lineage, step)
            write_side_files(path, self.config, self.plan.spec, self.plan.model_args)
        if distributed():
            dist.barrier()
        state = {**self.app_state, "rng": self.rng_state}
        if self.settings.async_mode == "async":
            group = self._checkpoint_group()
            # Returns once the state is copied to host memory; a DCP thread writes the files.
            upload = dcp.async_save(
                state, storage_writer=FileSystemWriter(path), process_group=group, async_stager=self._host_stager(),
                no_dist=not distributed(),
            )  # fmt: skip
            blocking = time.perf_counter() - start
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshloom-checkpoint")
            finished = self._executor.submit(lambda: self._finish(step, path, upload.result(), group, start, blocking))
            self._pending = _PendingSave(step, finished)
            if wait:
                self.wait()
        else:
            metadata = dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=not distributed())
            self._finish(step, path, metadata, None, start, blocking=None)  # the step waits for all of it

    def _host_stager(self) -> DefaultStager:
        """One stager for the whole run: it keeps its host buffers (pinned on GPUs) and refills them at each save,
        instead of allocating and faulting in a fresh copy of the state every time. Saves never overlap, so a
        buffer is only refilled after the previous save finished writing it."""
        if self._stager is None:
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(
                StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False)
            )
        return self._stager

    def _checkpoint_group(self) -> dist.ProcessGroup | None:
        """Background saves talk on their own gloo group so they never interleave with training collectives."""
        if distributed() and self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; re-raises its failure."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.finished.result()

    def finish_on_interrupt(self) -> None:
        """Ctrl-C: let the background save in flight finish and commit, as a sync save would (a second Ctrl-C
        abandons it; its folder then stays incomplete and is never loaded)."""
        if self._pending is None:
            return
        _say(f"interrupted: waiting for the save of step {self._pending.step} to finish (Ctrl-C again to abandon it)")
        try:
            self.wait()
        except KeyboardInterrupt:
            _say("the save in flight was abandoned")

    def _finish(self, step: int, path: Path, metadata: Metadata, group: dist.ProcessGroup | None, start: float,
                blocking: float | None) -> None:  # fmt: skip
        """Checksum the files, then rank 0 commits. DCP's coordinator (rank 0) returns from a save only after
        every rank reported its files written, and the checksum gather is one more rendezvous of all ranks."""
        self._before_commit(step)
        checksums = compute_checksums(path, checkpoint_files(metadata), group)
        if rank() != 0:
            return
        total = time.perf_counter() - start
        blocking = total if blocking is None else blocking
        folders.commit(path, {
            "step": step,
            "kind": "full",
            "lineage": self.lineage,
            "world_size": _world_size(),
            "layout": {name: getattr(self.plan.dims, name) for name in DEGREE_NAMES},
            "async": self.settings.async_mode == "async",
            "blocking_seconds": round(blocking, 6),
            "total_seconds": round(total, 6),
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "checksums": checksums,
        })  # fmt: skip
        mode = "async" if self.settings.async_mode == "async" else "sync"
        _say(f"step {step} saved to {path} ({mode}): training blocked {blocking:.3f} s, total {total:.3f} s")
        for removed in folders.prune(self.root, self.settings.keep_last_k, self.lineage):
            _say(f"removed {removed}")
