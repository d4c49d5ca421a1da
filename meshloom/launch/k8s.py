"""A Kubeflow Trainer v2 `TrainJob` on the `torch-distributed` runtime, checked against the trainer's own API models.

The runtime starts one pod per node with container `node` and sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
PET_MASTER_ADDR and PET_MASTER_PORT, which torchrun reads for the options the command leaves out (the rendezvous).
Volumes reach the `node` container through a runtime patch (the TrainJob API's way to add pod fields).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshloom.launch.cluster import ClusterShape
from meshloom.launch.torchrun import torchrun_args

RUNTIME = "torch-distributed"
NODE = "node"  # the runtime's replicated job and container name
DATA_MOUNT = "/data"
RUNS_MOUNT = "/runs"


@dataclass(frozen=True)
class Volumes:
    # PersistentVolumeClaim with the training data, mounted at /data (refer to it from the recipe).
    data_claim: str | None
    # PersistentVolumeClaim for run folders and checkpoints, mounted at /runs; the run's job.dump_folder goes there.
    runs_claim: str | None


def container_command(shape: ClusterShape, max_restarts: int, train: list[str]) -> list[str]:
    return ["torchrun", *torchrun_args(shape, max_restarts, [], train)]


def train_job(name: str, image: str, shape: ClusterShape, command: list[str], volumes: Volumes) -> dict[str, Any]:
    trainer: dict[str, Any] = {
        "image": image,
        "command": command,
        "numNodes": shape.nodes,
        "numProcPerNode": shape.gpus_per_node,
        "resourcesPerNode": {"limits": {"nvidia.com/gpu": str(shape.gpus_per_node)}},
    }
    spec: dict[str, Any] = {"runtimeRef": {"name": RUNTIME, "kind": "ClusterTrainingRuntime"}, "trainer": trainer}
    mounts = [(claim, path) for claim, path in ((volumes.data_claim, DATA_MOUNT), (volumes.runs_claim, RUNS_MOUNT)) if claim]
    if mounts:
        pod = {
            "volumes": [{"name": f"vol-{i}", "persistentVolumeClaim": {"claimName": claim}} for i, (claim, _) in enumerate(mounts)],
            "containers": [{"name": NODE, "volumeMounts": [{"name": f"vol-{i}", "mountPath": path} for i, (_, path) in enumerate(mounts)]}],
        }
        job = {"name": NODE, "template": {"spec": {"template": {"spec": pod}}}}
        spec["runtimePatches"] = [{"manager": "meshloom", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [job]}}}}]
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": {"name": name}, "spec": spec}


def validate(manifest: dict[str, Any]) -> Any:
    """The manifest parsed by kubeflow-trainer-api's TrainJob model (pydantic), which raises on a value of the wrong
    type or a missing required field. The models ignore unknown keys, so the parsed job must also write back the
    same manifest: a misspelt or unsupported field would be dropped and show as a difference."""
    from kubeflow_trainer_api.models.trainer_v1alpha1_train_job import TrainerV1alpha1TrainJob

    parsed = TrainerV1alpha1TrainJob.from_dict(manifest)
    if parsed is None or parsed.to_dict() != manifest:
        raise ValueError(f"the TrainJob API does not keep every field of the manifest: {parsed.to_dict() if parsed else None}")
    return parsed
