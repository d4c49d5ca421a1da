"""Loss parity: a parallel layout must compute what one process computes.

`meshloom parity --layout dp_shard=2,tp=2 ...` trains the `tiny` model for a few steps in one fp32 process
(the reference), then under each layout on gloo ranks (testing/ranks.py), and compares per-step losses and
the final gradient norm. Layouts that need the same number of ranks share one launch.

Tolerances: fp32 layouts must match to FP32_TOLERANCE (reductions only reorder sums; measured at most 9.5e-7).
A layout with bf16 in it (`mixed_precision=bf16`, or `fsdp_reduce_dtype=bfloat16`) is compared with the fp32
reference to BF16_TOLERANCE. Measured max |dloss| over the 10 steps of the test suites (torch 2.13 CPU, gloo,
2026-11-30): FSDP 2 bf16 2.10e-3, TP 2 bf16 6.9e-4, FSDP 2 with bf16 gradient reduction 1.2e-4, PP 2 bf16
4.2e-4 (4 layers), CP 2 bf16 2.12e-3, PP 2 x TP 2 x CP 2 bf16 2.21e-3; the bound is about twice the largest.
Layouts with `float8.enable=true` add Float8's own drift from bf16 (FLOAT8_LOSS_BOUND_VS_BF16 in
meshloom/parallel/float8.py) on top of the bf16 bound.
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from meshloom.config.errors import UserError
from meshloom.parallel.dims import DEGREE_NAMES
from meshloom.parallel.float8 import FLOAT8_LOSS_BOUND_VS_BF16
from meshloom.planning.layout import Layout
from meshloom.testing.ranks import run_ranks

FP32_TOLERANCE = 1e-5
BF16_TOLERANCE = 5e-3
TRAINING_KEYS = ("mixed_precision",)


def base_overrides(steps: int, workdir: Path, builtin_tokenizer: bool = True, reads_corpus: bool = True) -> list[str]:
    """A tiny, fast, deterministic run; the data cache is shared so only the reference builds it. The built-in
    tokenizer's vocabulary is set only for runs that use it, and the corpus's size only for runs that read the corpus
    (the built-in dataset or tokenizer): a setting that cannot act is refused."""
    vocab = ["--data.vocab_size", "512"] if builtin_tokenizer else []
    corpus = ["--data.max_bytes", "400000", "--data.cache_dir", str(workdir / "cache")] if reads_corpus or builtin_tokenizer else []
    return [
        "--model.flavor", "tiny",
        "--training.steps", str(steps),
        "--training.seq_len", "64",
        "--training.global_batch_size", "8",
        "--training.seed", "7",
        "--optimizer.lr", "1e-2",
        "--lr_scheduler.warmup_steps", "2",
        *corpus,
        *vocab,
        "--validation.enable", "false",
        "--metrics.tensorboard", "false",
        "--metrics.progress_bar", "false",
        "--metrics.peak_tflops", "1",
    ]


def run_args(steps: int, workdir: Path, settings: list[str]) -> list[str]:
    """base_overrides followed by `settings`, with the built-in tokenizer's vocabulary only where it is used."""
    file_tokenizer = "--data.tokenizer" in settings and settings[settings.index("--data.tokenizer") + 1] != "builtin"
    dataset = settings[settings.index("--data.dataset") + 1] if "--data.dataset" in settings else "builtin"
    return base_overrides(steps, workdir, not file_tokenizer, reads_corpus=dataset == "builtin" or not file_tokenizer) + settings


