"""The gated delta rule and its causal convolution: chunked against token-by-token, against transformers' reference,
document resets against separate runs, and state hand-over between two halves of a sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshloom.models.common.gated_delta import (
    LOCAL_CORE,
    causal_depthwise_conv,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

TOLERANCE = 1e-5


def _inputs(b=2, s=37, h=3, dk=8, dv=6, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q = F.normalize(rand(b, s, h, dk), dim=-1)
    k = F.normalize(rand(b, s, h, dk), dim=-1)
    v = rand(b, s, h, dv)
    g = F.logsigmoid(rand(b, s, h) + 2.0)  # decays mostly near 1, as trained models have
    beta = torch.sigmoid(rand(b, s, h))
    state = rand(b, h, dk, dv) * 0.5
    return [x.to(device) for x in (q, k, v, g, beta, state)]


def _documents(b, s, starts_per_row):
    ids = torch.zeros(b, s, dtype=torch.long)
    for row, starts in enumerate(starts_per_row):
        for start in starts:
            ids[row, start:] += 1
    return ids


def _close(a, b):
    torch.testing.assert_close(a, b, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("chunk_size", [4, 8, 64])
def test_chunked_matches_recurrent_with_gradients(chunk_size):
    """37 tokens: chunk sizes that do not divide s (padding), and one larger than s."""
    inputs = [x.requires_grad_() for x in _inputs()]
    q, k, v, g, beta, state = inputs
    out_c, final_c = chunk_gated_delta_rule(q, k, v, g, beta, scale=0.7, initial_state=state, chunk_size=chunk_size)
    out_r, final_r = recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.7, initial_state=state)
    _close(out_c, out_r)
    _close(final_c, final_r)
    weights = [torch.randn_like(out_c), torch.randn_like(final_c)]
    grads_c = torch.autograd.grad((out_c * weights[0]).sum() + (final_c * weights[1]).sum(), inputs)
    grads_r = torch.autograd.grad((out_r * weights[0]).sum() + (final_r * weights[1]).sum(), inputs)
    for grad_c, grad_r in zip(grads_c, grads_r):
        _close(grad_c, grad_r)


def test_chunked_matches_transformers_reference():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v, g, beta, state = _inputs(s=70, dk=8, dv=8)
    ours, ours_state = chunk_gated_delta_rule(q, k, v, g, beta, scale=8**-0.5, initial_state=state)
    theirs, theirs_state = torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=False
    )
    _close(ours, theirs)
    _close(ours_state, theirs_state)


def _separately(rule, q, k, v, g, beta, state, ids):
    """Each document run on its own: the row's initial state for its first document, zero for the others."""
    outs = torch.empty_like(v)
    finals = []
    for row in range(ids.shape[0]):
        starts = [0] + [t for t in range(1, ids.shape[1]) if ids[row, t] != ids[row, t - 1]] + [ids.shape[1]]
        for index, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
            piece = [x[row: row + 1, start:end] for x in (q, k, v, g, beta)]
            initial = state[row: row + 1] if index == 0 else None
            out, final = rule(*piece, scale=0.5, initial_state=initial)
            outs[row: row + 1, start:end] = out
        finals.append(final)
    return outs, torch.cat(finals)


