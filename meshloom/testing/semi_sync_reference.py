"""The exact reference of a DiLoCo or LocalSGD matrix cell: its replica groups emulated in one process.

Each group is a one-process Trainer with the cell's settings (fault tolerance on, so that the plan and the data
slices are the cell's own), whose replica-group hooks are replaced by an offline stand-in: it reads group g's slice
of every global batch, as a real group does, and never meets the other groups. The groups step in turn; after every
`fault_tolerance.sync_every`-th step this module performs the sync itself, written from the algorithms' definitions
rather than from torchft:

- local_sgd: every group's weights become the groups' mean;
- diloco: the pseudo-gradient (the weights at the last sync minus the group's current ones) is averaged over the
  groups and applied by an SGD of fault_tolerance.outer_lr, outer_momentum and outer_nesterov to the weights of the
  last sync; every group continues from the result.

A cell's groups (torchft's DiLoCo and LocalSGD on the Lighthouse, under the cell's layout) must report the same
per-step losses as these emulated groups within the cell's tolerance: a sync that averaged the wrong thing, skipped
the outer step or restored the wrong weights moves the losses after the first sync far beyond 1e-5.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from meshloom.testing.layout_parity import ParityCase, run_args
from meshloom.testing.ranks import run_ranks


@dataclass
class EmulatedCase:
    """The cell's one-process settings (`spec`, the parity harness's form) and the group settings of `group_args`."""

    name: str
    run_dir: str
    spec: str
    steps: int
    groups: int
    group_args: list[list[str]]  # per group: its fault-tolerance settings (replica id, semi_sync, sync_every)
    overrides: list[str] = field(default_factory=list)


@dataclass
class EmulatedResult:
    losses: list[list[float]]  # per group, steps 1..steps


class _OfflineGroup:
    """Replica group g of `size` for the trainer's hooks: its data slice, and nothing shared (between syncs a
    semi-synchronous group trains alone; the emulation performs the syncs)."""

    def __init__(self, size: int, replica_id: int):
        self.group_size, self.replica_id = size, replica_id

    def bind(self, state: object, logger: object) -> None:
        pass

    def start_step(self, step: int) -> None:
        pass

    def average(self, model_parts: list, loss_parts):  # noqa: ANN001, ANN201 - the trainer's own types
        return loss_parts

    def reduce_over_quorum(self, tensor: object, op: str) -> None:
        pass

    def should_commit(self) -> bool:
        return True

    def check(self, step: int, model_parts: list) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    def shutdown(self) -> None:
        pass


@contextlib.contextmanager
def _offline_group(size: int, replica_id: int) -> Iterator[None]:
    import meshloom.train.trainer as trainer_module

    original = trainer_module.join_replica_groups
    trainer_module.join_replica_groups = lambda *args, **kwargs: _OfflineGroup(size, replica_id)
    try:
        yield
    finally:
        trainer_module.join_replica_groups = original


class _Sync:
    """The sync of the groups' models, from their state at the last sync."""

    def __init__(self, models: list, settings: object):
        import torch

        self.models, self.settings = models, settings
        with torch.no_grad():
            self.anchor = [p.detach().clone().requires_grad_(True) for p in models[0].parameters()]
        self.outer = torch.optim.SGD(
            self.anchor, lr=settings.outer_lr, momentum=settings.outer_momentum, nesterov=settings.outer_nesterov
        )

    def __call__(self) -> None:
        import torch

        from meshloom.tensors import local_tensor

        per_group = [[local_tensor(p) for p in model.parameters()] for model in self.models]
        with torch.no_grad():
            for index, anchor in enumerate(self.anchor):
                params = [group[index] for group in per_group]
                if self.settings.semi_sync == "local_sgd":
                    anchor.copy_(torch.stack(params).mean(0))
                else:
                    anchor.grad = torch.stack([anchor - p for p in params]).mean(0)
            if self.settings.semi_sync == "diloco":
                self.outer.step()
                self.outer.zero_grad()
            for group in per_group:
                for param, anchor in zip(group, self.anchor, strict=True):
                    param.copy_(anchor)


def emulate(case: EmulatedCase, workdir: Path) -> EmulatedResult:
    """Train the case's groups in this process, in lockstep, syncing them as described above."""
    from meshloom.config.loader import load_config
    from meshloom.train.trainer import Trainer

    settings = ["--training.deterministic", "true", "--job.dump_folder", case.run_dir]
    trainers = []
    for g in range(case.groups):
        argv = run_args(case.steps, workdir, [*settings, *ParityCase.parse(case.spec).overrides(), *case.overrides, *case.group_args[g]])
        with _offline_group(case.groups, g):
            trainers.append(Trainer(load_config(argv)))
    ft = trainers[0].config.fault_tolerance
    sync = _Sync([t.model for t in trainers], ft)
    losses: list[list[float]] = [[] for _ in trainers]
    for step in range(1, case.steps + 1):
        for g, trainer in enumerate(trainers):
            losses[g].append(trainer.train_step().loss)
        if step % ft.sync_every == 0:
            sync()
    for trainer in trainers:
        trainer.logger.close()
    return EmulatedResult(losses)


def launch(cases: list[EmulatedCase], workdir: Path) -> dict[str, EmulatedResult]:
    """Every case in turn, in one forked process (one core)."""
    if not cases:
        return {}
    cases_file, out_file = workdir / "emulated_cases.json", workdir / "emulated_results.json"
    cases_file.write_text(json.dumps([asdict(c) for c in cases]))
    run_ranks(worker, 1, cases_file, out_file, workdir)
    return {name: EmulatedResult(**data) for name, data in json.loads(out_file.read_text()).items()}


def worker(cases_file: Path, out_file: Path, workdir: Path) -> None:
    from meshloom.parallel.distributed import shutdown_and_exit

    results = {}
    for spec in json.loads(cases_file.read_text()):
        case = EmulatedCase(**spec)
        results[case.name] = asdict(emulate(case, workdir))
    out_file.write_text(json.dumps(results))
    shutdown_and_exit(0)
