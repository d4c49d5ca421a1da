"""The memory estimator against measured CPU runs: parameters, gradients, optimizer state and activations per rank.

    PYTHONPATH=. .venv/bin/python benchmarks/memory_estimate.py [--flavor debug] [--seq-len 128] [--batch 2]
    PYTHONPATH=. .venv/bin/python benchmarks/memory_estimate.py --table     # every family x layout x AC mode
        [--models "qwen3_next;llama3"]  # only these families' cells (names of TABLE_MODELS)
        [--save measured.json]        # keep the measured bytes per layout and rank
        [--measured measured.json]    # compare a changed estimator with them without training again

Layouts that need the same number of ranks run in turn inside one launch of gloo ranks forked from an imported
process (meshloom/testing/ranks.py: a fresh interpreter costs each rank its imports, several seconds on a small
machine). The estimate is computed by the launcher from each layout's plan.

Each layout trains two steps of a small model. The second step runs inside torch's
memory tracker (`FSDPMemTracker` with FSDP, `MemTracker` otherwise), which follows every tensor storage and
sorts it into parameters, gradients, optimizer state, activations and temporaries; the activation figure is
the tracker's at its peak. Tensors that activation checkpointing recomputes in backward are activations too
(`book_recomputation_as_activations`): with them, the peak of a checkpointed run is the backward of its last
block, not the end of forward. Parameters, gradients (kept after the step) and optimizer state are counted
from the local shards. Each is divided by the estimate of `meshloom.planning.memory_estimate` for the same
rank (the rank furthest from 1 shown). Targets: parameters, gradients and optimizer exact; activations within 20%
(the table's aim: 0.9-1.1).

The activation figure leaves out the moments in which FSDP gathers parameters (`unshard_phase`): the trackers book
the all-gather's output buffer as an activation when it is allocated and as "All Gather" only once the collective
runs, so a per-op activation peak would otherwise count a whole gathered block (the largest FSDP unit's
parameters) as activations.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import weakref
from pathlib import Path

import torch
import torch.utils.checkpoint

from meshloom.config.errors import UserError
from meshloom.observe.metrics import local_tensor_bytes
from meshloom.testing.layout_parity import ParityCase
from meshloom.testing.ranks import RanksFailed, call_in_file, run_ranks

LAYOUTS = [
    "",  # one process
    "dp_shard=2",
    "tp=2",
    "pp=2,pipeline.schedule=GPipe,pipeline.microbatches=1",  # the tracker follows one call per module
    "dp_shard=2,tp=2",
    "dp_shard=4",
    # Activation checkpointing over 1, 2 and 4 ranks of FSDP, TP and PP.
    "activation_checkpoint.mode=full",
    "activation_checkpoint.mode=selective_op",
    "dp_shard=2,activation_checkpoint.mode=full",
    "dp_shard=2,activation_checkpoint.mode=selective_op",
    "tp=2,activation_checkpoint.mode=full",
    "tp=2,activation_checkpoint.mode=selective_op",
    "pp=2,pipeline.schedule=GPipe,pipeline.microbatches=1,activation_checkpoint.mode=full",
    "pp=2,pipeline.schedule=GPipe,pipeline.microbatches=1,activation_checkpoint.mode=selective_op",
    "dp_shard=4,activation_checkpoint.mode=full",
    "dp_shard=2,tp=2,activation_checkpoint.mode=selective_op",
    "dp_shard=2,pp=2,pipeline.schedule=GPipe,pipeline.microbatches=1,activation_checkpoint.mode=full",
    "activation_checkpoint.mode=selective_layer,activation_checkpoint.every_k_layers=2",
    "dp_shard=2,activation_checkpoint.mode=selective_layer,activation_checkpoint.every_k_layers=4",
]
# Largest allowed |measured / estimated - 1|: parameters, gradients and optimizer state are counted exactly.
TARGETS = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.20, "peak": 0.10}

# The table (--table): each family at a small shape (2 blocks, Qwen3-Next 4; the MoE families' second block is sparse,
# DeepSeek-V3's prediction module is a third), under every layout its shape allows and each activation-checkpointing mode.
TABLE_MODELS = {
    "llama3": "model.name=llama3,model.flavor=debug,model.n_layers=2",
    "qwen3": "model.name=qwen3,model.flavor=debug,model.n_layers=2",
    "qwen3 MoE": "model.name=qwen3,model.flavor=debug_moe,model.n_layers=2",
    "deepseek_v3": "model.name=deepseek_v3,model.flavor=debug,model.n_layers=2",
    # Four blocks: three Gated DeltaNet and one gated attention, every one sparse.
    "qwen3_next": "model.name=qwen3_next,model.flavor=debug,model.n_layers=4",
    # Two blocks: one sliding-window and one full-attention block (gpt-oss alternates them), both sparse.
    "gpt_oss": "model.name=gpt_oss,model.flavor=debug,model.n_layers=2",
}
MOE_MODELS = ("qwen3 MoE", "deepseek_v3", "qwen3_next", "gpt_oss")
TABLE_LAYOUTS = {
    "1 process": "",
    "FSDP 2": "dp_shard=2",
    "TP 2": "tp=2",
    "PP 2": "pp=2,pipeline.schedule=GPipe,pipeline.microbatches=1",
    "EP 2": "dp_shard=2,ep=2",
    "CP 2": "cp=2",
    "FSDP 2 x TP 2": "dp_shard=2,tp=2",
}
AC_MODES = ("none", "full", "selective_op")
# Cells that need another shape: Qwen3 `debug` ties its embedding to the output, which pipeline parallelism refuses,
# so its PP row runs the untied `tiny` (dim 64, vocabulary 512).
TABLE_OVERRIDES = {("qwen3", "PP 2"): "model.flavor=tiny"}


def table_models(names: str | None = None) -> list[str]:
    """The table's families: all of TABLE_MODELS, or the ';'-separated `names` among them."""
    if not names:
        return list(TABLE_MODELS)
    chosen = [name.strip() for name in names.split(";")]
    unknown = [name for name in chosen if name not in TABLE_MODELS]
    if unknown:
        raise UserError(f"--models names {unknown[0]!r}, which the table lacks; use one of {'; '.join(TABLE_MODELS)}")
    return chosen


