"""The chunked loss computes what whole logits compute under tensor parallel with loss parallel (the
vocabulary-sharded log-sum-exp) and under pipeline parallel (the last stage, and the V schedule's rank 0 that holds
it): the loss and every parameter's gradient within 1e-6 in fp32, on every registered family, tied embeddings and
DeepSeek-V3's prediction modules included.

Each case is one Trainer step on 2 gloo ranks, run twice with the same data and weights: with whole logits, and with
`loss.chunked` in chunks of 100 tokens (no microbatch here is a multiple of 100). The gradients are read when the
optimizer is about to step (clipping off), gathered to whole tensors (DTensor.full_tensor) and merged over the
ranks by parameter name; together they must name every parameter of the one-process model. Qwen3's MoE flavour
(`qwen3_moe/...`, tiny_moe) joins the families, whose other MoE members are MoE in their tiny flavour already."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from meshloom.models.registry import MODEL_REGISTRY, get_model_args, get_model_spec
from meshloom.testing.layout_parity import run_args
from meshloom.testing.ranks import run_ranks

EXACT = 1e-6
CHUNKED = ["--loss.chunked", "true", "--loss.chunk_tokens", "100"]
COMMON = ["--training.seq_len", "32", "--training.max_norm", "0"]
TP = ["--parallelism.tp", "2", "--parallelism.dp_shard", "1", "--training.local_batch_size", "8"]
PP = ["--parallelism.pp", "2", "--parallelism.dp_shard", "1", "--pipeline.microbatches", "2", "--training.local_batch_size", "8"]
ZBV = [*PP, "--pipeline.schedule", "ZBVZeroBubble", "--model.n_layers", "4"]

get_model_spec("llama3")  # registers the built-in families
FAMILIES = sorted(MODEL_REGISTRY)
# Families whose args can tie the output projection to the embedding; tests/tied_flavors registers each tiny flavour
# tied, as `<family>_tied`, in the ranks only (so the registry of this process, which other tests walk, is unchanged).
TIEABLE = [f for f in FAMILIES if "tie_embeddings" in {field.name for field in dataclasses.fields(get_model_args(f, "tiny"))}]


class Case(NamedTuple):
    family: str
    flavor: str
    tied: bool
    layout: list[str]


def _cases() -> dict[str, Case]:
    """case id -> Case. Tied models are not cut into stages (the declaration refuses it)."""
    cases = {}
    for family in FAMILIES:
        cases[f"{family}/tp2"] = Case(family, "tiny", False, TP)
        cases[f"{family}/pp2"] = Case(family, "tiny", False, PP)
    for family in TIEABLE:
        cases[f"{family}_tied/tp2"] = Case(family, "tiny", True, TP)
    cases["deepseek_v3/pp2-zbv"] = Case("deepseek_v3", "tiny", False, ZBV)
    cases["qwen3_moe/tp2"] = Case("qwen3", "tiny_moe", False, TP)
    cases["qwen3_moe/pp2"] = Case("qwen3", "tiny_moe", False, PP)
    return cases


CASES = _cases()


def _model_args(case: Case) -> list[str]:
    plugin = ["--model.plugin", "tests.tied_flavors"] if case.tied else []
    return [*plugin, "--model.name", f"{case.family}_tied" if case.tied else case.family, "--model.flavor", case.flavor]


def _worker(cases_file: Path, out_dir: Path) -> None:
    """One rank: each run of each case trains one step; the gradients at the optimizer's step are saved per rank."""
    from torch.distributed.tensor import DTensor

    from meshloom.config.loader import load_config
    from meshloom.parallel.distributed import rank, shutdown_and_exit
    from meshloom.train.trainer import Trainer

    for key, argv in json.loads(cases_file.read_text()).items():
        trainer = Trainer(load_config(argv))
        grads: dict[str, torch.Tensor] = {}

        def capture(step=trainer.optimizer.step, trainer=trainer, grads=grads):
            for part in trainer.model_parts:
                for name, param in part.named_parameters():
                    if param.grad is not None:
                        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
                        grads[name] = grad.detach().clone()
            return step()

        trainer.optimizer.step = capture
        result = trainer.train_step()
        assert grads, f"{key}: the optimizer did not step"
        torch.save({"loss": result.loss, "aux": result.aux, "grads": grads}, out_dir / f"{key.replace('/', '+')}.rank{rank()}.pt")
    shutdown_and_exit(0)


@pytest.fixture(scope="module")
def gradients(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """case id + "/whole" or "/chunked" -> {"loss", "aux", "grads"} merged over the 2 ranks; one launch for all."""
    os.environ.pop("WORLD_SIZE", None)
    workdir = tmp_path_factory.mktemp("chunked_gradients")
    runs = {}
    for case_id, case in CASES.items():
        for path, extra in (("whole", []), ("chunked", CHUNKED)):
            key = f"{case_id}/{path}"
            folder = workdir / key.replace("/", "+")
            runs[key] = run_args(1, workdir, [*_model_args(case), *COMMON, *case.layout, *extra, "--job.dump_folder", str(folder)])
    (workdir / "cases.json").write_text(json.dumps(runs))
    out = workdir / "grads"
    out.mkdir()
    run_ranks(_worker, 2, workdir / "cases.json", out)
    merged = {}
    for key in runs:
        per_rank = [torch.load(out / f"{key.replace('/', '+')}.rank{r}.pt") for r in range(2)]
        grads: dict[str, torch.Tensor] = {}
        for saved in per_rank:
            grads.update(saved["grads"])
        merged[key] = {"loss": per_rank[0]["loss"], "aux": per_rank[0]["aux"], "grads": grads}
    return merged


def _parameter_names(case: Case) -> set[str]:
    args = get_model_args(case.family, case.flavor)
    if case.tied:
        args = dataclasses.replace(args, tie_embeddings=True)
    if "--model.n_layers" in case.layout:
        args = dataclasses.replace(args, n_layers=int(case.layout[case.layout.index("--model.n_layers") + 1]))
    with torch.device("meta"):
        model = get_model_spec(case.family).model_cls(args)
    return {name for name, _ in model.named_parameters()}


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_loss_gradients_equal_whole_logits_under_tp_and_pp(gradients, case: str) -> None:
    whole, chunked = gradients[f"{case}/whole"], gradients[f"{case}/chunked"]
    assert abs(whole["loss"] - chunked["loss"]) <= EXACT, (whole["loss"], chunked["loss"])
    assert whole["aux"].keys() == chunked["aux"].keys()
    for name, value in whole["aux"].items():
        assert abs(value - chunked["aux"][name]) <= EXACT, (name, value, chunked["aux"][name])
    assert whole["grads"].keys() == chunked["grads"].keys() == _parameter_names(CASES[case])
    worst = max(((chunked["grads"][n] - g).abs().max().item(), n) for n, g in whole["grads"].items())
    assert worst[0] <= EXACT, worst
    # The output projection's gradient (the embedding's, when tied) is not zero: not a comparison of two empty heads.
    assert whole["grads"]["tok_embeddings.weight" if CASES[case].tied else "output.weight"].abs().max() > 0
