"""`meshloom launch slurm|k8s|ray`: run a recipe on a cluster that already has a scheduler.

    meshloom launch slurm --config configs/llama3_8b.toml --nodes 4 --gpus-per-node 8 --output train.sbatch
    meshloom launch k8s --config configs/llama3_8b.toml --nodes 4 --gpus-per-node 8 --image REGISTRY/meshloom:TAG \\
        --data-volume corpus --runs-volume runs --output trainjob.yaml
    meshloom launch ray --config configs/llama3_8b.toml --nodes 4 --gpus-per-node 8 --checkpoint.enable true

The recipe is checked first for every node count the job may run on (the same RunPlan the ranks build; with
--gpu-memory-gib also the dry run), then slurm writes an sbatch script, k8s a Kubeflow Trainer TrainJob, and ray
runs the training through Ray Train. Arguments after the options are config overrides (--section.field value).
"""

from __future__ import annotations

import argparse
import importlib.util
import posixpath
import shlex
import sys
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from meshloom.cli.numbers import count, number, positive_float, positive_int, CommandParser
from meshloom.output import check_output_file, write_output_file
from meshloom.config.errors import UserError
from meshloom.parallel.dims import DEGREE_NAMES

if TYPE_CHECKING:
    from meshloom.config.schema import Config
    from meshloom.planning.run_plan import RunPlan

EXTRAS = {"ray": ("ray", "ray"), "k8s": ("kubeflow_trainer_api", "k8s")}
# Options that act under some schedulers only; given to another, they are refused rather than ignored.
SCHEDULER_OPTIONS = {
    "output": ("slurm", "k8s"),
    "overwrite": ("slurm", "k8s"),
    "image": ("k8s",),
    "data_volume": ("k8s",),
    "runs_volume": ("k8s",),
    "address": ("ray",),
}


# The range of each numeric option (meshloom/cli/numbers.py).
NUMBERS = {
    "--nodes": (int, positive_int()),
    "--gpus-per-node": (int, positive_int()),
    "--min-nodes": (int, positive_int()),
    "--max-restarts": (int, count()),
    "--gpu-memory-gib": (float, positive_float()),
}


def _parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="meshloom launch", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("scheduler", choices=("slurm", "k8s", "ray"))
    parser.add_argument("--config", required=True, help="the recipe (TOML or YAML), as the nodes will find it")
    parser.add_argument("--nodes", type=number(NUMBERS, "--nodes"), required=True, help="nodes (the most, for an elastic run)")
    parser.add_argument("--gpus-per-node", type=number(NUMBERS, "--gpus-per-node"), required=True, help="ranks per node: GPUs (or CPU workers with training.device cpu)")
    parser.add_argument("--min-nodes", type=number(NUMBERS, "--min-nodes"), help="elastic: continue on as few as this many nodes (torchrun --nnodes MIN:MAX)")
    parser.add_argument("--max-restarts", type=number(NUMBERS, "--max-restarts"), help="torchrun restarts (slurm/k8s) or Ray worker-group restarts (ray)")
    parser.add_argument("--gpu-memory-gib", type=number(NUMBERS, "--gpu-memory-gib"), help="refuse a layout whose dry run exceeds this memory per GPU")
    parser.add_argument("--name", default="meshloom", help="job name (SLURM job, TrainJob, Ray run)")
    parser.add_argument("--output", type=Path, help="the file to write (slurm: NAME.sbatch, k8s: NAME.yaml)")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    parser.add_argument("--image", help="k8s: the container image holding meshloom")
    parser.add_argument("--data-volume", help="k8s: PersistentVolumeClaim with the data, mounted at /data")
    parser.add_argument("--runs-volume", help="k8s: PersistentVolumeClaim for run folders and checkpoints, mounted at /runs")
    parser.add_argument("--address", help="ray: the cluster to join (ray.init address); default: RAY_ADDRESS or a local one")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    opts, overrides = _parser().parse_known_args(argv)
    try:
        return _launch(opts, overrides, f"Written by: meshloom launch {shlex.join(argv)}")
    except UserError as err:
        print(f"meshloom: error: {err}", file=sys.stderr)
        return 2


def _refuse_foreign_options(opts: argparse.Namespace) -> None:
    for name, schedulers in SCHEDULER_OPTIONS.items():
        if getattr(opts, name) not in (None, False) and opts.scheduler not in schedulers:
            flag = "--" + name.replace("_", "-")
            raise UserError(
                f"{flag} is an option of meshloom launch {' and '.join(schedulers)} only; launch {opts.scheduler} would "
                f"ignore it, so drop {flag}"
            )


def _check_names(opts: argparse.Namespace) -> None:
    """Every name the scheduler reads, by that system's rules (meshloom/launch/names.py)."""
    from meshloom.launch import names

    if opts.scheduler != "k8s":
        names.check_job_name(opts.scheduler, opts.name)
        return
    names.check_trainjob_name(opts.name)
    if not opts.image:
        raise UserError("meshloom launch k8s needs --image: the container image with meshloom installed")
    names.check_image(opts.image)
    for flag, claim in (("--data-volume", opts.data_volume), ("--runs-volume", opts.runs_volume)):
        if claim is not None:
            names.check_claim_name(flag, claim)


