"""Training runs that stop after a checkpoint and resume, possibly under another layout.

A case is a deterministic fp32 run of the `tiny` model (the parity harness's settings) under one layout.
It may stop right after the save at `stop_after` (as a job killed after a checkpoint would) and may
resume from its run folder. Each case reports its per-step losses and the dataset sample ids all ranks
consumed at each step. Cases of the same world size run in turn inside one launch (testing/ranks.py).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from meshloom.testing.layout_parity import ParityCase, run_args
from meshloom.testing.ranks import run_ranks


class _Stop(Exception):
    """Raised right after the checkpoint at stop_after is committed."""


@dataclass
class Case:
    name: str
    run_dir: str
    layout: str = ""  # parity layout spec, e.g. "dp_shard=2,tp=2"; "" = one process
    steps: int = 10
    stop_after: int | None = None
    overrides: list[str] = field(default_factory=list)
    # At stop_after, every rank is killed with SIGKILL once the checkpoint is committed (launch_killed), instead of
    # leaving its training loop.
    kill: bool = False

    @property
    def world_size(self) -> int:
        return ParityCase.parse(self.layout).world_size

    def argv(self, workdir: Path) -> list[str]:
        layout = ParityCase.parse(self.layout)
        settings = ["--training.deterministic", "true", "--job.dump_folder", self.run_dir, *layout.overrides()]
        return run_args(self.steps, workdir, [*settings, *self.overrides])


@dataclass
class CaseResult:
    losses: list[float]
    sample_ids: list[list[int]]  # per step, over all data-parallel ranks, sorted
    # sha256 of every full (unsharded) model and optimizer tensor when the case ended, by state-dict key.
    final_state: dict[str, str] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)  # per step, before clipping
    # Per-step auxiliary losses the model reports itself (e.g. mtp_loss), by name.
    aux: dict[str, list[float]] = field(default_factory=dict)
    # Per step, the heads QK-clip rescaled and those within rounding of tau, as in layout_parity.Curve.
    clipped_heads: list[list[list]] = field(default_factory=list)
    near_tau_heads: list[list[list]] = field(default_factory=list)


def state_digest(trainer) -> dict[str, str]:
    """Hashes of the trainer's whole model and optimizer state, gathered from every rank's shards and stages:
    two runs with equal digests hold bitwise-equal weights and optimizer moments, whatever their layout."""
    import hashlib

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    digests: dict[str, str] = {}

    def add(prefix: str, state: dict) -> None:
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                data = value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                digests[f"{prefix}.{key}"] = hashlib.sha256(data).hexdigest()

    for part, optimizer in zip(trainer.model_parts, trainer.optimizers):
        add("model", get_model_state_dict(part, options=full))
        add("optimizer", get_optimizer_state_dict(part, optimizer, options=full))
    if dist.is_initialized():  # pipeline stages hold different keys; data-parallel ranks the same ones
        everyone: list[dict[str, str]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, digests)
        digests = {key: value for rank_digests in everyone for key, value in rank_digests.items()}
    return digests


def run_case(case: Case, workdir: Path) -> CaseResult:
    """Train this case in this process (one rank of a launch, or alone)."""
    import torch.distributed as dist

    from meshloom.config.loader import load_config
    from meshloom.train.trainer import Trainer

    trainer = Trainer(load_config(case.argv(workdir)))
    consumed: list[list[int]] = []
    loader_next = trainer.data.train.next_batch

    def recording_next_batch():
        batch = loader_next()
        consumed.append(batch.sample_ids.tolist())
        return batch

    trainer.data.train.next_batch = recording_next_batch
    losses: list[float] = []
    grad_norms: list[float] = []
    aux: dict[str, list[float]] = {}
    clipped: list[list[list]] = []
    near: list[list[list]] = []
    train_step = trainer.train_step

    def recording_train_step():
        result = train_step()
        losses.append(result.loss)
        grad_norms.append(result.grad_norm)
        for name, value in result.aux.items():
            aux.setdefault(name, []).append(value)
        clipped.append([list(head) for head in trainer.qk_clip.clipped])
        near.append([list(head) for head in trainer.qk_clip.near_tau])
        return result

    trainer.train_step = recording_train_step
    save = trainer.checkpointer.maybe_save

    def save_then_maybe_stop() -> None:
        save()
        if trainer.step == case.stop_after:
            trainer.checkpointer.wait()
            if case.kill:
                _killed_now(Path(case.run_dir), losses, grad_norms)
            raise _Stop

    trainer.checkpointer.maybe_save = save_then_maybe_stop
    try:
        trainer.train()
    except _Stop:  # as a killed job: nothing after the save runs, but this process leaves its replica quorum
        trainer.replicas.shutdown()
        trainer.logger.close()
    if dist.is_initialized():
        everyone: list[list[list[int]]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, consumed)
    else:
        everyone = [consumed]
    per_step = [sorted(set().union(*(rank_ids[i] for rank_ids in everyone))) for i in range(len(consumed))]
    return CaseResult(losses, per_step, state_digest(trainer), grad_norms, aux, clipped, near)


KILLED_RESULT = "killed_case.json"


def _killed_now(run_dir: Path, losses: list[float], grad_norms: list[float]) -> None:
    """Every rank SIGKILLs itself once all have passed the save, as a lost node would end the job; rank 0 first
    leaves the losses it trained in the run folder (nothing else of the process survives)."""
    import os
    import signal

    import torch.distributed as dist

    from meshloom.parallel.distributed import rank

    if rank() == 0:
        (run_dir / KILLED_RESULT).write_text(json.dumps({"losses": losses, "sample_ids": [], "grad_norms": grad_norms}))
    if dist.is_initialized():
        dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def launch_killed(case: Case, workdir: Path) -> CaseResult:
    """Run a case with `kill` on its own launch, which must end with its ranks killed by SIGKILL; its losses up to
    the kill, read from the run folder."""
    from meshloom.testing.ranks import RanksFailed

    assert case.kill and case.stop_after is not None, case
    cases_file = workdir / f"killed_{case.run_dir.replace('/', '_')}.json"
    cases_file.write_text(json.dumps([asdict(case)]))
    try:
        run_ranks(worker, case.world_size, cases_file, workdir / "killed_results.json", workdir)
    except RanksFailed as err:
        if "SIGKILL" not in str(err).splitlines()[0]:
            raise
    else:
        raise AssertionError(f"{case.name} was to be killed at step {case.stop_after} and ended normally")
    return CaseResult(**json.loads((Path(case.run_dir) / KILLED_RESULT).read_text()))


def launch(cases: list[Case], workdir: Path) -> dict[str, CaseResult]:
    """Run multi-rank cases, one launch per world size, in the given order within each."""
    by_world: dict[int, list[Case]] = defaultdict(list)
    for case in cases:
        by_world[case.world_size].append(case)
    results: dict[str, CaseResult] = {}
    for world_size, group in sorted(by_world.items()):
        cases_file = workdir / f"resume_cases_{world_size}.json"
        out_file = workdir / f"resume_results_{world_size}.json"
        cases_file.write_text(json.dumps([asdict(c) for c in group]))
        run_ranks(worker, world_size, cases_file, out_file, workdir)
        results.update({name: CaseResult(**data) for name, data in json.loads(out_file.read_text()).items()})
    return results


def worker(cases_file: Path, out_file: Path, workdir: Path) -> None:
    from meshloom.parallel.distributed import rank, shutdown_and_exit

    results = {}
    for spec in json.loads(cases_file.read_text()):
        case = Case(**spec)
        results[case.name] = asdict(run_case(case, workdir))
    if rank() == 0:
        out_file.write_text(json.dumps(results))
    shutdown_and_exit(0)