def table_specs(models: list[str] | None = None) -> dict[tuple[str, str, str], str]:
    """(model, layout, AC mode) -> the layout spec the benchmark runs, for `models` (default: every family)."""
    specs = {}
    for model in models or TABLE_MODELS:
        model_spec = TABLE_MODELS[model]
        for name, layout in TABLE_LAYOUTS.items():
            if name == "EP 2" and model not in MOE_MODELS:
                continue
            for ac in AC_MODES:
                parts = [model_spec, TABLE_OVERRIDES.get((model, name), ""), layout, f"activation_checkpoint.mode={ac}"]
                specs[(model, name, ac)] = ",".join(filter(None, parts))
    return specs


def overrides(spec: str) -> list[str]:
    return ParityCase.parse(spec).setting_args()


def world_size(spec: str) -> int:
    return ParityCase.parse(spec).world_size


@contextlib.contextmanager
def book_recomputation_as_activations(tracker):
    """Book every tensor made while torch.utils.checkpoint recomputes a block as an activation.

    The trackers book tensors made in backward as temporaries unless they are inside a module that runs
    forward a second time, which they detect from module hooks. meshloom checkpoints the block's `forward`
    (not the module), so the block's own hooks do not fire again: FSDPMemTracker, which watches only FSDP
    modules, books the whole recomputation as temporaries, and MemTracker books the tensors made between
    the block's submodules (the residual sums) as temporaries. Recomputation always runs inside
    checkpoint's `_recomputation_hook`, so that is where the flag is set.
    """
    original = torch.utils.checkpoint._recomputation_hook
    # Any non-None module: the trackers' own submodule hooks must not end the region early.
    sentinel = torch.nn.Module()

    class MarkedRecomputation(original):
        def __enter__(self):
            self._outer = (tracker._in_ac, tracker._ac_mod)
            tracker._in_ac, tracker._ac_mod = True, weakref.ref(sentinel)
            return super().__enter__()

        def __exit__(self, *exc):
            tracker._in_ac, tracker._ac_mod = self._outer
            return super().__exit__(*exc)

    torch.utils.checkpoint._recomputation_hook = MarkedRecomputation
    try:
        yield
    finally:
        torch.utils.checkpoint._recomputation_hook = original


