"""The shared mixture-of-experts layer: grouped matmul vs loop, routing against hand-written references, the
balancing bias (selection only; its update from the step's summed counts), the balance losses' gradients and
the statistics under activation checkpointing."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from meshloom.config.errors import ConfigError
from meshloom.config.loader import load_config
from meshloom.models.common.moe import MoE, MoEArgs
from meshloom.models.registry import get_model_args
from meshloom.models.common.router import (
    TokenChoiceRouter,
    router_z_loss,
    select_experts,
    sequence_balance_loss,
)
from meshloom.planning.run_plan import RunPlan
from meshloom.train.moe_balance import MoEBalancer


def make_moe(seed: int = 0, dim: int = 16, **overrides) -> MoE:
    values = {"n_experts": 8, "top_k": 2, "hidden_dim": 12} | overrides
    torch.manual_seed(seed)
    layer = MoE(dim, MoEArgs(**values))
    layer.init_weights(std=0.3, out_std=0.2)
    return layer.train()


def test_grouped_mm_and_loop_agree_in_outputs_and_gradients():
    layer = make_moe(shared_hidden_dim=8)
    layer.expert_bias[3] = -100.0  # expert 3 gets no token: an empty group in both paths
    x = torch.randn(2, 24, 16, generator=torch.Generator().manual_seed(1))
    results = {}
    for mode in ("on", "off"):
        model = copy.deepcopy(layer)
        model.experts.grouped_mm = mode == "on"
        inp = x.clone().requires_grad_()
        out = model(inp)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        results[mode] = (out.detach(), inp.grad, grads)
    assert int(make_moe().tokens_per_expert.sum()) == 0
    (out_g, dx_g, grads_g), (out_l, dx_l, grads_l) = results["on"], results["off"]
    assert (out_g - out_l).abs().max() < 1e-6
    assert (dx_g - dx_l).abs().max() < 1e-6
    assert grads_g["experts.w1"][3].abs().max() == 0  # the unused expert really got nothing
    for name in grads_g:
        assert (grads_g[name] - grads_l[name]).abs().max() < 1e-6, name


def _reference_routing(x, weight, top_k, score_func, renormalize, route_scale):
    logits = x.double() @ weight.double().T
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    experts, weights = [], []
    for row in scores:
        chosen = sorted(range(len(row)), key=lambda e: -row[e].item())[:top_k]
        w = torch.stack([row[e] for e in chosen])
        if renormalize:
            w = w / w.sum()
        experts.append(chosen)
        weights.append(w * route_scale)
    return torch.tensor(experts), torch.stack(weights)


@pytest.mark.parametrize(
    ("score_func", "renormalize", "route_scale"),
    [("softmax", False, 1.0), ("softmax", True, 1.0), ("sigmoid", True, 2.5), ("sigmoid", False, 1.0)],
)
def test_router_matches_reference(score_func, renormalize, route_scale):
    torch.manual_seed(0)
    router = TokenChoiceRouter(16, 8, 3, score_func, renormalize, route_scale)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(40, 16)
    routing = router(x)
    experts, weights = _reference_routing(x, router.weight.detach(), 3, score_func, renormalize, route_scale)
    assert torch.equal(routing.experts, experts)
    assert (routing.weights.double() - weights).abs().max() < 1e-6
    assert routing.logits.dtype == routing.weights.dtype == torch.float32


def _reference_group_limited(scores, bias, top_k, n_groups, n_limited):
    """Per token: rank groups by the sum of their two best biased scores, keep the best n_limited groups, then the
    top_k biased scores among their experts."""
    chosen = []
    size = scores.shape[1] // n_groups
    for row in scores + bias:
        values = row.tolist()
        group_scores = [sum(sorted(values[g * size : (g + 1) * size], reverse=True)[:2]) for g in range(n_groups)]
        groups = sorted(range(n_groups), key=lambda g: -group_scores[g])[:n_limited]
        allowed = [e for g in groups for e in range(g * size, (g + 1) * size)]
        chosen.append(sorted(allowed, key=lambda e: -values[e])[:top_k])
    return torch.tensor(chosen)


def test_group_limited_routing_matches_reference():
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(64, 16, generator=gen)
    bias = torch.randn(16, generator=gen) * 0.1
    experts = select_experts(scores, bias, top_k=4, n_groups=4, n_limited_groups=2)
    reference = _reference_group_limited(scores, bias, 4, 4, 2)
    assert torch.equal(experts, reference)
    # The limit really binds: plain top-4 picks experts from more than 2 groups for some tokens.
    unlimited = select_experts(scores, bias, top_k=4)
    assert any(len({int(e) // 4 for e in row}) > 2 for row in unlimited)
    assert all(len({int(e) // 4 for e in row}) <= 2 for row in experts)


def test_bias_changes_the_choice_but_not_the_gate_weights():
    layer = make_moe()
    x = torch.randn(30, 16)
    plain = layer.router(x, layer.expert_bias)
    bias = torch.zeros(8)
    bias[5] = 10.0  # every token now picks expert 5
    biased = layer.router(x, bias)
    assert (biased.experts == 5).any(dim=1).all() and not (plain.experts == 5).any(dim=1).all()
    assert torch.equal(biased.scores, plain.scores)
    expected = biased.scores.gather(1, biased.experts)
    assert torch.allclose(biased.weights, expected / expected.sum(-1, keepdim=True))


def test_invalid_moe_args_are_clear_errors():
    with pytest.raises(ValueError, match=r"top_k=9 exceeds n_experts=8"):
        MoEArgs(n_experts=8, top_k=9, hidden_dim=4)
    with pytest.raises(ValueError, match=r"n_expert_groups=3 must divide n_experts=8"):
        MoEArgs(n_experts=8, top_k=2, hidden_dim=4, n_expert_groups=3)


def _plan(tmp_path, *extra: str) -> RunPlan:
    return RunPlan.build(
        load_config(["--model.name", "qwen3", "--model.flavor", "tiny_moe", "--job.dump_folder", str(tmp_path), *extra]), 1
    )


def test_bias_update_uses_the_counts_of_every_microbatch(tmp_path):
    layer = make_moe()
    plan = _plan(tmp_path, "--moe.bias_update_rate", "0.01", "--training.global_batch_size", "16", "--training.local_batch_size", "8")
    part = torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({"0": torch.nn.ModuleDict({"moe": layer})})})
    balancer = MoEBalancer([part], plan)
    assert layer.loss_scale == 0.5  # two accumulation steps
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randn(2, 16, 16, generator=gen) for _ in range(2)]
    counts = []
    for batch in batches:
        with torch.no_grad():
            experts = layer.router(batch.view(-1, 16), layer.expert_bias).experts
        counts.append(torch.bincount(experts.view(-1), minlength=8).double())
        layer(batch).sum().backward()
    total = counts[0] + counts[1]
    assert torch.equal(layer.tokens_per_expert, total)
    expected = 0.01 * torch.sign(total.mean() - total)
    assert not torch.equal(expected, 0.01 * torch.sign(counts[1].mean() - counts[1]))  # the sum matters here
    balancer.after_step(updated=True)
    assert torch.equal(layer.expert_bias, expected.float())
    # Direction: experts above the mean load lose bias, those below gain.
    assert (layer.expert_bias[total > total.mean()] < 0).all() and (layer.expert_bias[total < total.mean()] > 0).all()
    assert layer.first_stats.sum() == 0 and layer.later_stats.sum() == 0
    metrics = balancer.metrics()
    assert metrics["moe_load_max"] == pytest.approx(float(total.max() / total.mean()))
    assert metrics["moe/layers.0/load_max_mean"] == metrics["moe_load_max"]
    assert metrics["moe/layers.0/bias_spread"] == pytest.approx(0.02)
    # A dropped step discards its counts and keeps the bias.
    layer(batches[0]).sum().backward()
    balancer.after_step(updated=False)
    assert torch.equal(layer.expert_bias, expected.float()) and layer.tokens_per_expert.sum() == 0


def test_eval_and_no_grad_forwards_count_nothing():
    layer = make_moe().eval()
    layer(torch.randn(2, 8, 16))
    with torch.no_grad():
        layer.train()(torch.randn(2, 8, 16))
    assert layer.tokens_per_expert.sum() == 0


def test_activation_checkpointing_does_not_count_twice():
    layer = make_moe()
    x = torch.randn(2, 10, 16, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).pow(2).sum().backward()
    assert layer.tokens_per_expert.sum() == 2 * 10 * 2
    assert layer.step_stats(1)[-1] == 1  # one forward recorded


def test_balance_losses_reach_the_router_as_if_added_to_the_loss():
    aux_coef, z_coef, scale = 0.3, 0.05, 0.25
    layer = make_moe(seed=5)
    layer.aux_loss_coef, layer.z_loss_coef, layer.loss_scale = aux_coef, z_coef, scale
    reference = copy.deepcopy(layer)
    reference.aux_loss_coef = reference.z_loss_coef = 0.0
    x = torch.randn(3, 10, 16, generator=torch.Generator().manual_seed(6))
    g = torch.randn(3, 10, 16, generator=torch.Generator().manual_seed(7))

    (layer(x) * g).sum().mul(scale).backward()

    out = reference(x)
    routing = reference.router(x.view(-1, 16), reference.expert_bias)
    aux = sequence_balance_loss(routing.scores.view(3, 10, -1), routing.experts.view(3, 10, -1), 8)
    explicit = (out * g).sum() + aux_coef * aux + z_coef * router_z_loss(routing.logits)
    explicit.mul(scale).backward()

    grad, expected = layer.router.weight.grad, reference.router.weight.grad
    assert (grad - expected).abs().max() < 1e-6
    without = copy.deepcopy(reference)
    without.zero_grad()
    (without(x) * g).sum().mul(scale).backward()
    assert (without.router.weight.grad - expected).abs().max() > 1e-4  # the losses do change the gradient
    # Logged values: the unweighted losses of the forward.
    assert layer.step_stats(1)[8 + 2].item() == pytest.approx(aux.item(), rel=1e-6)


def test_sequence_balance_loss_is_one_when_balanced():
    scores = torch.full((2, 8, 4), 0.25)
    experts = torch.tensor([[0, 1], [2, 3]] * 8).view(2, 8, 2)
    assert sequence_balance_loss(scores, experts, 4).item() == pytest.approx(1.0)


def test_grouped_mm_on_where_unsupported_is_a_config_error(tmp_path):
    """Decided from the shapes and the device before anything is built: bf16 rows of 12 experts' hidden units are 24
    bytes, not a multiple of 16."""
    config = load_config(["--model.name", "qwen3", "--model.flavor", "tiny_moe", "--job.dump_folder", str(tmp_path),
                          "--moe.grouped_mm", "on", "--training.mixed_precision", "bf16"])  # fmt: skip
    args = get_model_args("qwen3", "tiny_moe")
    odd = dataclasses.replace(args, moe=dataclasses.replace(args.moe, hidden_dim=12))
    with pytest.raises(ConfigError, match=r"moe.grouped_mm = 'on', but torch._grouped_mm cannot run here: its rows must be multiples of 16 bytes and the experts have sizes \[12\] in torch.bfloat16"):
        RunPlan.build(config, 1, torch.device("cpu"), model_args=odd)
    RunPlan.build(config, 1, torch.device("cpu"), model_args=dataclasses.replace(args, moe=dataclasses.replace(args.moe, hidden_dim=16)))


def test_bf16_grouped_matches_loop():
    layer = make_moe(hidden_dim=16).to(torch.bfloat16)
    x = torch.randn(2, 16, 16, dtype=torch.bfloat16)
    outs = []
    for mode in ("on", "off"):
        layer.experts.grouped_mm = mode == "on"
        outs.append(layer(x).float())
    assert (outs[0] - outs[1]).abs().max() < 2e-2
    assert F.mse_loss(outs[0], outs[1]) < 1e-5


def test_the_layer_compiles_whole_in_float32():
    """fullgraph tracing (fake tensors, the float32 grouped-matmul op, the statistics, the loss hook); aot_eager
    keeps it fast, inductor's kernels are covered by the compile parity of training runs."""
    layer = make_moe(hidden_dim=16, shared_hidden_dim=8)
    layer.aux_loss_coef, layer.z_loss_coef = 0.1, 0.01
    compiled = copy.deepcopy(layer)
    compiled.forward = torch.compile(compiled.forward, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(8))
    for model in (layer, compiled):
        model(x).pow(2).sum().backward()
    assert torch.equal(layer.tokens_per_expert, compiled.tokens_per_expert)
    assert torch.allclose(layer.step_stats(1), compiled.step_stats(1))
    for (name, p), q in zip(layer.named_parameters(), compiled.parameters()):
        assert (p.grad - q.grad).abs().max() < 1e-6, name


def test_a_pipeline_shape_inference_forward_is_left_out():
    """torch's pipeline schedules run one forward on placeholder (uninitialised) inputs before the first
    microbatch; with one forward more than expected, the step's first is dropped, NaN and all."""
    layer = make_moe()
    gen = torch.Generator().manual_seed(9)
    batches = [torch.randn(1, 8, 16, generator=gen) for _ in range(2)]
    layer(torch.full((1, 8, 16), float("nan"))).sum().backward()
    for batch in batches:
        layer(batch).sum().backward()
    totals = layer.step_stats(expected_forwards=2)
    reference = make_moe()
    for batch in batches:
        reference(batch).sum().backward()
    assert torch.equal(totals, reference.step_stats(expected_forwards=2))
    assert totals[:8].sum() == 2 * 8 * 2 and not totals.isnan().any()
