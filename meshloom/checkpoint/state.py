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


class TrainState(Stateful):
    """Step, tokens seen and LR schedule of a trainer (global, equal on every rank)."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        # Tokens per step may change on resume (another batch size), so the count is carried, not derived.
        self.tokens_at_load = 0
        self.step_at_load = 0

    @property
    def tokens_seen(self) -> int:
        t = self.trainer
        return self.tokens_at_load + (t.step - self.step_at_load) * t.tokens_per_step

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        return {
            "step": t.step,
            "tokens_seen": self.tokens_seen,
            "lr_scheduler": t.lr_scheduler.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        t = self.trainer
        t.step = self.step_at_load = int(state_dict["step"])
        self.tokens_at_load = int(state_dict["tokens_seen"])
        t.lr_scheduler.load_state_dict(state_dict["lr_scheduler"])


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
