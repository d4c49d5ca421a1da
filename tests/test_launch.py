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


def test_every_name_is_checked_as_its_scheduler_does_before_anything_is_written(tmp_path: Path, capsys) -> None:
    recipe = str(_recipe(tmp_path))
    out = tmp_path / "job.out"
    shape = ["--config", recipe, "--nodes", "1", "--gpus-per-node", "2", "--output", str(out)]
    k8s = ["k8s", *shape, "--image", "registry.example:5000/team/meshloom:1.0"]
    cases = [
        (["slurm", *shape, "--name", "my job; rm -rf ~"], "--name 'my job; rm -rf ~' is not a valid slurm job name"),
        (["slurm", *shape, "--name", "a/b"], "--name 'a/b' is not a valid slurm job name"),
        (["slurm", *shape, "--name", "x" * 129], "is not a valid slurm job name"),
        (["ray", "--config", recipe, "--nodes", "1", "--gpus-per-node", "2", "--name", "run\nnext"], "is not a valid ray job name"),
        ([*k8s, "--name", "Train"], "--name 'Train' is not a valid TrainJob name (Kubernetes: an RFC 1035 label)"),
        ([*k8s, "--name", "1job"], "is not a valid TrainJob name"),
        ([*k8s, "--name", "a" * 64], "is not a valid TrainJob name"),
        ([*k8s, "--data-volume", "Bad Claim"], "--data-volume 'Bad Claim' is not a valid PersistentVolumeClaim name (Kubernetes: a DNS-1123 subdomain)"),
        ([*k8s, "--runs-volume", "runs-"], "--runs-volume 'runs-' is not a valid PersistentVolumeClaim name"),
        ([*k8s, "--runs-volume", "a..b"], "is not a valid PersistentVolumeClaim name"),
        (["k8s", *shape, "--image", "Registry/Meshloom:1"], "--image 'Registry/Meshloom:1' is not a container image reference"),
        (["k8s", *shape, "--image", "meshloom:1; rm -rf ~"], "is not a container image reference"),
    ]  # fmt: skip
    for argv, fragment in cases:
        assert launch(argv) == 2, argv
        one_line_error(2, capsys.readouterr().err, fragment)
        assert not out.exists()
    # What those systems accept passes: a subdomain claim with dots, an image with a registry port and a digest.
    assert launch([*k8s, "--name", "llama-8b-run2", "--data-volume", "corpus.v2", "--runs-volume", "runs-1"]) == 0
    assert launch(["k8s", *shape, "--overwrite", "--image", f"reg.example/a/b@sha256:{'0' * 64}"]) == 0
    assert launch(["slurm", *shape, "--overwrite", "--name", "Llama_8B.run-2"]) == 0


def test_the_sbatch_script_passes_every_argument_as_typed(tmp_path: Path, capsys) -> None:
    """The script is run by bash with a stand-in srun that records its arguments: each argument arrives exactly as
    typed (spaces, quotes, $(...), backticks, a line break), nothing in them is run, and only the rendezvous
    variables are expanded."""
    recipe = tmp_path / "my recipe's.toml"
    recipe.write_text('[model]\nname = "llama3"\n')
    script, pwned = tmp_path / "job.sbatch", tmp_path / "pwned"
    hostile = [
        "--job.description", f"a $(touch {pwned}) `touch {pwned}` b\nx; touch {pwned}",
        "--job.dump_folder", f"runs/$HOME/ it's \"quoted\" ;touch {pwned}",
    ]  # fmt: skip
    argv = ["slurm", "--config", str(recipe), "--nodes", "1", "--gpus-per-node", "2", "--output", str(script), *hostile]
    assert launch(argv) == 0
    capsys.readouterr()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node-a\n")
    (bin_dir / "srun").write_text(f"#!/bin/bash\nprintf '%s\\0' \"$@\" > {shlex.quote(str(tmp_path / 'argv'))}\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "node-a", "SLURM_JOB_ID": "42", "SLURM_SUBMIT_DIR": str(tmp_path),
           "HOME": str(tmp_path)}  # fmt: skip
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    words = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert not pwned.exists()
    assert words[0] == "--kill-on-bad-exit=1" and words[1] == ".venv/bin/torchrun"
    expected_rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "node-a:29500", "--rdzv-id", "42"]
    assert words[words.index("--rdzv-backend") : words.index("--rdzv-backend") + 6] == expected_rdzv
    assert words[words.index("-m") :] == ["-m", "meshloom.train", "--config", str(recipe), *hostile]
    # The note that names the command stays a comment, whatever line breaks its arguments hold.
    header = script.read_text().split("#SBATCH")[0].splitlines()
    assert header[0] == "#!/bin/bash" and all(line.startswith("# ") for line in header[1:])


def test_runs_volume_holds_the_run_folder_and_an_empty_recipe_is_refused(tmp_path: Path, capsys) -> None:
    recipe = str(_recipe(tmp_path))
    out = tmp_path / "job.yaml"
    k8s = ["k8s", "--config", recipe, "--nodes", "1", "--gpus-per-node", "2", "--image", "reg/meshloom:1", "--output", str(out),
           "--runs-volume", "runs"]  # fmt: skip
    outside = tmp_path / "outside.toml"
    outside.write_text('[job]\ndump_folder = "runs/llama"\n')
    cases = [
        ([*k8s, "--job.dump_folder", "/data/run"], "job.dump_folder /data/run is outside /runs, where --runs-volume is mounted"),
        ([*k8s, "--job.dump_folder", "/runs/../tmp/run"], "job.dump_folder /runs/../tmp/run is outside /runs"),
        ([*k8s, "--job.dump_folder", "/runs"], "job.dump_folder /runs is outside /runs"),
        ([*k8s, "--config", str(outside)], "job.dump_folder runs/llama is outside /runs"),  # the recipe's own, relative
        ([*k8s, "--job.dump_folder", "/runs/a", "--checkpoint.enable", "true", "--checkpoint.folder", "/scratch/ckpt"], "checkpoint.folder /scratch/ckpt is outside /runs"),
    ]  # fmt: skip
    for argv, fragment in cases:
        assert launch(argv) == 2, argv
        one_line_error(2, capsys.readouterr().err, fragment)
        assert not out.exists()
    assert launch([*k8s, "--job.dump_folder", "/runs/a", "--checkpoint.enable", "true", "--checkpoint.folder", "ckpt"]) == 0
    assert "--job.dump_folder /runs/a" in shlex.join(yaml.safe_load(out.read_text())["spec"]["trainer"]["command"])
    assert launch([*k8s, "--overwrite", "--name", "llama"]) == 0
    assert shlex.join(yaml.safe_load(out.read_text())["spec"]["trainer"]["command"]).endswith("--job.dump_folder /runs/llama")
    capsys.readouterr()
    out.unlink()
    for empty in ("", "# nothing yet\n", "[training]\n[model]\n"):
        for suffix in (".toml", ".yaml"):
            path = tmp_path / f"empty{suffix}"
            path.write_text(empty if suffix == ".toml" or "[" not in empty else "training: {}\n")
            for scheduler in (["slurm"], ["k8s", "--image", "reg/meshloom:1"], ["ray"]):
                code = launch([scheduler[0], "--config", str(path), "--nodes", "1", "--gpus-per-node", "2", *scheduler[1:]])
                one_line_error(code, capsys.readouterr().err, f"--config {path} sets nothing, so the job would train meshloom's defaults")
    assert not list(tmp_path.glob("meshloom.*"))
