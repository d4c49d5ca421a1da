"""The loss's backward as the memory estimate counts it, against tracked tensors on 2 gloo ranks: the fused
single-device cross-entropy keeps two vocabulary-wide temporaries next to its saved log-probabilities, loss parallel's
(torch's `_nll_loss_and_log_softmax_backward`) three."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshloom.models.registry import get_model_args, get_model_spec
from meshloom.planning.layout import FP32, Layout, Precision
from meshloom.planning.memory_estimate import estimate_memory
from meshloom.testing.ranks import run_ranks

ROWS, VOCAB = 256, 2048


def _temporaries(out_file: Path) -> None:
    """Rank 0 writes the temporaries at the backward's peak, in vocabulary-wide fp32 tensors of its shard, for the
    plain loss on a local tensor and for loss parallel on the same logits sharded over the vocabulary."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    logits, target = torch.randn(ROWS, VOCAB), torch.randint(VOCAB, (ROWS,))
    counts = {}
    for case in ("plain", "loss_parallel"):
        sharded = case == "loss_parallel"
        source = distribute_tensor(logits, mesh, [Shard(1)]) if sharded else logits
        tensor_bytes = ROWS * (VOCAB // 2 if sharded else VOCAB) * FP32
        tracker = MemTracker()
        with tracker, (loss_parallel() if sharded else torch.enable_grad()):
            leaf = source.clone().requires_grad_()
            (grad,) = torch.autograd.grad(F.cross_entropy(leaf, target), leaf)
            del grad
        temporaries = sum(device[_MemRefType.TEMP] for device in tracker.get_tracker_snapshot("peak").values())
        counts[case] = temporaries / tensor_bytes
    if dist.get_rank() == 0:
        out_file.write_text(json.dumps(counts))
    dist.destroy_process_group()


def test_loss_parallel_backward_keeps_three_vocabulary_wide_temporaries(tmp_path):
    out = tmp_path / "temporaries.json"
    run_ranks(_temporaries, 2, out)
    # Whole tensors; the rest is the targets' index tensors (under 1% of one).
    measured = {case: round(count) for case, count in json.loads(out.read_text()).items()}
    assert measured == pytest.approx(json.loads(out.read_text()), abs=0.01)
    assert measured == {"plain": 2, "loss_parallel": 3}
    shape = get_model_spec("llama3").shape_model(get_model_args("llama3", "debug"))
    for case, layout in (("plain", Layout()), ("loss_parallel", Layout(tp=2))):
        estimate = estimate_memory(shape, layout, 128, Precision("bf16", device="cpu"))
        vocab_tensor = 128 * FP32 * shape.vocab_size / layout.tp
        assert estimate.transient / vocab_tensor == measured[case], case
