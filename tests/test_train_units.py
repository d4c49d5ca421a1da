import math

import pytest
import torch
from torch import nn

from meshloom.config import LRSchedulerConfig, OptimizerConfig
from meshloom.train.lr import lr_factor
from meshloom.train.optim import build_optimizer


def test_warmup_then_cosine_reaches_floor():
    cfg = LRSchedulerConfig(warmup_steps=4, decay_type="cosine", min_lr_ratio=0.1)
    factors = [lr_factor(s, 20, cfg) for s in range(20)]
    assert factors[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert factors[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))
    assert lr_factor(20, 20, cfg) == pytest.approx(0.1)
    # halfway through the decay the cosine is at the midpoint between peak and floor
    assert lr_factor(12, 20, cfg) == pytest.approx(0.55)


def test_linear_and_wsd_shapes():
    linear = LRSchedulerConfig(warmup_steps=0, decay_type="linear", min_lr_ratio=0.0)
    assert [lr_factor(s, 4, linear) for s in range(5)] == pytest.approx([1, 0.75, 0.5, 0.25, 0])
    wsd = LRSchedulerConfig(warmup_steps=2, decay_type="wsd", decay_ratio=0.2, min_lr_ratio=0.0)
    values = [lr_factor(s, 20, wsd) for s in range(21)]
    assert values[2:16] == [1.0] * 14  # stable phase
    assert values[16:] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


def test_weight_decay_skips_norms_and_biases():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = build_optimizer(model, OptimizerConfig(weight_decay=0.1), torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
    assert math.isclose(opt.defaults["betas"][1], 0.95)
