"""What a checkpoint holds, as `Stateful` objects that torch.distributed.checkpoint saves and loads.

Model and optimizer go through `get_state_dict`/`set_state_dict`, which give layout-independent names
(wrappers such as FSDP or activation checkpointing are stripped) and DTensor shards that DCP reshards on
load. A model is a list of parts: one module normally, several pipeline stages that keep their original
parameter names. Optimizer state is flattened to `state.<param name>.<key>`, so it follows the
parameters across layouts too.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

_OPTIMIZER_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class ModelState(Stateful):
    def __init__(self, parts: list[nn.Module]):
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.parts:
            merged.update(get_model_state_dict(part))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.parts:
            own = get_model_state_dict(part).keys()
            set_model_state_dict(part, {k: state_dict[k] for k in own}, options=StateDictOptions(strict=True))


class OptimizerState(Stateful):
    """One optimizer per model part (the same optimizer may be listed for a single part)."""

    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]):
        assert len(parts) == len(optimizers), "one optimizer per model part"
        self.pairs = list(zip(parts, optimizers))
        self._keys: list[set[str]] = []

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        self._keys = []
        for part, optimizer in self.pairs:
            own = get_optimizer_state_dict(part, optimizer, options=_OPTIMIZER_OPTIONS)
            self._keys.append(set(own))
            merged.update(own)
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        keys = self._keys or [set(get_optimizer_state_dict(p, o, options=_OPTIMIZER_OPTIONS)) for p, o in self.pairs]
        for (part, optimizer), own in zip(self.pairs, keys):
            set_optimizer_state_dict(part, optimizer, {k: state_dict[k] for k in own}, options=_OPTIMIZER_OPTIONS)


class TrainProgress:
    """How far training has come: the step, and the tokens seen (global, equal on every rank).

    Tokens per step may change on resume (another batch size), so the count is carried, not derived from the step.
    """

    def __init__(self, tokens_per_step: int, step: int = 0):
        self.step = step
        self.tokens_per_step = tokens_per_step
        self._tokens_at_load = 0
        self._step_at_load = step

    @property
    def tokens_seen(self) -> int:
        return self._tokens_at_load + (self.step - self._step_at_load) * self.tokens_per_step

    def restore(self, step: int, tokens_seen: int) -> None:
        self.step = self._step_at_load = step
        self._tokens_at_load = tokens_seen


class TrainState(Stateful):
    """The progress and the learning-rate schedule, saved together under "train"."""

    def __init__(self, progress: TrainProgress, lr_scheduler: Any):
        self.progress = progress
        self.lr_scheduler = lr_scheduler

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.progress.step,
            "tokens_seen": self.progress.tokens_seen,
            "lr_scheduler": self.lr_scheduler.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.progress.restore(int(state_dict["step"]), int(state_dict["tokens_seen"]))
        self.lr_scheduler.load_state_dict(state_dict["lr_scheduler"])


class DataState(Stateful):
    """The training loader's position, under this rank's data-parallel index.

    Stored as JSON text: DCP only loads the keys the loading side already has, and a loader's state may change
    shape between saves (a stream's position is None at first, a nested dict later). A loader whose state is
    one global counter has the same state on every rank, so any entry restores it under any degree; a loader
    with per-rank state (streaming) reads its own entry and checks the degree itself.
    """

    def __init__(self, loader: Any, key: str):
        self.loader = loader
        self.key = key

    @classmethod
    def of_rank(cls, loader: Any, dp_rank: int) -> DataState:
        return cls(loader, f"dp_rank_{dp_rank}")

    def entry_to_load(self, saved_keys: Any) -> DataState:
        """This rank's entry when the checkpoint has it, else data-parallel rank 0's."""
        return self if f"data.{self.key}" in saved_keys else DataState(self.loader, "dp_rank_0")

    def state_dict(self) -> dict[str, Any]:
        return {self.key: json.dumps(self.loader.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(json.loads(state_dict[self.key]))


class RngState(Stateful):
    """This rank's random generators (torch CPU and CUDA, Python, NumPy), stored as tensors and numbers.

    Saved under the rank's own key; restored only when the world size is unchanged, because after a
    layout change no rank has a predecessor whose random stream it should continue.
    """

    def __init__(self, rank: int):
        self.key = f"rank_{rank}"

    def state_dict(self) -> dict[str, Any]:
        version, mt_state, gauss = random.getstate()
        np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
        state = {
            "torch": torch.get_rng_state(),
            "python": {"version": version, "state": torch.tensor(mt_state, dtype=torch.int64), "gauss": gauss},
            "numpy": {
                "kind": np_kind,
                "keys": torch.from_numpy(np_keys.astype(np.int64)),
                "pos": int(np_pos),
                "has_gauss": int(np_has_gauss),
                "gauss": float(np_gauss),
            },
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return {self.key: state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict[self.key]
        torch.set_rng_state(state["torch"])
        py = state["python"]
        random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


@dataclass
class TrainingParts:
    """Everything a full checkpoint holds, handed to the checkpointer by whoever built it.

    model_parts: the model, or this rank's pipeline stages (parameter names as in the whole model);
    optimizers: one per model part (the same optimizer may be listed for a single part).
    """

    model_parts: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    lr_scheduler: Any
    progress: TrainProgress
    data_loader: Any
    dp_rank: int = 0