def trace_flex_attention(tracker_types: tuple[type, ...]) -> None:
    """Let the trackers follow FlexAttention's eager CPU operator (gpt-oss's attention) tensor by tensor.

    FlexAttention's forward and backward are higher-order operators, which a dispatch mode must handle itself; the
    trackers do not, and refuse them. Registered here for each tracker class: run the operator's eager (dense)
    implementation with the tracker back on the mode stack, so that every aten op inside it (the whole score
    matrix, its softmax and their gradients) is booked like any other op's output. The mask and score functions,
    which the dense implementation evaluates under vmap, run with the tracker off the stack (it cannot read a batched
    tensor's storage): their outputs, the boolean mask and the (identity) scores, are not booked. Registered once
    per process."""
    from torch._higher_order_ops.flex_attention import (
        flex_attention,
        flex_attention_backward,
        sdpa_dense,
        sdpa_dense_backward,
    )
    from torch.nn.attention import flex_attention as flex_api
    from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode, _push_mode

    if getattr(flex_api._vmap_for_bhqkv, "without_tracker", False):
        return
    vmap_for_bhqkv = flex_api._vmap_for_bhqkv

    def vmap_without_tracker(fn, *args, **kwargs):
        # A traced score function (backward's joint graph) is a module: the trackers' global module hooks would read
        # its batched inputs, so it is called through its forward, which skips them.
        mapped = vmap_for_bhqkv(fn.forward if isinstance(fn, torch.nn.Module) else fn, *args, **kwargs)

        def call(*inputs):
            if not isinstance(_get_current_dispatch_mode(), tuple(tracker_types)):
                return mapped(*inputs)  # block masks are made outside the trackers too
            tracker = _pop_mode()
            try:
                return mapped(*inputs)
            finally:
                _push_mode(tracker)

        return call

    vmap_without_tracker.without_tracker = True
    # The dense implementations import it from the module at each call, so this is the one they use.
    flex_api._vmap_for_bhqkv = vmap_without_tracker

    def under_mode(dense):
        def run(mode, *args, **kwargs):
            # The operator's dispatch took the tracker off the stack for this call; put it back around the dense ops.
            _push_mode(mode)
            try:
                return dense(*args, **kwargs)
            finally:
                _pop_mode()

        return run

    for tracker_type in tracker_types:
        for operator, dense in ((flex_attention, sdpa_dense), (flex_attention_backward, sdpa_dense_backward)):
            operator.py_impl(tracker_type)(under_mode(dense))


