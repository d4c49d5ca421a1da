"""Autoregressive generation with a KV cache: one prefill over the left-padded prompts, then one token per step.

Timings are kept apart: prefill (the prompts' forward pass) and decode (every later step), so throughput
reads as prompt tokens/s and generated tokens/s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from meshloom.config.errors import UserError
from meshloom.inference.kv_cache import KVCache
from meshloom.inference.sampling import SamplingSettings, next_tokens


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per prompt, without the stop token
    stopped: list[bool]  # whether each sequence ended on a stop token (else it hit max_new_tokens)
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    # Per prompt, the logits [new tokens, vocab] each new token was chosen from (only with keep_logits).
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def generated_tokens(self) -> int:
        return sum(len(t) + int(s) for t, s in zip(self.tokens, self.stopped))

    def throughput(self) -> dict[str, float]:
        """Prompt tokens/s (prefill) and generated tokens/s (decode), with the seconds they took."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "prefill_seconds": self.prefill_seconds,
            "prefill_tokens_per_second": self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0,
            "generated_tokens": self.generated_tokens,
            "decode_seconds": self.decode_seconds,
            "decode_tokens_per_second": (self.generated_tokens - len(self.tokens)) / self.decode_seconds if self.decode_seconds else 0.0,
        }


def max_context(model: nn.Module) -> int:
    """Positions the model has RoPE tables for (ModelSpec: args.max_seq_len)."""
    return int(model.args.max_seq_len)


def check_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int, context: int, what: str = "prompt") -> None:
    """Raise ValueError naming the prompt and --max-new-tokens when a prompt cannot fit the context."""
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise UserError(f"{what} {i} is empty: it encodes to no tokens")
        if len(prompt) + max_new_tokens > context:
            raise UserError(
                f"{what} {i} has {len(prompt)} tokens; with --max-new-tokens {max_new_tokens} it needs "
                f"{len(prompt) + max_new_tokens} positions, more than the model's context (max_seq_len = {context}); "
                "shorten the prompt or lower --max-new-tokens"
            )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingSettings = SamplingSettings(),
    stop_ids: Sequence[int] = (),
    on_tokens: Callable[[torch.Tensor], None] | None = None,
    should_stop: Callable[[int, list[int]], bool] | None = None,
    keep_logits: bool = False,
    use_cache: bool = True,
    pad_id: int = 0,
) -> Generation:
    """Continue each prompt (token ids) by up to max_new_tokens tokens.

    stop_ids end a sequence (the stop token is not returned). on_tokens(ids [b]) sees each step's choices;
    should_stop(row, tokens so far) may end a row early (e.g. on a stop string). use_cache=False recomputes
    every step over the whole sequence, with the same masks and positions (a reference for tests).
    """
    check_prompts(prompts, max_new_tokens, max_context(model))
    device = next(model.parameters()).device
    batch, longest = len(prompts), max(len(p) for p in prompts)
    pads = [longest - len(p) for p in prompts]
    tokens = torch.full((batch, longest + max_new_tokens), pad_id, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, pads[row] : longest] = torch.tensor(list(prompt), dtype=torch.long)
    max_len = longest + max_new_tokens
    generator = sampling.generator(device)
    stops = torch.tensor(list(stop_ids) or [-1], device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    out: list[list[int]] = [[] for _ in range(batch)]
    stopped = [False] * batch
    kept: list[list[torch.Tensor]] = [[] for _ in range(batch)]

    def forward(cache: KVCache, start: int, end: int) -> torch.Tensor:
        logits = model(tokens[:, start:end], positions=cache.positions(end - start))
        cache.advance(end - start)
        return logits[:, -1].float()

    cache = KVCache(model, pads, max_len, device).install() if use_cache else None
    try:
        _sync(device)
        began = time.perf_counter()
        length = longest
        if cache is not None:
            logits = forward(cache, 0, length)
        else:
            with KVCache(model, pads, max_len, device) as fresh:
                logits = forward(fresh, 0, length)
        _sync(device)
        prefill = time.perf_counter() - began
        steps = 0
        for step in range(max_new_tokens):
            chosen = next_tokens(logits, sampling, generator)
            chosen = torch.where(finished, torch.full_like(chosen, pad_id), chosen)
            tokens[:, length] = chosen
            length += 1
            if on_tokens is not None:
                on_tokens(chosen)
            hit_stop = torch.isin(chosen, stops) & ~finished
            for row in range(batch):
                if finished[row]:
                    continue
                if keep_logits:
                    kept[row].append(logits[row].cpu())
                if hit_stop[row]:
                    stopped[row] = True
                else:
                    out[row].append(int(chosen[row]))
                if hit_stop[row] or (should_stop is not None and should_stop(row, out[row])):
                    finished[row] = True
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            if cache is not None:
                logits = forward(cache, length - 1, length)
            else:
                with KVCache(model, pads, max_len, device) as fresh:
                    logits = forward(fresh, 0, length)
            steps += 1
        _sync(device)
        decode = time.perf_counter() - began - prefill
    finally:
        if cache is not None:
            cache.remove()
    logits_out = [torch.stack(rows) for rows in kept] if keep_logits else []
    return Generation(out, stopped, sum(len(p) for p in prompts), prefill, decode, steps, logits_out)
