"""The chunked loss (loss.chunked; meshloom/parallel/chunked_loss.py, output_head.py) computes what whole logits
compute: the loss and every gradient within 1e-6 in fp32, on every registered family (tied embeddings and
multi-token prediction included), for chunk sizes that do and do not divide the token count (and of one token, and
of more tokens than there are); and a run's metrics (tokens seen, per-source accounting, the training and validation
losses) are those of a run with whole logits."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from meshloom.models.registry import MODEL_REGISTRY, get_model_args, get_model_spec
from meshloom.parallel.chunked_loss import IGNORE_INDEX, linear_cross_entropy_sum
from meshloom.parallel.output_head import ChunkedOutputHead, chunked_mean_loss
from meshloom.train.loss import TrainingLoss, cross_entropy_loss

EXACT = 1e-6
BATCH, SEQ = 2, 8  # 16 tokens: chunks of 5 leave a remainder of 1 (one chunk of all tokens: the next test, 37 of 37)
CHUNKS = (5,)

get_model_spec("llama3")  # registers the built-in families
FAMILIES = sorted(MODEL_REGISTRY)


def _variants() -> list[tuple[str, str, bool]]:
    """Every family, again with tied embeddings where its args can tie, and Qwen3's MoE flavour (its router and
    experts; the other MoE families are MoE in their tiny flavour already)."""
    out = []
    for family in FAMILIES:
        out.append((family, "tiny", False))
        if "tie_embeddings" in {f.name for f in dataclasses.fields(get_model_args(family, "tiny"))}:
            out.append((family, "tiny", True))
    out.append(("qwen3", "tiny_moe", False))
    return out


def _loss_and_grads(model: torch.nn.Module, loss_fn: TrainingLoss, tokens: torch.Tensor, labels: torch.Tensor):
    model.zero_grad(set_to_none=True)
    extra = {"labels": labels} if loss_fn.aux_weights else {}
    loss, parts = loss_fn(model(tokens, **extra), labels)
    loss.backward()
    return parts, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("family", "flavor", "tied"), _variants(), ids=lambda v: str(v))
def test_every_family_chunked_loss_and_gradients_equal_whole_logits(family: str, flavor: str, tied: bool) -> None:
    spec = get_model_spec(family)
    args = get_model_args(family, flavor)
    if tied:
        args = dataclasses.replace(args, tie_embeddings=True)
    torch.manual_seed(0)
    whole = spec.model_cls(args)
    whole.init_weights()
    whole.train()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=generator)
    aux = spec.aux_losses(args)
    reference_parts, reference = _loss_and_grads(whole, TrainingLoss(cross_entropy_loss, aux), tokens, labels)
    assert reference, "no gradients"
    for chunk in CHUNKS:
        chunked = copy.deepcopy(whole)
        chunked.output = ChunkedOutputHead(chunked.output, chunk)
        if tied:
            assert chunked.output.weight is chunked.tok_embeddings.weight
        head = chunked.output
        loss_fn = TrainingLoss(lambda out, lab: chunked_mean_loss(head, out, lab), aux)
        parts, grads = _loss_and_grads(chunked, loss_fn, tokens, labels)
        assert (parts - reference_parts).abs().max() <= EXACT, (chunk, parts, reference_parts)
        assert grads.keys() == reference.keys()
        for name, grad in grads.items():
            assert (grad - reference[name]).abs().max() <= EXACT, (chunk, name)
    # eval mode: the head returns the whole logits, as the Linear did (validation and generation read them)
    chunked.eval()
    whole.eval()
    with torch.no_grad():
        assert torch.equal(chunked(tokens), whole(tokens))


def test_ignored_labels_and_uneven_chunks_match_cross_entropy() -> None:
    torch.manual_seed(0)
    tokens, dim, vocab = 37, 16, 101
    hidden = (torch.randn(tokens, dim) * 0.3).requires_grad_()
    weight = (torch.randn(vocab, dim) * 0.3).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,))
    labels[[3, 10, 36]] = IGNORE_INDEX
    reference = F.cross_entropy(hidden @ weight.t(), labels, reduction="sum")
    grad_hidden, grad_weight = torch.autograd.grad(reference, (hidden, weight))
    for chunk in (1, 5, 36, 37, 64):
        loss = linear_cross_entropy_sum(hidden, weight, labels, chunk)
        ours_hidden, ours_weight = torch.autograd.grad(loss, (hidden, weight))
        assert abs(float(loss - reference)) <= EXACT * float(reference)
        assert (ours_hidden - grad_hidden).abs().max() <= EXACT
        assert (ours_weight - grad_weight).abs().max() <= EXACT
        assert ours_hidden[[3, 10, 36]].abs().max() == 0  # an ignored token gets no gradient


def test_chunk_tokens_must_be_positive() -> None:
    from meshloom.config.errors import ConfigError
    from meshloom.config.loader import load_config
    from meshloom.planning.run_plan import RunPlan

    with pytest.raises(ConfigError, match=r"^loss.chunk_tokens must be positive, got 0$"):
        RunPlan.build(load_config(["--loss.chunked", "true", "--loss.chunk_tokens", "0"]), 1)


def test_float8_leaves_the_chunked_head_out_and_training_builds_it() -> None:
    """The driver swaps the output Linear for the chunked head before Float8, which converts the blocks' linears and
    still not the output projection; the head keeps the Linear's parameter name."""
    from torchao.float8.float8_linear import Float8Linear

    from meshloom.config.loader import load_config
    from meshloom.planning.run_plan import RunPlan
    from meshloom.train.model_setup import build_model

    argv = ["--model.flavor", "tiny", "--float8.enable", "true", "--training.mixed_precision", "bf16", "--loss.chunked", "true"]
    model = build_model(RunPlan.build(load_config(argv), 1), torch.device("cpu"))
    assert isinstance(model.output, ChunkedOutputHead) and type(model.output.weight) is torch.nn.Parameter
    assert any(isinstance(m, Float8Linear) for m in model.modules())
    assert "output.weight" in model.state_dict()


