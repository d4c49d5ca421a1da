"""`data.shards` weights, `data.stages`, `data.max_epochs` and `data.on_exhausted` -> a checked `Mixture`.

The recipe names sources by their folder's name (or the folder as written in data.shards) and
gives stage starts in steps or tokens; the mixture holds them as sample positions of the global
order, which do not depend on the data-parallel degree (a step is training.global_batch_size
samples; a token count is rounded up to whole samples). Every mistake is a one-line UserError
naming the setting, raised by RunPlan.build before anything is built.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshloom.config.errors import UserError
from meshloom.config.schema import DataConfig
from meshloom.data.mixing import check_weights
from meshloom.data.schedule import Stage

_STAGE_KEYS = ("start_step", "start_tokens", "weights", "transition", "transition_steps", "transition_tokens")


@dataclass(frozen=True)
class Mixture:
    names: list[str]
    stages: list[Stage]  # the first is data.shards's weights, from position 0
    max_epochs: list[int]  # per source, 0 = no limit
    drop: bool  # data.on_exhausted == "drop"

    def describe(self) -> dict[str, Any]:
        """What a checkpoint compares on resume (plain JSON values)."""
        return {
            "names": list(self.names),
            "stages": [{"start": s.start, "weights": list(s.weights), "ramp": s.ramp} for s in self.stages],
            "max_epochs": list(self.max_epochs),
            "on_exhausted": "drop" if self.drop else "repeat",
        }


def source_names(folders: list[str]) -> list[str]:
    """Each source's name: its folder's last part, or the folder as written when two share that part."""
    short = [Path(folder.rstrip("/")).name or folder for folder in folders]
    return [s if short.count(s) == 1 else f for s, f in zip(short, folders)]


def _source_index(name: Any, names: list[str], folders: list[str], setting: str) -> int:
    for candidates in (names, folders):
        if name in candidates:
            return candidates.index(name)
    match = difflib.get_close_matches(str(name), names, n=1)
    hint = f"did you mean {match[0]!r}? " if match else ""
    raise UserError(f"{setting} names unknown source {name!r}; {hint}the sources of data.shards are {', '.join(names)}")


def _count(stage: dict[str, Any], key: str, where: str) -> int:
    value = stage[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise UserError(f"{where}.{key} must be a whole number >= 0, got {value!r}")
    return value


def _position(stage: dict[str, Any], step_key: str, token_key: str, where: str, samples_per_step: int, seq_len: int, required: bool) -> int | None:
    given = [k for k in (step_key, token_key) if k in stage]
    if len(given) > 1:
        raise UserError(f"{where} gives both {step_key} and {token_key}; give one")
    if not given:
        if required:
            raise UserError(f"{where} needs {step_key} (or {token_key}): where the stage begins")
        return None
    value = _count(stage, given[0], where)
    return value * samples_per_step if given[0] == step_key else -(-value // seq_len)


def _weights(stage: dict[str, Any], where: str, names: list[str], folders: list[str]) -> tuple[float, ...]:
    given = stage.get("weights")
    if not isinstance(given, dict) or not given:
        raise UserError(f"{where}.weights must be a table of source name -> positive weight, e.g. weights = {{{names[0]} = 1.0}}")
    weights = [0.0] * len(names)
    for name, value in given.items():
        k = _source_index(name, names, folders, f"{where}.weights")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value != value or value == float("inf"):
            raise UserError(
                f"{where}.weights.{name} must be a positive number, got {value!r}; leave a source out of a stage to draw nothing from it"
            )
        weights[k] = float(value)
    drawn = [w for w in weights if w > 0]
    check_weights(drawn, f"{where}.weights", [n for n, w in zip(names, weights) if w > 0])
    return tuple(weights)


def build_mixture(config: DataConfig, samples_per_step: int, seq_len: int, total_steps: int | None = None) -> Mixture:
    """The checked mixture of a `data.dataset = "shards"` run (no file is read). With `total_steps` (training.steps),
    a stage that would start only after the last step is refused: it would never run."""
    from meshloom.data.shards import parse_shards_setting  # shards.py builds on this module

    specs = parse_shards_setting(config.shards)
    folders = [folder for folder, _ in specs]
    names = source_names(folders)
    base = tuple(weight for _, weight in specs)
    check_weights(list(base), "data.shards", names)
    stages = [Stage(0, base)]
    for i, stage in enumerate(config.stages):
        where = f"data.stages[{i}]"
        unknown = sorted(set(stage) - set(_STAGE_KEYS))
        if unknown:
            raise UserError(f"{where} has unknown key {unknown[0]!r}; a stage takes {', '.join(_STAGE_KEYS)}")
        start = _position(stage, "start_step", "start_tokens", where, samples_per_step, seq_len, required=True)
        transition = stage.get("transition", "step")
        if transition not in ("step", "linear"):
            raise UserError(f"{where}.transition must be \"step\" or \"linear\", got {transition!r}")
        ramp = _position(stage, "transition_steps", "transition_tokens", where, samples_per_step, seq_len, required=False)
        if transition == "linear" and not ramp:
            raise UserError(f"{where}: a linear transition needs transition_steps (or transition_tokens) > 0")
        if transition == "step" and ramp:
            raise UserError(f"{where} gives a transition length but transition = \"step\"; set transition = \"linear\"")
        previous = stages[-1]
        settled = previous.start + previous.ramp
        if start < previous.start or (start == previous.start and i > 0):
            raise UserError(
                f"{where} starts at sample {start}, not after the previous stage's sample {previous.start}; "
                "list data.stages in order of their start, each later than the last"
            )
        if start < settled:
            raise UserError(
                f"{where} starts at sample {start}, inside data.stages[{i - 1}]'s linear transition (until sample "
                f"{settled}); start it later or shorten that transition"
            )
        if total_steps is not None and start >= total_steps * samples_per_step:
            raise UserError(
                f"{where} starts at sample {start} (step {start // samples_per_step + 1}), after the last step "
                f"(training.steps = {total_steps}), so it would never run; start it earlier, raise training.steps or drop the stage"
            )
        stages.append(Stage(start, _weights(stage, where, names, folders), ramp or 0))
    if len(stages) > 1 and stages[1].start == 0 and not stages[1].ramp:  # a stage at step 0 replaces data.shards's weights
        stages = stages[1:]
    max_epochs = [0] * len(names)
    for name, epochs in config.max_epochs.items():
        k = _source_index(name, names, folders, "data.max_epochs")
        if epochs < 1:
            raise UserError(f"data.max_epochs.{name} must be >= 1 (leave the source out for no limit), got {epochs}")
        max_epochs[k] = epochs
    return Mixture(names, stages, max_epochs, config.on_exhausted == "drop")


def check_mixture_settings(config: DataConfig, samples_per_step: int, seq_len: int, total_steps: int) -> None:
    """RunPlan.build's check: the mixture settings are sound, and every stage starts within training.steps (that
    they belong to a shards run is declared in meshloom/planning/features.py)."""
    if config.dataset == "shards":
        build_mixture(config, samples_per_step, seq_len, total_steps)
