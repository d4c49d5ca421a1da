"""Gated DeltaNet (the gated delta rule) and its short causal convolution, in plain torch with exact document resets.

State layout [b, h, dk, dv]. Per token, with the state first decayed and then corrected towards v_t:

    S' = exp(g_t) S_{t-1},    S_t = S' + k_t (beta_t (v_t - S'^T k_t))^T,    o_t = S_t^T (scale * q_t)

`chunk_gated_delta_rule` is the chunked (WY / UT-transform) form for training; `recurrent_gated_delta_rule` the
token-by-token form for decoding and the reference the chunked one is tested against. Both compute in float32. On
CUDA both can run flash-linear-attention's kernels instead: the caller passes fla's ops module (`fla`), which the
run's kernel plan chose before the run (meshloom/planning/kernels.py); the rules themselves ask the device nothing.

Documents: `document_ids [b, s]`; the state resets (to zero) wherever the id differs from the previous token's. Resets
are exact: within a chunk every pairwise term is masked by "same document", and the state carried into a chunk is cut
at the first reset, instead of a large negative decay whose cumulative sums would lose float32 precision.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor


def document_segments(document_ids: Tensor) -> Tensor:
    """[b, s] running count of document starts: equal values = one contiguous document (the first token is 0).

    Only changes from the previous token start a document, so ids that recur later still start a fresh document."""
    starts = torch.zeros_like(document_ids, dtype=torch.long)
    starts[:, 1:] = (document_ids[:, 1:] != document_ids[:, :-1]).long()
    return starts.cumsum(dim=1)


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float,
    initial_state: Tensor | None = None,
    document_ids: Tensor | None = None,
    chunk_size: int = 64,
    fla: ModuleType | None = None,
) -> tuple[Tensor, Tensor]:
    """q, k [b, s, h, dk] (already L2-normalised by the caller; key heads already repeated to the value heads),
    v [b, s, h, dv], g [b, s, h] log decay (<= 0), beta [b, s, h]; document_ids [b, s] (int, equal ids = same
    document; the state resets where the id changes from the previous token). Computes in float32.
    Returns (out [b, s, h, dv] in q.dtype, final state [b, h, dk, dv] float32).

    `initial_state` belongs to the document of the first token (which never resets): a caller handing over a state
    from an earlier part of the sequence cuts it itself where that part's last id differs from this first one.
    It may be wider than v ([b, h, dk, dv'], dv' > dv): its extra columns evolve with zero values and
    `out` and the final state then have dv' columns. Started at the identity, they give how the outputs and the
    final state depend on the incoming state (context parallel's state passing uses this). `fla`: fla's
    gated delta rule ops module, to run its kernel instead (CUDA)."""
    if fla is not None:
        return _fla_rule(fla.chunk_gated_delta_rule, q, k, v, g, beta, scale, initial_state, document_ids)
    segments = None if document_ids is None else document_segments(document_ids)
    with torch.autocast(q.device.type, enabled=False):  # float32 also inside an autocast region
        out, state = chunked_scan(q, k, v, g, beta, scale=scale, state=_initial(q, v, initial_state),
                                  segments=segments, chunk_size=chunk_size)
    return out.to(q.dtype), state


def recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float,
    initial_state: Tensor | None = None,
    document_ids: Tensor | None = None,
    fla: ModuleType | None = None,
) -> tuple[Tensor, Tensor]:
    """Same contract as `chunk_gated_delta_rule`, token by token (decoding, and the chunked form's reference)."""
    if fla is not None:
        return _fla_rule(fla.fused_recurrent_gated_delta_rule, q, k, v, g, beta, scale, initial_state,
                         document_ids)
    dtype = q.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    state = _initial(q, v, initial_state)
    v = F.pad(v, (0, state.shape[-1] - v.shape[-1]))  # a wider state's extra columns see zero values
    # Cut before token t where a document starts there (token 0 never: the initial state is its document's).
    keep = torch.ones(q.shape[:2], device=q.device)
    if document_ids is not None:
        keep[:, 1:] = (document_ids[:, 1:] == document_ids[:, :-1]).float()
    outs = []
    with torch.autocast(q.device.type, enabled=False):  # float32 also inside an autocast region
        # unbind, not indexing in the loop (see chunked_scan).
        for q_t, k_t, v_t, g_t, beta_t, keep_t in zip(*(x.unbind(1) for x in (q, k, v, g, beta, keep))):
            state = state * (keep_t[:, None, None, None] * g_t.exp()[..., None, None])
            predicted = torch.einsum("bhkv,bhk->bhv", state, k_t)
            delta = beta_t[..., None] * (v_t - predicted)
            state = state + k_t[..., :, None] * delta[..., None, :]
            outs.append(torch.einsum("bhkv,bhk->bhv", state, q_t * scale))
    out = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return out.to(dtype), state


def chunked_scan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float,
    state: Tensor,
    segments: Tensor | None,
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """The chunked rule in float32 from `state` [b, h, dk, dv'] (float32 out [b, s, h, dv'], final state).

    `state` may be wider than v (dv' >= dv): its extra columns are carried with zero values, which is how state
    passing obtains, in the same pass, how every output and the final state depend on the incoming state (it
    starts those columns at the identity). `segments` [b, s] as from `document_segments`, or None."""
    b, s, h, dk = k.shape
    dv, wide = v.shape[-1], state.shape[-1]
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if segments is None:
        segments = torch.zeros(b, s, dtype=torch.long, device=q.device)
    # Padding tokens have k = q = v = 0, beta = 0 and no decay, and stay in the last document: they change nothing.
    pad = (-s) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    segments = F.pad(segments, (0, pad), mode="replicate") if pad else segments
    n, c = (s + pad) // chunk_size, chunk_size
    # [b, h, n, c, ...]
    q, k, v = (x.reshape(b, n, c, h, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v))
    g, beta = (x.reshape(b, n, c, h).permute(0, 3, 1, 2) for x in (g, beta))
    seg = segments.reshape(b, 1, n, c)
    # Which tokens still belong to the document the chunk's incoming state belongs to: those before the first
    # document start inside the chunk (the first chunk's incoming state is the initial state, of token 0's document).
    seg_before = torch.cat([seg[:, :, :1, :1], seg[:, :, :-1, -1:]], dim=2)
    carries = (seg == seg_before).float()  # [b, 1, n, c]
    same = seg.unsqueeze(-1) == seg.unsqueeze(-2)  # [b, 1, n, c, c]

    decay = g.cumsum(dim=-1)  # log decay from the chunk start to each token, inclusive
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    pair_decay = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(~(causal & same), float("-inf")).exp()
    strict = pair_decay.masked_fill(torch.eye(c, dtype=torch.bool, device=q.device), 0.0)
    k_beta = k * beta.unsqueeze(-1)
    # (I + A) U = beta V - beta exp(decay) K S_in, with A strictly lower: the delta rule's corrections inside a chunk.
    system = (k_beta @ k.transpose(-1, -2)) * strict + torch.eye(c, device=q.device)
    new_values = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    if wide > dv:  # the state's extra columns see zero values
        new_values = F.pad(new_values, (0, wide - dv))
    state_keys = torch.linalg.solve_triangular(system, k_beta * (decay.exp() * carries).unsqueeze(-1),
                                               upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * pair_decay * scale
    query_read = q * (decay.exp() * carries).unsqueeze(-1) * scale
    # What each token's update still weighs at the chunk end (zero for documents that end inside the chunk).
    to_end = (decay[..., -1:] - decay).exp() * same[..., -1, :].float()
    keys_to_end = k * to_end.unsqueeze(-1)
    state_decay = (decay[..., -1].exp() * carries[..., -1])[..., None, None]

    # Per-chunk views by unbind, not by indexing in the loop: indexing's backward writes a full-size zero gradient
    # for every chunk, which makes the backward quadratic in the sequence length.
    per_chunk = zip(*(x.unbind(2) for x in (new_values, state_keys, query_read, scores, keys_to_end, state_decay)))
    outs = []
    for chunk_values, chunk_keys, chunk_queries, chunk_scores, chunk_keys_to_end, chunk_decay in per_chunk:
        update = chunk_values - chunk_keys @ state
        outs.append(chunk_queries @ state + chunk_scores @ update)
        state = state * chunk_decay + chunk_keys_to_end.transpose(-1, -2) @ update
    out = torch.stack(outs, dim=2).permute(0, 2, 3, 1, 4).reshape(b, n * c, h, wide)
    return out[:, :s], state


def causal_depthwise_conv(
    x: Tensor,
    weight: Tensor,
    *,
    history: Tensor | None = None,
    document_ids: Tensor | None = None,
    history_document_ids: Tensor | None = None,
) -> Tensor:
    """x [b, s, c], weight [c, K] (a depthwise kernel, no bias, no activation: the caller applies SiLU);
    history [b, K-1, c]: the K-1 inputs before x's first token (zeros when None). out_t = sum_i weight[:, i] *
    x_{t-K+1+i}: weight[:, -1] multiplies the token itself.

    A token never reads inputs of an earlier document (document_ids [b, s]). The history counts as the document of
    x's first token, unless `history_document_ids` [b, K-1] says otherwise (context parallel passes the ids of the
    tokens the history came from, so a chunk that starts a document reads none of it)."""
    width = weight.shape[-1]
    b, s, channels = x.shape
    if history is None:
        history = x.new_zeros(b, width - 1, channels)
    padded = torch.cat([history.to(x.dtype), x], dim=1)
    if document_ids is None:
        reads = [padded[:, width - 1 - lag: width - 1 - lag + s] for lag in range(width)]
    else:
        if history_document_ids is None:
            history_document_ids = document_ids[:, :1].expand(b, width - 1)
        segments = document_segments(torch.cat([history_document_ids, document_ids], dim=1))
        own = segments[:, width - 1:]
        reads = [
            padded[:, width - 1 - lag: width - 1 - lag + s]
            * (segments[:, width - 1 - lag: width - 1 - lag + s] == own).unsqueeze(-1).to(x.dtype)
            for lag in range(width)
        ]
    return sum(read * weight[:, width - 1 - lag] for lag, read in enumerate(reads))


class GatedDeltaCore:
    """The single-process convolution and rule a GDN layer calls (`layer.core`); context parallel swaps in its own.

    Holds no parameters and no state, so one shared instance (`LOCAL_CORE`, the plain-torch rule) serves every layer;
    `configured` gives the one the run's kernel plan chose."""

    def __init__(self, fla: ModuleType | None = None):
        self.fla = fla

    def configured(self, fla_ops: ModuleType | None = None, **_: object) -> GatedDeltaCore:
        """This core with the kernel plan's choice: fla's ops module, or None for the plain-torch rule."""
        return GatedDeltaCore(fla_ops)

    def conv(self, x: Tensor, weight: Tensor, document_ids: Tensor | None = None) -> Tensor:
        """`causal_depthwise_conv` of the whole sequence, with no history."""
        return causal_depthwise_conv(x, weight, document_ids=document_ids)

    def rule(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
             document_ids: Tensor | None = None) -> Tensor:
        """`chunk_gated_delta_rule`'s output from a zero state."""
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, document_ids=document_ids, fla=self.fla)[0]


LOCAL_CORE = GatedDeltaCore()


def _initial(q: Tensor, v: Tensor, initial_state: Tensor | None) -> Tensor:
    b, _, h, dk = q.shape
    if initial_state is None:
        return torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32, device=q.device)
    return initial_state.float()


def _fla_rule(op, q, k, v, g, beta, scale, initial_state, document_ids) -> tuple[Tensor, Tensor]:
    """One fla call; documents become its variable-length sequences over the flattened batch."""
    b, s, h, dk = q.shape
    if initial_state is not None and initial_state.shape[-1] > v.shape[-1]:
        v = F.pad(v, (0, initial_state.shape[-1] - v.shape[-1]))
    if document_ids is None:
        out, state = op(q, k, v, g=g.float(), beta=beta, scale=scale, initial_state=_initial(q, v, initial_state),
                        output_final_state=True)
        return out.to(q.dtype), state.float()
    segments = document_segments(document_ids)
    starts = torch.ones(b, s, dtype=torch.bool, device=q.device)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    flat_starts = starts.reshape(-1).nonzero().squeeze(-1)
    total = torch.tensor([b * s], device=q.device)
    cu_seqlens = torch.cat([flat_starts, total]).long()
    # Each row's first document continues that row's initial state; the others start from zero.
    states = torch.zeros(flat_starts.numel(), h, dk, v.shape[-1], dtype=torch.float32, device=q.device)
    row_first = (flat_starts % s == 0).nonzero().squeeze(-1)
    states = states.index_copy(0, row_first, _initial(q, v, initial_state))
    q, k, v, g, beta = (x.reshape(1, b * s, *x.shape[2:]) for x in (q, k, v, g.float(), beta))
    out, final = op(q, k, v, g=g, beta=beta, scale=scale, initial_state=states, output_final_state=True, cu_seqlens=cu_seqlens)
    row_last = torch.cat([row_first[1:], torch.tensor([flat_starts.numel()], device=q.device)]) - 1
    return out.reshape(b, s, h, -1).to(q.dtype), final.float()[row_last]