@dataclass
class ParityCase:
    """One case of the harness: a layout and any other settings, written as `key=value,...` (bare keys are
    parallelism or training settings, dotted keys any setting). Its degrees are a planning `Layout`."""

    spec: str
    settings: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> ParityCase:
        settings = {}
        for item in filter(None, spec.split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                raise UserError(f"layout item {item!r} in {spec!r} must look like key=value, e.g. dp_shard=2")
            settings[key.strip()] = value.strip()
        return cls(spec, settings)

    @property
    def layout(self) -> Layout:
        return Layout(**{name: int(self.settings.get(name, 1)) for name in DEGREE_NAMES})

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def tolerance(self) -> float:
        bf16 = "bf16" in (self.settings.get("mixed_precision"), self.settings.get("training.mixed_precision")) or (
            "bfloat16" in (self.settings.get("fsdp_reduce_dtype"), self.settings.get("parallelism.fsdp_reduce_dtype"))
        )
        if self.settings.get("float8.enable", "false").lower() == "true":
            return BF16_TOLERANCE + FLOAT8_LOSS_BOUND_VS_BF16
        return BF16_TOLERANCE if bf16 else FP32_TOLERANCE

    def setting_args(self) -> list[str]:
        """Bare keys are parallelism settings (mixed_precision is training's); dotted keys are any setting."""
        args = []
        for key, value in self.settings.items():
            if "." not in key:
                key = f"{'training' if key in TRAINING_KEYS else 'parallelism'}.{key}"
            args += [f"--{key}", value]
        return args

    def overrides(self, global_batch: int = 8) -> list[str]:
        """The layout's settings; the batch is split over its data-parallel ranks unless it sets local_batch_size."""
        dp_shard = ["--parallelism.dp_shard", "1"] if "dp_shard" not in self.settings else []
        local_batch = [] if "training.local_batch_size" in self.settings else ["--training.local_batch_size", str(global_batch // self.dp)]
        return dp_shard + self.setting_args() + local_batch


@dataclass
class Curve:
    losses: list[float]
    grad_norms: list[float]
    # Held-out loss after the last step; None unless the run enables validation.
    validation: float | None = None
    # Per-step auxiliary losses the model reports itself (e.g. mtp_loss), by name.
    aux: dict[str, list[float]] = field(default_factory=dict)
    # Per step, the attention heads QK-clip rescaled, as sorted [layer, head] pairs (all empty unless
    # optimizer.qk_clip_threshold > 0), and the heads whose largest logit was within rounding of the threshold (clipped
    # or not depending on summation order).
    clipped_heads: list[list[list]] = field(default_factory=list)
    near_tau_heads: list[list[list]] = field(default_factory=list)


def run_steps(argv: list[str]) -> Curve:
    """Train in this process (one rank of a launch, or the 1-process reference) and record every step."""
    from meshloom.config.loader import load_config
    from meshloom.train.trainer import Trainer

    trainer = Trainer(load_config(argv))
    results, clipped, near = [], [], []
    for _ in range(trainer.config.training.steps):
        results.append(trainer.train_step())
        clipped.append([list(head) for head in trainer.qk_clip.clipped])
        near.append([list(head) for head in trainer.qk_clip.near_tau])
    aux = {name: [r.aux[name] for r in results] for name in (results[0].aux if results else {})}
    return Curve([r.loss for r in results], [r.grad_norm for r in results], trainer.validate(), aux, clipped, near)


def clip_mismatches(
    ours: list[list[list]], theirs: list[list[list]], near_ours: list[list[list]], near_theirs: list[list[list]]
) -> list[tuple[int, list[tuple]]]:
    """(step, heads) for every step where the two runs clipped different heads (per-step [layer, head] lists, as in
    Curve), leaving out the heads whose largest logit lay within rounding of tau in either run."""
    assert len(ours) == len(theirs), (len(ours), len(theirs))
    mismatches = []
    for step, (a, b, near_a, near_b) in enumerate(zip(ours, theirs, near_ours, near_theirs, strict=True), start=1):
        ties = {tuple(head) for head in near_a + near_b}
        differ = ({tuple(head) for head in a} ^ {tuple(head) for head in b}) - ties
        if differ:
            mismatches.append((step, sorted(differ)))
    return mismatches


def check_cases(cases: dict[str, list[str]], world_size: int) -> None:
    """Plan every case before any rank starts, so a layout the model or batch cannot take fails here, by name."""
    from meshloom.config.loader import load_config
    from meshloom.planning.run_plan import RunPlan

    for spec, argv in cases.items():
        try:
            RunPlan.build(load_config(argv), world_size)
        except ValueError as err:
            raise UserError(f"layout {spec!r}: {err}") from None


def launch(layouts: list[ParityCase], steps: int, workdir: Path, common: list[str] | None = None) -> dict[str, Curve]:
    """One launch per world size; every layout of that size runs in turn inside it."""
    by_world: dict[int, list[ParityCase]] = defaultdict(list)
    for layout in layouts:
        by_world[layout.world_size].append(layout)
    curves: dict[str, Curve] = {}
    for world_size, group in sorted(by_world.items()):
        cases = {
            layout.spec: run_args(steps, workdir, [*(common or []), *layout.overrides()])
            + ["--job.dump_folder", str(workdir / f"run_{i}_{world_size}")]
            for i, layout in enumerate(group)
        }
        check_cases(cases, world_size)
        cases_file = workdir / f"cases_{world_size}.json"
        out_file = workdir / f"curves_{world_size}.json"
        cases_file.write_text(json.dumps(cases))
        run_ranks(worker, world_size, cases_file, out_file)
        for spec, data in json.loads(out_file.read_text()).items():
            curves[spec] = Curve(**data)
    return curves


def worker(cases_file: Path, out_file: Path) -> None:
    """One rank of a launch: every case in turn; rank 0 writes the curves."""
    from meshloom.parallel.distributed import rank, shutdown_and_exit

    curves = {spec: run_steps(argv).__dict__ for spec, argv in json.loads(cases_file.read_text()).items()}
    if rank() == 0:
        out_file.write_text(json.dumps(curves))
    shutdown_and_exit(0)


@dataclass
class Comparison:
    layout: ParityCase
    curve: Curve
    max_loss_diff: float
    grad_norm_diff: float
    # Largest per-step difference of any auxiliary loss (0 when the model reports none).
    max_aux_diff: float = 0.0

    @property
    def ok(self) -> bool:
        return max(self.max_loss_diff, self.grad_norm_diff, self.max_aux_diff) <= self.layout.tolerance


def compare(
    layout_specs: list[str], steps: int = 10, workdir: Path | None = None, common: str = ""
) -> tuple[Curve, list[Comparison]]:
    """`common` settings (e.g. "model.n_layers=4") apply to the reference and every layout alike."""
    layouts = [ParityCase.parse(spec) for spec in layout_specs]
    common_args = ParityCase.parse(common).setting_args()
    workdir = Path(workdir or tempfile.mkdtemp(prefix="meshloom-parity-"))
    workdir.mkdir(parents=True, exist_ok=True)
    reference = run_steps(run_args(steps, workdir, common_args) + ["--job.dump_folder", str(workdir / "reference")])
    curves = launch(layouts, steps, workdir, common_args)
    comparisons = []
    for layout in layouts:
        curve = curves[layout.spec]
        loss_diff = max(abs(a - b) for a, b in zip(reference.losses, curve.losses, strict=True))
        aux_diff = max(
            (abs(a - b) for name, values in reference.aux.items() for a, b in zip(values, curve.aux[name], strict=True)),
            default=0.0,
        )
        comparisons.append(
            Comparison(layout, curve, loss_diff, abs(reference.grad_norms[-1] - curve.grad_norms[-1]), aux_diff)
        )
    return reference, comparisons


def plot(reference: Curve, comparisons: list[Comparison], out: Path) -> Path:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4))
    losses, diffs = figure.subplots(1, 2)
    steps = range(1, len(reference.losses) + 1)
    losses.plot(steps, reference.losses, "k-", linewidth=3, alpha=0.4, label="1 process (reference)")
    for c in comparisons:
        losses.plot(steps, c.curve.losses, "--", label=c.layout.spec)
        diffs.semilogy(steps, [abs(a - b) + 1e-12 for a, b in zip(reference.losses, c.curve.losses)], label=c.layout.spec)
    diffs.axhline(FP32_TOLERANCE, color="red", linewidth=1, label="fp32 tolerance")
    losses.set(xlabel="step", ylabel="loss", title="loss")
    diffs.set(xlabel="step", ylabel="|loss - reference|", title="difference from 1 process")
    losses.legend(fontsize=7)
    diffs.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out, dpi=110, format="png")
    return out
