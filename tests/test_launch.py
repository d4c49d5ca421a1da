"""`meshloom launch slurm|k8s`: the TrainJob validates against kubeflow-trainer-api's models, its container command
trains on 2 CPU ranks, the sbatch script runs the same torchrun command, and every bad input is one line that
leaves no file behind. Also the `parallelism.resize` rule an elastic run restarts with."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cli_checks import one_line_error
from meshloom.config.loader import load_config
from meshloom.config.schema import ParallelismConfig
from meshloom.launch.k8s import validate
from meshloom.parallel.dims import MESH_DIMS, ParallelDims
from meshloom.cli.launch import main as launch
from meshloom.testing.layout_parity import base_overrides
from meshloom.train.trainer import Trainer

RDZV = ("--rdzv-backend", "--rdzv-endpoint", "--rdzv-id")


def _recipe(tmp_path: Path) -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text('[model]\nname = "llama3"\n')
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _error(capsys) -> str:
    return one_line_error(2, capsys.readouterr().err, "")


def _srun_words(script: str) -> list[str]:
    """The torchrun arguments on the sbatch script's srun line, with the shell's quoting removed."""
    line = next(l for l in script.splitlines() if l.startswith("srun "))
    words = shlex.split(line)
    return words[words.index("$TORCHRUN") + 1 :]


def _without_rendezvous(words: list[str]) -> list[str]:
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in RDZV:
            skip = True
        else:
            out.append(word)
    return out


def test_trainjob_validates_and_its_command_trains_two_cpu_ranks(tmp_path: Path, data_cache: Path, subprocess_env, capsys) -> None:
    (tmp_path / "cache").symlink_to(data_cache)
    recipe = _recipe(tmp_path)
    common = [*base_overrides(2, tmp_path), "--training.local_batch_size", "4"]
    train = [*common, "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_path / "run")]
    job, script = tmp_path / "job.yaml", tmp_path / "job.sbatch"
    shape = ["--config", str(recipe), "--nodes", "1", "--gpus-per-node", "2"]
    assert launch(["k8s", *shape, "--image", "registry.example/meshloom:1", "--data-volume", "corpus", "--output", str(job), *train]) == 0
    assert launch(["slurm", *shape, "--output", str(script), *train]) == 0
    assert "kubectl apply -f" in capsys.readouterr().out

    manifest = yaml.safe_load(job.read_text())
    parsed = validate(manifest)  # the kubeflow-trainer-api pydantic models, and nothing dropped on the way
    assert parsed.spec.runtime_ref.name == "torch-distributed" and parsed.spec.trainer.num_nodes == 1
    assert parsed.spec.trainer.resources_per_node.limits["nvidia.com/gpu"].actual_instance == "2"
    pod = parsed.spec.runtime_patches[0].training_runtime_spec.template.spec.replicated_jobs[0].template.spec.template.spec
    assert pod.volumes[0].persistent_volume_claim.claim_name == "corpus"
    assert pod.containers[0].name == "node" and pod.containers[0].volume_mounts[0].mount_path == "/data"
    with pytest.raises(Exception):
        validate({**manifest, "spec": {**manifest["spec"], "trainer": {**manifest["spec"]["trainer"], "numNode": 2}}})

    command = manifest["spec"]["trainer"]["command"]
    # The sbatch script runs the same torchrun command; only the rendezvous differs (c10d on the first node there,
    # the PET_* variables of the torch-distributed runtime here).
    text = script.read_text()
    assert _without_rendezvous(_srun_words(text)) == command[1:]
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text and "--rdzv-backend c10d" in text
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0

    # The container command as the runtime would start it: torchrun reads the rendezvous from PET_* variables.
    env = {**subprocess_env, "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(_free_port()), "PET_NODE_RANK": "0",
           "PET_NNODES": "1", "PET_NPROC_PER_NODE": "2", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *command[1:]], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert "dp_shard 2 on 2 rank(s)" in done.stdout
    reference = Trainer(load_config(["--config", str(recipe), *common, "--job.dump_folder", str(tmp_path / "ref")])).train()
    assert max(abs(r["loss"] - ref) for r, ref in zip([r for r in rows if "loss" in r], reference)) <= 1e-5


def test_bad_cluster_shapes_are_one_line_and_write_nothing(tmp_path: Path, capsys, monkeypatch) -> None:
    recipe = str(_recipe(tmp_path))
    out = tmp_path / "job.sbatch"
    base = ["--config", recipe, "--output", str(out)]

    # Four pipeline stages do not fit 3 nodes x 2 GPUs.
    assert launch(["slurm", *base, "--nodes", "3", "--gpus-per-node", "2", "--parallelism.pp", "4"]) == 2
    assert "--nodes 3 x --gpus-per-node 2 = 6 ranks do not fit" in _error(capsys) and not out.exists()
    # A layout of exactly 4 ranks (dp_shard set, no resize rule) on 2 nodes x 4 GPUs.
    assert launch(["k8s", *base, "--image", "i", "--nodes", "2", "--gpus-per-node", "4", "--parallelism.dp_shard", "4"]) == 2
    assert "needs exactly 4 ranks" in _error(capsys) and not out.exists()
    # Rule: tp divides the GPUs of one node.
    assert launch(["slurm", *base, "--nodes", "2", "--gpus-per-node", "4", "--parallelism.tp", "8"]) == 2
    assert "parallelism.tp=8 does not divide --gpus-per-node 4" in _error(capsys) and not out.exists()
    # An elastic run without checkpoints could only start over.
    assert launch(["slurm", *base, "--nodes", "2", "--min-nodes", "1", "--gpus-per-node", "2"]) == 2
    assert "--checkpoint.enable true" in _error(capsys) and not out.exists()
    # An existing file is kept unless --overwrite.
    out.write_text("mine")
    assert launch(["slurm", *base, "--nodes", "1", "--gpus-per-node", "2"]) == 2
    assert "--overwrite" in _error(capsys) and out.read_text() == "mine"
    assert launch(["slurm", *base, "--nodes", "2", "--min-nodes", "1", "--gpus-per-node", "2", "--overwrite",
                   "--checkpoint.enable", "true"]) == 0  # fmt: skip
    text = out.read_text()
    assert "--nnodes 1:2" in text and "#SBATCH --nodes=1-2" in text and "#SBATCH --no-kill" in text
    assert "--max-restarts 3" in text and "--kill-on-bad-exit=0" in text
    # The dry run must fit the GPU memory given.
    assert launch(["slurm", *base, "--nodes", "1", "--gpus-per-node", "2", "--overwrite", "--gpu-memory-gib", "0.001"]) == 2
    assert "more than --gpu-memory-gib 0.001" in _error(capsys)
    # Ray or the TrainJob models missing: the extra that brings them.
    import meshloom.cli.launch as launch_module

    monkeypatch.setattr(launch_module.importlib.util, "find_spec", lambda name: None)
    assert launch(["ray", "--config", recipe, "--nodes", "1", "--gpus-per-node", "2"]) == 2
    assert "pip install 'meshloom[ray]'" in _error(capsys)


def test_resize_rule_keeps_the_model_split_and_is_printed(tmp_path: Path, capsys) -> None:
    fixed = ParallelismConfig(dp_shard=2, tp=2, resize="dp_shard")
    assert (ParallelDims.from_config(fixed, 2).dp_shard, ParallelDims.from_config(fixed, 8).dp_shard) == (1, 4)
    replicas = ParallelismConfig(dp_shard=2, resize="dp_replicate")
    dims = ParallelDims.from_config(replicas, 6)
    assert (dims.dp_replicate, dims.dp_shard) == (3, 2)
    from meshloom.config.errors import ConfigError

    with pytest.raises(ConfigError, match="not a multiple of one replica"):
        ParallelDims.from_config(replicas, 5)
    with pytest.raises(ConfigError, match="set parallelism.dp_shard = -1"):
        ParallelDims.from_config(ParallelismConfig(dp_shard=2), 4)  # the default rule keeps the degrees as set
    from meshloom.observe.summary import startup_summary

    config = load_config(["--parallelism.resize", "dp_shard", "--parallelism.tp", "2"])
    text = startup_summary(config, tmp_path, 10, 10, dict.fromkeys(MESH_DIMS, 1), 4, "cpu", 64, 1, tmp_path, 0)
    assert "resize         dp_shard absorbs a changed world size (dp_replicate 1, tp 2, pp 1, cp 1 kept)" in text