def _refuse_an_empty_recipe(path: Path) -> None:
    """A recipe that sets nothing would launch the defaults (a tiny model on the built-in corpus) on the cluster."""
    from meshloom.config.loader import apply_file
    from meshloom.config.schema import Config

    config = Config()
    config.given = set()
    apply_file(config, path)
    if not config.given:
        raise UserError(f"--config {path} sets nothing, so the job would train meshloom's defaults; give the recipe of the run (see configs/)")


def _runs_on_the_volume(config: Config, overrides: list[str], name: str) -> list[str]:
    """With --runs-volume the run folder (and an absolute checkpoint.folder) must lie under its mount, or the run
    writes to the pod's own storage and is lost with it. Unset, job.dump_folder goes to RUNS_MOUNT/NAME."""
    from meshloom.launch.k8s import RUNS_MOUNT

    assert config.given is not None
    if "job.dump_folder" not in config.given:
        return [*overrides, "--job.dump_folder", f"{RUNS_MOUNT}/{name}"]
    mount = PurePosixPath(RUNS_MOUNT)
    for key, value in (("job.dump_folder", config.job.dump_folder), ("checkpoint.folder", config.checkpoint.folder)):
        path = PurePosixPath(posixpath.normpath(value))
        if (key == "job.dump_folder" or path.is_absolute()) and mount not in path.parents:
            raise UserError(
                f"{key} {value} is outside {RUNS_MOUNT}, where --runs-volume is mounted, so the run would write to the "
                f"pod's own storage and lose it; set --{key} under {RUNS_MOUNT}/ (or leave job.dump_folder unset)"
            )
    return overrides


def _launch(opts: argparse.Namespace, overrides: list[str], note: str) -> int:
    _refuse_foreign_options(opts)
    if opts.scheduler in EXTRAS:
        module, extra = EXTRAS[opts.scheduler]
        if importlib.util.find_spec(module) is None:
            raise UserError(f"meshloom launch {opts.scheduler} needs the {module} package; install it with pip install 'meshloom[{extra}]'")
    _check_names(opts)
    _refuse_an_empty_recipe(Path(opts.config))
    if opts.scheduler == "ray" and opts.min_nodes is not None:
        raise UserError("--min-nodes: an elastic node count runs under torchrun (slurm); a Ray run restarts on its full --nodes")
    if opts.scheduler == "k8s" and opts.min_nodes is not None:
        raise UserError("--min-nodes: a TrainJob's node count is its fixed numNodes; elastic node counts run under slurm")
    output = None
    if opts.scheduler != "ray":
        output = opts.output or Path(f"{opts.name}.{'sbatch' if opts.scheduler == 'slurm' else 'yaml'}")
        recipe = (("the --config recipe", Path(opts.config)),)
        check_output_file(output, opts.overwrite, recipe)  # before anything is checked or built

    from meshloom.config.loader import load_config
    from meshloom.launch.cluster import ClusterShape, check_cluster
    from meshloom.launch.torchrun import check_resumable, restarts_for, train_args

    config = load_config(["--config", opts.config, *overrides])
    if opts.scheduler == "k8s" and opts.runs_volume:
        overrides = _runs_on_the_volume(config, overrides, opts.name)
        config = load_config(["--config", opts.config, *overrides])
    shape = ClusterShape(opts.nodes, opts.gpus_per_node, opts.min_nodes or opts.nodes)
    plans = check_cluster(config, shape, opts.gpu_memory_gib)
    layouts = ", ".join(f"{p.world_size} ranks: {_layout(p)}" for p in plans)
    if opts.scheduler == "ray":
        from meshloom.launch.ray_train import run_on_ray

        restarts = 0 if opts.max_restarts is None else opts.max_restarts
        if restarts:
            check_resumable(config, f"--max-restarts {restarts}")
        print(f"meshloom launch ray: {layouts}; {restarts} restarts", flush=True)
        return run_on_ray(config, ["--config", opts.config, *overrides], shape, restarts, opts.name, opts.address)
    restarts = restarts_for(shape, opts.max_restarts)
    if restarts:
        check_resumable(config, f"--max-restarts {restarts}" if opts.max_restarts else f"--min-nodes {shape.min_nodes}")
    train = train_args(opts.config, overrides)
    if opts.scheduler == "slurm":
        from meshloom.launch.slurm import sbatch_script

        text = sbatch_script(opts.name, shape, restarts, train, f"{note}\nlayout: {layouts}")
        submit = f"sbatch {output}"
    else:
        import yaml

        from meshloom.launch.k8s import Volumes, container_command, train_job, validate

        manifest = train_job(opts.name, opts.image, shape, container_command(shape, restarts, train), Volumes(opts.data_volume, opts.runs_volume))
        validate(manifest)
        text = f"# layout: {layouts}\n" + yaml.safe_dump(manifest, sort_keys=False)
        submit = f"kubectl apply -f {output}"
    write_output_file(output, text, opts.overwrite, recipe)
    print(f"meshloom launch {opts.scheduler}: {layouts}\nwrote {output}; submit with: {submit}")
    return 0


def _layout(plan: RunPlan) -> str:
    d = plan.dims
    return " x ".join(f"{n} {getattr(d, n)}" for n in DEGREE_NAMES if getattr(d, n) > 1) or "one process"
