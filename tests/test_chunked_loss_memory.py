"""The chunked loss's memory, measured with torch's memory tracker on CPU in fp32: at Llama 3's and gpt-oss's real
vocabularies (128,256 and 201,088 entries) on a tiny model's output head (dim 64) over 512 tokens in chunks of 64,
the loss's peak is at most 1/8 of the whole logits' and the planner's term for it (planning/loss_memory.py) is
within 10% of the measurement; the dry run reports the saving."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshloom.models.registry import get_model_args, get_model_spec
from meshloom.parallel.output_head import ChunkedOutputHead, chunked_mean_loss
from meshloom.planning.layout import Layout
from meshloom.planning.loss_memory import chunked_loss_bytes
from meshloom.train.loss import cross_entropy_loss

BATCH, SEQ, CHUNK = 4, 128, 64
VOCABS = {"llama3": 128_256, "gpt_oss": 201_088}


def _loss_peak(head: torch.nn.Module, loss_fn, hidden: torch.Tensor, labels: torch.Tensor) -> int:
    """Peak bytes the loss's forward and backward add to what exists before it (weights, hidden states)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(head, hidden)
    with tracker:
        before = tracker.get_tracker_snapshot("current")[hidden.device]["Total"]
        loss_fn(head(hidden), labels).backward()
    return tracker.get_tracker_snapshot("peak")[hidden.device]["Total"] - before


@pytest.mark.parametrize("family", sorted(VOCABS))
def test_chunked_loss_peak_is_an_eighth_of_whole_logits_and_the_planner_counts_it(family: str) -> None:
    args = dataclasses.replace(get_model_args(family, "tiny"), vocab_size=VOCABS[family])
    torch.manual_seed(0)
    output = torch.nn.Linear(args.dim, args.vocab_size, bias=False)
    torch.nn.init.normal_(output.weight, std=0.02)
    labels = torch.randint(0, args.vocab_size, (BATCH, SEQ))
    peaks = {}
    for case in ("whole", "chunked"):
        hidden = torch.randn(BATCH, SEQ, args.dim, requires_grad=True)
        output.weight.grad = None
        if case == "whole":
            peaks[case] = _loss_peak(output, lambda out, lab: cross_entropy_loss(out.float(), lab), hidden, labels)
        else:
            head = ChunkedOutputHead(output, CHUNK)
            peaks[case] = _loss_peak(head, lambda out, lab: chunked_mean_loss(head, out, lab), hidden, labels)
    assert peaks["chunked"] * 8 <= peaks["whole"], peaks
    shape = get_model_spec(family).shape_model(args)
    estimate = chunked_loss_bytes(shape, Layout(loss_chunk_tokens=CHUNK), True, BATCH * SEQ, 4)
    assert abs(estimate / peaks["chunked"] - 1) <= 0.10, (estimate, peaks)


def test_dry_run_reports_what_the_chunked_loss_saves() -> None:
    from meshloom.config.loader import load_config
    from meshloom.planning.dry_run import dry_run

    argv = ["--model.name", "llama3", "--model.flavor", "3B", "--training.seq_len", "4096", "--training.local_batch_size", "2"]
    whole = dry_run(load_config(argv), 8)
    chunked = dry_run(load_config([*argv, "--loss.chunked", "true"]), 8)
    saving = whole.memory.peak - chunked.memory.peak
    assert saving > 0
    lines = [line for line in chunked.format().splitlines() if "chunked loss" in line]
    assert len(lines) == 1 and f"{saving / 2**30:.2f} GiB" in lines[0], chunked.format()
    assert not [line for line in whole.format().splitlines() if "chunked loss" in line]
