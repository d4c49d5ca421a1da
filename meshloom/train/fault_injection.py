"""Faults injected on purpose, for the chaos and recovery tests (`[fault_injection]` settings).

Every fault is off by default, and this is the only module that reads those settings: the trainer and the
checkpointer call the hooks below at fixed points, and a hook does nothing unless its setting names that
point. Process faults (kill, sleep, slow) fire only on one rank and in one torchrun restart attempt, so a
restarted run goes on normally; a NaN follows the data (a bad batch stays bad in every attempt).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import torch
from torch import nn

from meshloom.config.errors import UserError
from meshloom.config.schema import FaultInjectionConfig
from meshloom.parallel.distributed import rank, restart_attempt
from meshloom.tensors import local_tensor

# Wrappers that activation checkpointing and torch.compile put into parameter names.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")
# Pipeline stages sit in a ModuleList, which puts the stage index in front of the model's own names.
_STAGE_INDEX = re.compile(r"^\d+\.")


def plain_name(name: str) -> str:
    """A parameter's name in the single-device model."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return _STAGE_INDEX.sub("", name)


class FaultInjector:
    def __init__(self, config: FaultInjectionConfig):
        self.config = config

    def _targets_me(self) -> bool:
        return rank() == self.config.rank and restart_attempt() == self.config.attempt

    def _kill(self, where: str) -> None:
        print(f"fault injection: SIGKILL rank {rank()} {where}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def after_step(self, step: int) -> None:
        """End of a step (after its checkpoint, if any): kill_at_step."""
        if step == self.config.kill_at_step and self._targets_me():
            self._kill(f"after step {step}")

    def during_save(self, step: int) -> None:
        """A save whose files are written but not yet committed: kill_during_save."""
        if step == self.config.kill_during_save and self._targets_me():
            self._kill(f"while saving step {step}")

    def before_loss_reduce(self, step: int) -> None:
        """Just before the step's loss all-reduce: sleep_at_step (a hang) and slow_seconds (a straggler)."""
        if not self._targets_me():
            return
        if self.config.slow_seconds > 0:
            # Busy, not asleep: a straggler computes slowly, and its CPU time shows it.
            deadline = time.process_time() + self.config.slow_seconds
            while time.process_time() < deadline:
                pass
        if step == self.config.sleep_at_step and self.config.sleep_seconds > 0:
            print(f"fault injection: rank {rank()} sleeps {self.config.sleep_seconds} s at step {step}", file=sys.stderr, flush=True)
            time.sleep(self.config.sleep_seconds)

    @torch.no_grad()
    def flip_bit(self, step: int, model_parts: list[nn.Module]) -> None:
        """After the update of flip_bit_at_step: one flipped bit in one parameter on one rank."""
        if step != self.config.flip_bit_at_step or not self._targets_me():
            return
        from meshloom.train.replica_check import named_persistent_buffers  # it imports plain_name from here

        wanted = self.config.flip_bit_parameter
        params = [(plain_name(name), param) for part in model_parts for name, param in part.named_parameters()]
        for name, tensor in params + named_persistent_buffers(model_parts):
            if not wanted or name == wanted:
                local = local_tensor(tensor)
                words = local.view(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[local.element_size()])
                words[0] ^= 1
                print(f"fault injection: rank {rank()} flips a bit of {name} after step {step}", file=sys.stderr, flush=True)
                return
        raise UserError(
            f"fault_injection.flip_bit_parameter {wanted!r} is not a parameter or persistent buffer on rank {rank()}; "
            "name one from model.named_parameters() or model.state_dict(), or leave it empty for the first parameter"
        )

    @torch.no_grad()
    def after_backward(self, model: nn.Module, sample_ids: list[int]) -> None:
        """Gradients are ready: a batch holding nan_sample_id poisons nan_parameter's gradient with NaN."""
        if self.config.nan_sample_id < 0 or self.config.nan_sample_id not in sample_ids:
            return
        wanted = self.config.nan_parameter
        for name, param in model.named_parameters():
            if param.grad is not None and (not wanted or plain_name(name) == wanted):
                param.grad.fill_(float("nan"))
                return
        if isinstance(model, nn.ModuleList):
            return  # a pipeline rank without that parameter: the stage that holds it poisons it
        raise UserError(
            f"fault_injection.nan_parameter {self.config.nan_parameter!r} is not a parameter with a gradient on rank "
            f"{rank()}; name one from model.named_parameters(), or leave it empty for the first parameter with a gradient"
        )
