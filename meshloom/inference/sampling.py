"""Choosing the next token: greedy, or temperature sampling cut to the top k and/or the top-p nucleus."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshloom.config.errors import UserError

# How each setting is called where it is set; error messages name it so.
CLI_NAMES = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p"}


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = no cut
    top_p: float = 1.0  # 1 = no nucleus cut
    seed: int | None = None  # a seeded generator makes a sample reproducible

    def check(self, names: dict[str, str] = CLI_NAMES) -> SamplingSettings:
        """Raise UserError naming the setting (as `names` calls it) for a value outside its range."""
        if not self.temperature >= 0:
            raise UserError(f"{names['temperature']} must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"{names['top_k']} must be >= 0 (0 = no top-k cut), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"{names['top_p']} must be in (0, 1] (1 = no nucleus cut), got {self.top_p}")
        return self

    def check_cuts_apply(self, names: dict[str, str] = CLI_NAMES) -> SamplingSettings:
        """Raise UserError when a top-k or top-p cut is set but greedy decoding (temperature 0) ignores it."""
        if self.greedy and (self.top_k > 0 or self.top_p < 1):
            cut = names["top_k"] if self.top_k > 0 else names["top_p"]
            raise UserError(
                f"{cut} only cuts a sampled distribution, but {names['temperature']} is 0 (greedy); "
                f"set {names['temperature']} above 0 (e.g. 0.8) to sample, or drop {cut}"
            )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.greedy or self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


# What validation.* sampling settings are called in a recipe.
VALIDATION_NAMES = {"temperature": "validation.temperature", "top_k": "validation.top_k", "top_p": "validation.top_p"}


def check_sampling_settings(validation) -> None:
    """ConfigError for validation.* sampling settings out of range, when validation.prompts asks for samples."""
    from meshloom.config.errors import ConfigError

    v = validation
    if not v.prompts:
        return
    try:
        SamplingSettings(v.temperature, v.top_k, v.top_p, v.sample_seed).check(VALIDATION_NAMES).check_cuts_apply(VALIDATION_NAMES)
    except UserError as err:
        raise ConfigError(str(err)) from None
    if v.max_new_tokens < 1:
        raise ConfigError(f"validation.max_new_tokens must be >= 1, got {v.max_new_tokens}")


def next_tokens(logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [b, vocab] -> token ids [b]."""
    if settings.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / settings.temperature
    if settings.top_k > 0 and settings.top_k < logits.shape[-1]:
        kth = torch.topk(logits, settings.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if settings.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the more likely ones already reach top_p; the most likely one always stays.
        drop = probs.cumsum(dim=-1) - probs >= settings.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