def test_a_run_logs_the_same_loss_and_validation_loss_with_the_chunked_loss(tmp_path) -> None:
    """The Trainer's path: training losses (chunked head in training mode) and the held-out loss (eval mode: logits)
    equal a run with whole logits; DeepSeek-V3's prediction-module loss too."""
    from meshloom.testing.layout_parity import run_args, run_steps

    common = ["--model.name", "deepseek_v3", "--validation.enable", "true", "--validation.steps", "1", "--data.validation_fraction", "0.2"]
    whole = run_steps(run_args(3, tmp_path, [*common, "--job.dump_folder", str(tmp_path / "whole")]))
    chunked = run_steps(
        run_args(3, tmp_path, [*common, "--loss.chunked", "true", "--loss.chunk_tokens", "100", "--job.dump_folder", str(tmp_path / "chunked")])
    )
    assert whole.validation is not None and abs(whole.validation - chunked.validation) <= EXACT
    assert max(abs(a - b) for a, b in zip(whole.losses, chunked.losses, strict=True)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(whole.aux["mtp_loss"], chunked.aux["mtp_loss"], strict=True)) <= 1e-5


def test_validation_takes_the_held_out_loss_in_chunks_and_leaves_logits_to_evaluation(tmp_path, monkeypatch) -> None:
    """Validation (eval mode) runs the chunked loss as training does: the head hands the loss hidden states, never
    logits over all tokens; outside validation the eval-mode head still returns logits (for evaluation and generation)."""
    from meshloom.config.loader import load_config
    from meshloom.testing.layout_parity import run_args
    from meshloom.train.trainer import Trainer

    argv = run_args(1, tmp_path, [
        "--validation.enable", "true", "--validation.steps", "2", "--data.validation_fraction", "0.2",
        "--loss.chunked", "true", "--loss.chunk_tokens", "100", "--job.dump_folder", str(tmp_path / "run"),
    ])  # fmt: skip
    trainer = Trainer(load_config(argv))
    head = trainer.model.output
    widths = []
    forward = ChunkedOutputHead.forward
    monkeypatch.setattr(ChunkedOutputHead, "forward", lambda self, hidden: widths.append((out := forward(self, hidden)).shape[-1]) or out)
    assert trainer.validate() > 0
    assert widths == [trainer.plan.model_args.dim] * 2 and not head.held_out
    head.eval()
    with torch.no_grad():
        logits = trainer.model(torch.zeros(1, 4, dtype=torch.long))
    assert logits.shape[-1] == trainer.plan.model_args.vocab_size


def test_the_metrics_of_a_mixed_run_are_the_same_with_the_chunked_loss(tmp_path) -> None:
    """A run over a two-source mixture, with and without the chunked loss: the same tokens seen, and in
    metrics.jsonl the same rows and keys, the same per-source accounting (tokens, documents, epochs, shares) to the
    token, and losses within 1e-5."""
    import json

    from meshloom.config.loader import load_config
    from meshloom.train.trainer import Trainer
    from shard_fixtures import document, load_tokenizer, prepared, tokenizer_json

    tok_path = tokenizer_json(tmp_path)
    tokenizer = load_tokenizer(tok_path)
    web = prepared(tmp_path / "web", tokenizer, [document(i) for i in range(40)])
    code = prepared(tmp_path / "code", tokenizer, [document(i, words=30) for i in range(100, 130)])
    common = [
        "--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "4", "--training.steps", "3",
        "--metrics.progress_bar", "false", "--metrics.peak_tflops", "1", "--metrics.log_freq", "1",
        "--data.dataset", "shards", "--data.shards", f"{web}:3,{code}:1", "--data.tokenizer", str(tok_path),
        "--data.validation_fraction", "0.0", "--validation.enable", "false",
    ]  # fmt: skip
    rows = {}
    for path, extra in (("whole", []), ("chunked", ["--loss.chunked", "true", "--loss.chunk_tokens", "50"])):
        trainer = Trainer(load_config([*common, *extra, "--job.dump_folder", str(tmp_path / path)]))
        trainer.train()
        assert trainer.progress.tokens_seen == 3 * 4 * 32
        logged = [json.loads(line) for line in (tmp_path / path / "metrics.jsonl").read_text().splitlines()]
        rows[path] = [row for row in logged if "loss" in row]
    assert [r["step"] for r in rows["whole"]] == [r["step"] for r in rows["chunked"]] == [1, 2, 3]
    for whole, chunked in zip(rows["whole"], rows["chunked"], strict=True):
        assert whole.keys() == chunked.keys()
        counted = {k for k in whole if k.startswith("data/")}
        assert {"data/web/tokens", "data/code/tokens", "data/web/share"} <= counted, sorted(whole)
        assert {k: whole[k] for k in counted} == {k: chunked[k] for k in counted}
        assert abs(whole["loss"] - chunked["loss"]) <= 1e-5