@pytest.mark.parametrize("rule", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_document_resets_equal_separate_runs(rule):
    """Starts inside a chunk, exactly at a chunk edge (8, 16 with chunk 8), one-token documents, and an id that
    comes back (row 1: 0,1,0 are three documents)."""
    q, k, v, g, beta, state = _inputs(s=29)
    ids = _documents(2, 29, [[5, 8, 9, 16, 27], [12]])
    ids[1, 20:] = 0
    kwargs = {"chunk_size": 8} if rule is chunk_gated_delta_rule else {}
    out, final = rule(q, k, v, g, beta, scale=0.5, initial_state=state, document_ids=ids, **kwargs)
    expected_out, expected_final = _separately(recurrent_gated_delta_rule, q, k, v, g, beta, state, ids)
    _close(out, expected_out)
    _close(final, expected_final)


def test_document_reset_gradients_match_separate_runs():
    inputs = [x.requires_grad_() for x in _inputs(s=20)]
    ids = _documents(2, 20, [[8], [3, 17]])
    out, final = chunk_gated_delta_rule(*inputs[:5], scale=0.5, initial_state=inputs[5], document_ids=ids,
                                        chunk_size=8)
    expected_out, expected_final = _separately(recurrent_gated_delta_rule, *inputs, ids)
    weights = [torch.randn_like(out), torch.randn_like(final)]
    grads = torch.autograd.grad((out * weights[0]).sum() + (final * weights[1]).sum(), inputs)
    expected = torch.autograd.grad((expected_out * weights[0]).sum() + (expected_final * weights[1]).sum(), inputs)
    for grad, grad_expected in zip(grads, expected):
        _close(grad, grad_expected)


@pytest.mark.parametrize("rule", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_state_hands_over_between_halves(rule):
    q, k, v, g, beta, state = _inputs(s=30)
    ids = _documents(2, 30, [[4, 21], [13]])
    kwargs = {"chunk_size": 8} if rule is chunk_gated_delta_rule else {}
    whole, whole_final = rule(q, k, v, g, beta, scale=0.5, initial_state=state, document_ids=ids, **kwargs)
    split = 13  # row 1's document starts exactly at the split: the handed-over state must be dropped there
    first, middle = rule(*(x[:, :split] for x in (q, k, v, g, beta)), scale=0.5, initial_state=state,
                         document_ids=ids[:, :split], **kwargs)
    second_ids = ids[:, split:]
    # A document starting exactly at the split is the caller's to cut: the kernel's first token never resets.
    starts_here = (ids[:, split] != ids[:, split - 1]).float()[:, None, None, None]
    second, final = rule(*(x[:, split:] for x in (q, k, v, g, beta)), scale=0.5,
                         initial_state=middle * (1 - starts_here), document_ids=second_ids, **kwargs)
    _close(torch.cat([first, second], dim=1), whole)
    _close(final, whole_final)


@pytest.mark.parametrize("rule", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_output_keeps_input_dtype_and_state_is_float32(rule):
    q, k, v, g, beta, _ = _inputs(s=9)
    out, state = rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, scale=0.5)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    expected, _ = rule(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), g, beta, scale=0.5)
    _close(out.float(), expected.bfloat16().float())


@pytest.mark.parametrize("rule", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_bf16_autocast_does_not_lower_the_float32_computation(rule):
    q, k, v, g, beta, state = _inputs(s=19)
    expected, expected_final = rule(q, k, v, g, beta, scale=0.5, initial_state=state)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, final = rule(q, k, v, g, beta, scale=0.5, initial_state=state)
    _close(out, expected)
    _close(final, expected_final)


def _conv_inputs(b=2, s=19, channels=5, width=4):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(b, s, channels, generator=gen), torch.randn(channels, width, generator=gen)


def test_conv_matches_transformers_causal_conv1d():
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn

    x, weight = _conv_inputs()
    theirs = causal_conv1d_fn(x.transpose(1, 2), weight).transpose(1, 2)
    _close(causal_depthwise_conv(x, weight), theirs)
    _close(LOCAL_CORE.conv(x, weight), theirs)


def test_conv_documents_equal_separate_runs():
    x, weight = _conv_inputs()
    ids = _documents(2, 19, [[2, 3, 10], [15]])
    out = causal_depthwise_conv(x, weight, document_ids=ids)
    for row in range(2):
        starts = [0] + [t for t in range(1, 19) if ids[row, t] != ids[row, t - 1]] + [19]
        for start, end in zip(starts[:-1], starts[1:]):
            _close(out[row, start:end], causal_depthwise_conv(x[row: row + 1, start:end], weight)[0])


def test_conv_history_equals_the_longer_sequence():
    """History continues the sequence; history_document_ids cut it where the documents say."""
    x, weight = _conv_inputs(s=20)
    ids = _documents(2, 20, [[9], [10]])  # row 1: a document starts exactly where the second part begins
    whole = causal_depthwise_conv(x, weight, document_ids=ids)
    part = causal_depthwise_conv(x[:, 10:], weight, history=x[:, 7:10], document_ids=ids[:, 10:],
                                 history_document_ids=ids[:, 7:10])
    _close(part, whole[:, 10:])
    # Without history ids the history counts as the first token's document: row 0 is then the plain continuation.
    plain = causal_depthwise_conv(x[:, 10:], weight, history=x[:, 7:10])
    _close(plain, causal_depthwise_conv(x, weight)[:, 10:])


def test_core_rule_is_the_chunked_output_from_zero():
    q, k, v, g, beta, _ = _inputs(s=11)
    ids = _documents(2, 11, [[3], []])
    expected, _ = recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.3, document_ids=ids)
    _close(LOCAL_CORE.rule(q, k, v, g, beta, 0.3, document_ids=ids), expected)


@pytest.mark.parametrize("rule", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_identity_columns_give_the_affine_map_of_the_incoming_state(rule):
    """From [0 | I] the outputs are [o(0) | R] and the final state [B | T]: from any S, o = o(0) + R S and the
    final state is T S + B, also with a document starting mid-sequence (row 0), which cuts S off."""
    q, k, v, g, beta, state = _inputs(s=21)
    ids = _documents(2, 21, [[9], []])
    dk, dv = q.shape[-1], v.shape[-1]
    start = torch.zeros(2, 3, dk, dv + dk)
    start[..., dv:] = torch.eye(dk)
    kwargs = {"chunk_size": 8} if rule is chunk_gated_delta_rule else {}
    wide, wide_final = rule(q, k, v, g, beta, scale=0.5, initial_state=start, document_ids=ids, **kwargs)
    out, final = rule(q, k, v, g, beta, scale=0.5, initial_state=state, document_ids=ids, **kwargs)
    _close(wide[..., :dv] + torch.einsum("bshk,bhkv->bshv", wide[..., dv:], state), out)
    _close(wide_final[..., dv:] @ state + wide_final[..., :dv], final)
    assert wide[0, 9:, :, dv:].abs().max() == 0 and wide_final[0, :, :, dv:].abs().max() == 0


@pytest.mark.cuda
def test_fla_kernel_plan_matches_what_fla_does_on_this_gpu():
    """The declared condition against fla itself, forward and backward (the first GPU's failure was in the backward):
    where the plan says fla trains here, its chunked rule matches the plain-torch path in outputs and gradients; where
    the plan refuses it (Hopper with Triton < 3.7.1), fla's backward really raises, and the fallback trains."""
    from meshloom.planning.kernels import DeviceFacts, fla_blocker, load_fla_ops

    facts = DeviceFacts.probe("cuda", torch.device("cuda"))
    if not facts.fla_importable:
        pytest.skip("fla-core does not import here (pip install -e '.[fla]')")
    fla = load_fla_ops()
    q, k, v, g, beta, state = _inputs(b=2, s=150, h=2, dk=64, dv=64)
    ids = _documents(2, 150, [[40, 64, 100], []])
    blocked = fla_blocker(facts, training=True)
    for documents in (None, ids):
        inputs = [x.cuda().requires_grad_(x.is_floating_point()) for x in (q, k, v, g, beta)]
        expected, _ = chunk_gated_delta_rule(*inputs, scale=0.125, initial_state=state.cuda(),
                                             document_ids=None if documents is None else documents.cuda())
        expected_grads = torch.autograd.grad(expected.sum(), inputs)
        out, _ = chunk_gated_delta_rule(*inputs, scale=0.125, initial_state=state.cuda(),
                                        document_ids=None if documents is None else documents.cuda(), fla=fla)
        # fla's kernels run TF32 dots internally: looser than the CPU parity bound.
        torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
        if blocked is not None:
            with pytest.raises(RuntimeError, match="Triton"):
                torch.autograd.grad(out.sum(), inputs)
            continue
        for grad, reference in zip(torch.autograd.grad(out.sum(), inputs), expected_grads):
            torch.testing.assert_close(grad, reference, atol=5e-3, rtol=5e-3)
