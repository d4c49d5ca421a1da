"""A preallocated per-layer KV cache for left-padded batches, installed into a single-device model from outside.

Every module with a ``kv_cache`` attribute (the shared attention blocks of ``meshloom.models.common``) gets a
`LayerCache` while the `KVCache` is installed; the model itself only needs to accept RoPE ``positions`` of
shape [b, s]. Sequences of a batch are left-padded to one length, so one write offset serves them all:

    cache index   0   1   2   3 | 4 ...        row 0: pad pad  a   b  | c ...   (2 pad slots)
                                               row 1:  x   y   z   w  | v ...   (no padding)

A query sees the keys at or before its own index that are not padding (a padding query sees itself only,
so its softmax stays finite; nothing real ever reads it). RoPE positions count from each row's first real
token (row 0's "a" is position 0), so a padded prompt computes what it computes alone.

A module whose class sets ``recurrent = True`` (a Gated DeltaNet layer) gets a `RecurrentCache` instead: its
recurrent state and the last inputs of its short convolution. The module zeroes the inputs of padding positions
(`RecurrentCache.real_tokens`), which leaves a zero state and zero convolution history, so padding cannot leak into
the state either.
"""

from __future__ import annotations

import torch
from torch import nn

from meshloom.models.common.gated_delta import causal_depthwise_conv, chunk_gated_delta_rule, recurrent_gated_delta_rule


class LayerCache:
    """Keys and values of one attention layer: buffers [b, heads, max_len, dim], allocated at the first write
    (so heads, dims and dtype come from the layer itself)."""

    def __init__(self, owner: KVCache):
        self.owner = owner
        self.buffers: list[torch.Tensor] = []

    def update(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Store this step's tensors [b, heads, s, dim] at the current offset; returns all cached ones
        [b, heads, offset + s, dim] and the attention mask [b, 1, s, offset + s]."""
        s = tensors[0].shape[2]
        start, end = self.owner.offset, self.owner.offset + s
        if end > self.owner.max_len:
            raise ValueError(f"the KV cache holds {self.owner.max_len} positions; writing {s} more at {start} overflows it")
        if not self.buffers:
            self.buffers = [t.new_zeros(*t.shape[:2], self.owner.max_len, *t.shape[3:]) for t in tensors]
        out = []
        for buffer, t in zip(self.buffers, tensors, strict=True):
            buffer[:, :, start:end] = t
            out.append(buffer[:, :, :end])
        return (*out, self.owner.mask(s))


class RecurrentCache:
    """The state of one gated-delta-rule layer: the recurrent state [b, h, dk, dv] (float32) and the last K-1 inputs
    [b, K-1, channels] of its causal depthwise convolution. The first call (the prompt) runs the chunked rule from a
    zero state; each later call continues from the stored state (one token: the recurrent rule)."""

    def __init__(self, owner: KVCache):
        self.owner = owner
        self.state: torch.Tensor | None = None
        self.history: torch.Tensor | None = None

    def real_tokens(self, s: int) -> torch.Tensor:
        """[b, s] bool: which of the next s positions hold real tokens (not left padding)."""
        return self.owner.key_valid[:, self.owner.offset : self.owner.offset + s]

    def conv(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The convolution of this step's inputs x [b, s, channels] after the stored ones; keeps the last K-1."""
        out = causal_depthwise_conv(x, weight, history=self.history)
        width = weight.shape[-1] - 1
        previous = self.history if self.history is not None else x.new_zeros(x.shape[0], width, x.shape[2])
        self.history = torch.cat([previous.to(x.dtype), x], dim=1)[:, -width:] if width else previous
        return out

    def rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float) -> torch.Tensor:
        """The gated delta rule over this step's tokens from the stored state; stores the final state."""
        step = recurrent_gated_delta_rule if q.shape[1] == 1 else chunk_gated_delta_rule
        out, self.state = step(q, k, v, g, beta, scale=scale, initial_state=self.state)
        return out


class KVCache:
    """The cache of a whole model for one batch. Use as a context manager (or install / remove):

        with KVCache(model, pad_lengths, max_len) as cache:
            logits = model(tokens, positions=cache.positions(tokens.shape[1]))
            cache.advance(tokens.shape[1])
    """

    def __init__(self, model: nn.Module, pad_lengths: list[int] | torch.Tensor, max_len: int, device: torch.device | None = None):
        self.model = model
        device = device or next(model.parameters()).device
        self.pad = torch.as_tensor(pad_lengths, dtype=torch.long, device=device)
        self.max_len = max_len
        self.offset = 0
        index = torch.arange(max_len, device=device)
        self.key_valid = index[None, :] >= self.pad[:, None]  # [b, max_len]
        self._index = index
        self._mask_key: tuple[int, int] | None = None
        self._mask: torch.Tensor | None = None
        self.layers = [m for m in model.modules() if hasattr(m, "kv_cache")]
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no attention module with a kv_cache attribute; it cannot decode with a KV cache")

    def install(self) -> KVCache:
        for module in self.layers:
            module.kv_cache = RecurrentCache(self) if getattr(type(module), "recurrent", False) else LayerCache(self)
        return self

    def remove(self) -> None:
        for module in self.layers:
            module.kv_cache = None

    def __enter__(self) -> KVCache:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def positions(self, s: int) -> torch.Tensor:
        """RoPE positions [b, s] of the next s tokens: counted from each row's first real token (padding gets 0)."""
        index = self._index[self.offset : self.offset + s]
        return (index[None, :] - self.pad[:, None]).clamp(min=0)

    def mask(self, s: int) -> torch.Tensor:
        """[b, 1, s, offset + s]: causal, padding keys hidden, each query always sees itself. Built once per step
        and shared by every layer."""
        key = (self.offset, s)
        if self._mask_key != key:
            end = self.offset + s
            queries = self._index[self.offset : end]
            keys = self._index[:end]
            causal = keys[None, :] <= queries[:, None]  # [s, end]
            itself = keys[None, :] == queries[:, None]
            self._mask = (causal[None] & (self.key_valid[:, None, :end] | itself[None]))[:, None]
            self._mask_key = key
        return self._mask

    def advance(self, s: int) -> None:
        """Every layer has written s more positions."""
        self.offset += s