def unshard_phase(tracker) -> bool:
    """Whether FSDPMemTracker is inside FSDP's pre-forward or pre-backward hook, where FSDP allocates the all-gather
    buffer (booked as an activation until the collective re-books it) and nothing of the model runs."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPState

    return getattr(tracker, "_fsdp_state", None) in (_FSDPState.PRE_FW, _FSDPState.PRE_BW)


def track_activation_peak(tracker) -> list[int]:
    """The largest activation total the tracker holds after any op, as a one-element list filled in while
    it runs. (Its module snapshots are taken when the total peaks, which under checkpointing can miss the
    activation peak: the recomputation runs next to gradients that are freed again by the total's peak.)
    FSDP's unshard hooks are skipped (see the module docstring): every activation alive there is still alive
    at the model's next op, which is counted."""
    peak = [0]
    update = tracker._update_peak_stats

    def update_and_record(state):
        if unshard_phase(tracker):
            update(state)
            return
        for by_kind in tracker._curr_mem_snap.values():
            acts = sum(v for k, v in by_kind.items() if str(getattr(k, "value", k)) == "Activation")
            peak[0] = max(peak[0], acts)
        update(state)

    tracker._update_peak_stats = update_and_record
    return peak


def measure_case(spec: str, flavor: str, seq_len: int, batch: int, workdir: Path) -> dict[str, dict[str, int]]:
    """Train `spec` for two steps on this rank and return its measured bytes by kind (the launcher estimates)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    from meshloom.config import load_config
    from meshloom.train.trainer import Trainer

    trace_flex_attention((FSDPMemTracker, MemTracker))
    config = load_config(case_args(spec, flavor, seq_len, batch, workdir))
    trainer = Trainer(config)
    trainer.train_step()  # optimizer state exists from here on
    parts = list(trainer.model) if isinstance(trainer.model, (list, torch.nn.ModuleList)) else [trainer.model]
    optimizers = getattr(trainer, "optimizers", [trainer.optimizer])
    trainer.optimizer.zero_grad = lambda *a, **k: None  # keep this step's gradients for counting
    fsdp = [p for p in parts if isinstance(p, FSDPModule)]
    if fsdp and len(parts) == 1:
        tracker = FSDPMemTracker(parts[0], optimizers[0])
    else:
        tracker = MemTracker()
        tracker.track_external(*parts, *optimizers)
    activation_peak = track_activation_peak(tracker)
    with tracker, book_recomputation_as_activations(tracker):
        trainer.train_step()
    # The whole peak: the most the tracker held at once after any op of the step (parameters, gradients, optimizer
    # state, activations, FSDP's all-gather and reduce-scatter buffers and every temporary, unshard hooks included).
    whole_peak = max(tracker._peak_mem.values(), default=0)
    at_peak = {str(getattr(k, "value", k)): v for snap in tracker.get_tracker_snapshot("peak").values() for k, v in snap.items()}
    params = [p for part in parts for p in part.parameters()]
    state = [v for opt in optimizers for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0]
    measured = {
        "params": local_tensor_bytes(params),
        "grads": local_tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": local_tensor_bytes(state),
        "activations": activation_peak[0],
        "peak": whole_peak,
    }
    # What the tracker held by kind at that peak (a snapshot of the moment, not each kind's own peak).
    return {"measured": measured, "at_peak": at_peak}


def case_args(spec: str, flavor: str, seq_len: int, batch: int, workdir: Path) -> list[str]:
    """The run's settings: the benchmark's base, then the layout's (which may name another model or flavour). Each
    case has its own folder `workdir`; the tokenized data is shared by the cases next to it."""
    return [
        "--model.flavor", flavor, "--training.seq_len", str(seq_len), "--training.local_batch_size", str(batch),
        "--training.steps", "2", "--validation.enable", "false", "--metrics.tensorboard", "false",
        "--metrics.progress_bar", "false", "--metrics.peak_tflops", "1", "--data.max_bytes", "400000", "--data.vocab_size", "512",
        "--data.cache_dir", str(workdir.parent / "cache"), "--job.dump_folder", str(workdir / "run"),
        *overrides(spec),
    ]  # fmt: skip


def worker(cases_file: Path) -> None:
    """One rank of a launch: every case of the file in turn, each rank writing its own result per case. A case
    that fails (the same way on every rank: a layout the trainer refuses) records its error and the next runs."""
    import gc

    from meshloom.parallel.distributed import rank, shutdown_and_exit

    cases = json.loads(cases_file.read_text())
    for case in cases:
        out = Path(case["out"])
        try:
            result = measure_case(case["spec"], case["flavor"], case["seq_len"], case["batch"], out.parent)
        except Exception as err:  # noqa: BLE001 - reported per case by the launcher
            result = {"error": f"{type(err).__name__}: {err}".splitlines()[0]}
        (out.parent / f"{out.stem}_rank{rank()}.json").write_text(json.dumps(result))
        gc.collect()
    shutdown_and_exit(0)


def measure_many(specs: list[str], args: argparse.Namespace, workdir: Path) -> dict[str, list[dict] | str]:
    """Each spec's per-rank measured bytes (or why it did not run), one launch of forked ranks per world size."""
    from meshloom.config import load_config
    from meshloom.planning.run_plan import RunPlan

    results: dict[str, list[dict] | str] = {}
    by_world: dict[int, list[dict]] = {}
    for index, spec in enumerate(dict.fromkeys(specs)):
        n = world_size(spec)
        case_dir = workdir / f"case{index}"
        case_dir.mkdir(parents=True, exist_ok=True)
        try:  # a layout the model or batch cannot take is refused here, before any rank starts
            RunPlan.build(load_config(case_args(spec, args.flavor, args.seq_len, args.batch, case_dir)), n)
        except (ValueError, SystemExit) as err:
            results[spec] = f"refused: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
            continue
        case = {"spec": spec, "flavor": args.flavor, "seq_len": args.seq_len, "batch": args.batch, "out": str(case_dir / "result.json")}
        by_world.setdefault(n, []).append(case)
    for n, cases in sorted(by_world.items()):
        cases_file = workdir / f"cases_world{n}.json"
        cases_file.write_text(json.dumps(cases))
        failure = ""
        try:
            run_ranks(call_in_file, n, __file__, "worker", cases_file)
        except RanksFailed as err:  # read per case below: the cases that finished before it keep their results
            lines = [line for line in str(err).splitlines() if "Error" in line]
            failure = lines[-1] if lines else str(err).splitlines()[0]
        for case in cases:
            out = Path(case["out"])
            files = [out.parent / f"{out.stem}_rank{r}.json" for r in range(n)]
            if not all(f.exists() for f in files):
                results[case["spec"]] = failure or "no result"
                continue
            ranks = [json.loads(f.read_text()) for f in files]
            errors = [r["error"] for r in ranks if "error" in r]
            results[case["spec"]] = errors[0] if errors else ranks
    return results


def estimate_ranks(spec: str, args: argparse.Namespace, workdir: Path) -> list[dict[str, int]]:
    """The estimate for each rank of `spec`, from its plan alone (no process group): the launcher's own, so that
    saved measurements can be compared with a changed estimator without training again."""
    from meshloom.config import load_config
    from meshloom.planning.layout import layout_of, precision_from_config
    from meshloom.planning.memory_estimate import estimate_memory
    from meshloom.planning.run_plan import RunPlan

    n = world_size(spec)
    config = load_config(case_args(spec, args.flavor, args.seq_len, args.batch, workdir))
    plan = RunPlan.build(config, n)
    layout = layout_of(plan)
    # The kernels of the device the ranks train on (training.device "auto", as the trainer resolves it).
    precision = precision_from_config(config, "cuda" if torch.cuda.is_available() else "cpu")
    estimates = []
    for r in range(n):
        e = estimate_memory(plan.shape(), layout, args.seq_len, precision, stage_index=r // (n // layout.pp))
        estimates.append({"params": e.params, "grads": e.grads, "optimizer": e.optimizer, "activations": e.activations, "peak": e.peak})
    return estimates


def with_estimates(measured: dict[str, list[dict] | str], args: argparse.Namespace, workdir: Path) -> dict[str, list[dict] | str]:
    """Measured per-rank bytes joined with the current estimator's figures for the same ranks."""
    results: dict[str, list[dict] | str] = {}
    for spec, ranks in measured.items():
        if isinstance(ranks, str):
            results[spec] = ranks
            continue
        estimates = estimate_ranks(spec, args, workdir)
        results[spec] = [{**r, "estimated": e} for r, e in zip(ranks, estimates, strict=True)]
    return results


def measure_and_estimate(specs: list[str], args: argparse.Namespace, workdir: Path) -> dict[str, list[dict] | str]:
    """Each spec's per-rank measured and estimated bytes (or why it did not run), one launch per world size."""
    return with_estimates(measure_many(specs, args, workdir), args, workdir / "estimate")


def measure(spec: str, args: argparse.Namespace, workdir: Path, index: int) -> list[dict] | str:
    """One layout's per-rank measured and estimated bytes (or why it did not run), in its own launch."""
    return measure_and_estimate([spec], args, workdir / f"layout{index}")[spec]


def ratios_of(ranks: list[dict]) -> dict[str, float]:
    """Measured / estimated per kind, on the rank whose ratio is furthest from 1."""
    ratios = {}
    for kind in (k for k in TARGETS if k in ranks[0]["measured"]):
        pairs = [(r["measured"][kind], r["estimated"][kind]) for r in ranks]
        ratios[kind] = max(((m / e if e else float("inf")) for m, e in pairs), key=lambda x: abs(x - 1))
    return ratios


def print_layouts(specs: list[str], results: dict[str, list[dict] | str], args: argparse.Namespace) -> None:
    width = max(len(spec) for spec in specs + ["1 process"])
    print(f"model {args.flavor}, seq {args.seq_len}, batch {args.batch}, fp32: measured / estimated per rank (worst rank)")
    print(f"{'layout':<{width}} {'params':>8} {'grads':>8} {'optim':>8} {'act':>8} {'peak':>8} {'act MiB':>8}")
    worst = dict.fromkeys(TARGETS, 0.0)
    for spec in specs:
        ranks = results[spec]
        if isinstance(ranks, str):
            print(f"{spec or '1 process':<{width}} not run: {ranks}")
            continue
        ratios = ratios_of(ranks)
        for kind in ratios:
            worst[kind] = max(worst[kind], abs(ratios[kind] - 1))
        act_mib = max(r["measured"]["activations"] for r in ranks) / 2**20
        print(f"{spec or '1 process':<{width}} " + " ".join(f"{ratios.get(k, float('nan')):>8.3f}" for k in TARGETS) + f" {act_mib:>8.2f}")
    print("largest deviation: " + ", ".join(f"{k} {worst[k] * 100:.1f}% (target {TARGETS[k] * 100:.0f}%)" for k in TARGETS))


def print_table(results: dict[str, list[dict] | str], args: argparse.Namespace, models: list[str]) -> None:
    """Activations measured / estimated per family, layout and AC mode (worst rank); parameters, gradients and
    optimizer state listed only where they are not exact."""
    specs = table_specs(models)
    print(f"seq {args.seq_len}, batch {args.batch}, fp32; activations measured / estimated on the rank furthest from 1 "
          f"[/ on the busiest rank, where that differs] (measured MiB on the busiest rank); AC modes {', '.join(AC_MODES)}")  # fmt: skip
    for model in models:
        print(f"\n{model} ({TABLE_MODELS[model]})")
        print(f"{'layout':<14} " + " ".join(f"{ac:>22}" for ac in AC_MODES))
        for name in TABLE_LAYOUTS:
            if (model, name, AC_MODES[0]) not in specs:
                continue
            cells, notes = [], []
            if (model, name) in TABLE_OVERRIDES:
                notes.append(f"  with {TABLE_OVERRIDES[(model, name)]}")
            for ac in AC_MODES:
                ranks = results[specs[(model, name, ac)]]
                if isinstance(ranks, str):
                    cells.append(f"{'not run':>22}")
                    notes.append(f"  {ac}: {ranks}")
                    continue
                ratios = ratios_of(ranks)
                busiest = max(ranks, key=lambda r: r["measured"]["activations"])
                mib = busiest["measured"]["activations"] / 2**20
                at_busiest = busiest["measured"]["activations"] / busiest["estimated"]["activations"]
                ratio = f"{ratios['activations']:.3f}"
                if abs(at_busiest - ratios["activations"]) > 0.005:
                    ratio += f"/{at_busiest:.3f}"
                cells.append(f"{ratio:>13} ({mib:6.2f})")
                inexact = {k: round(v, 4) for k, v in ratios.items() if k not in ("activations", "peak") and v != 1.0}
                if inexact:
                    notes.append(f"  {ac}: not exact {inexact}")
            print(f"{name:<14} " + " ".join(cells))
            for note in notes:
                print(note)


def print_peak_table(results: dict[str, list[dict] | str], models: list[str]) -> None:
    """The whole peak measured / estimated per family, layout and AC mode: the lowest and highest ratio over the
    ranks, and the measured peak (MiB) of the rank that held the most."""
    specs = table_specs(models)
    print("\nwhole peak (parameters, gradients, optimizer state, activations, FSDP buffers, temporaries) measured / "
          "estimated: lowest-highest over the ranks (measured MiB, largest rank); target 0.9-1.1 on every rank")
    inside = total = 0
    for model in models:
        print(f"\n{model}")
        print(f"{'layout':<14} " + " ".join(f"{ac:>22}" for ac in AC_MODES))
        for name in TABLE_LAYOUTS:
            if (model, name, AC_MODES[0]) not in specs:
                continue
            cells = []
            for ac in AC_MODES:
                ranks = results[specs[(model, name, ac)]]
                if isinstance(ranks, str) or "peak" not in ranks[0]["measured"]:
                    cells.append(f"{'not measured':>22}")
                    continue
                ratios = [r["measured"]["peak"] / r["estimated"]["peak"] for r in ranks]
                mib = max(r["measured"]["peak"] for r in ranks) / 2**20
                total += 1
                inside += all(0.9 <= x <= 1.1 for x in ratios)
                cells.append(f"{min(ratios):.3f}-{max(ratios):.3f} ({mib:6.1f})")
            print(f"{name:<14} " + " ".join(f"{c:>22}" for c in cells))
    print(f"\n{inside} of {total} cells within 0.9-1.1 on every rank")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--layouts", default=";".join(LAYOUTS), help="';'-separated layouts (degrees or dotted config keys)")
    parser.add_argument("--table", action="store_true", help="every family x layout x AC mode (TABLE_MODELS, TABLE_LAYOUTS)")
    parser.add_argument("--models", help="with --table: ';'-separated families of TABLE_MODELS (default: all)")
    parser.add_argument("--save", type=Path, help="write the measured bytes per layout and rank to this JSON file")
    parser.add_argument("--measured", type=Path, help="compare the estimator with the measurements of an earlier --save "
                        "instead of training again")  # fmt: skip
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="meshloom-memory-estimate-"))
    models = table_models(args.models)
    specs = list(table_specs(models).values()) if args.table else args.layouts.split(";")
    if args.measured:
        saved = json.loads(args.measured.read_text())
        missing = [spec for spec in specs if spec not in saved]
        if missing:
            raise UserError(f"{args.measured} has no measurement of {missing[0]!r}; run without --measured to take it")
        measured = {spec: saved[spec] for spec in specs}
    else:
        measured = measure_many(specs, args, workdir)
    if args.save:
        args.save.write_text(json.dumps(measured, indent=1))
    results = with_estimates(measured, args, workdir / "estimate")
    if args.table:
        print_table(results, args, models)
        print_peak_table(results, models)
    else:
        print_layouts(specs, results, args)


if __name__ == "__main__":
    main()
