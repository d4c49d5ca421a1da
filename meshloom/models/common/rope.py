"""Rotary position embeddings: frequency tables, their long-context scalings, and the two channel layouts.

Tables are real-valued (cos, sin) of shape [max_seq_len, rotary_dim // 2], which DTensor and torch.compile
handle more gracefully than complex numbers. A family picks the layout its original checkpoints use:
``apply_rope`` rotates adjacent channel pairs (0,1), (2,3), ... (Meta's Llama, DeepSeek's released weights);
``apply_rope_half`` rotates channel i with channel i + rotary_dim/2 (Hugging Face's Llama, Qwen).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from meshloom.config.errors import UserError


class FrequencyScaling(Protocol):
    """A long-context rescaling of per-pair RoPE frequencies (radians per token)."""

    def scale_frequencies(self, freqs: torch.Tensor) -> torch.Tensor: ...


@dataclass
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling (long-context extension).

    Frequencies whose wavelength is short compared to the original context are
    kept, long-wavelength ones are divided by ``factor``, and the band in
    between is interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise UserError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if not self.high_freq_factor > self.low_freq_factor > 0:
            raise UserError(
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"low_freq_factor={self.low_freq_factor}, high_freq_factor={self.high_freq_factor}"
            )
        if self.original_max_seq_len <= 0:
            raise UserError(
                f"rope_scaling.original_max_seq_len must be > 0, got {self.original_max_seq_len}"
            )

    def scale_frequencies(self, freqs: torch.Tensor) -> torch.Tensor:
        return scale_rope_frequencies(freqs, self)


def scale_rope_frequencies(freqs: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Apply Llama 3.1 frequency scaling to per-pair RoPE frequencies (radians/token)."""
    wavelen = 2 * math.pi / freqs
    # Wavelengths (in tokens) bounding the interpolated band.
    high_freq_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    low_freq_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    # smooth = 1 keeps the frequency, smooth = 0 divides it by factor.
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling.factor, interpolated)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def rope_tables(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    scaling: FrequencyScaling | None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return float32 (cos, sin) tables of shape [max_seq_len, head_dim // 2]."""
    # float64 for the angles: position * frequency reaches ~1e5 radians at long
    # context, where float32 would lose most of the fractional part.
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim
    freqs = 1.0 / (theta**exponents)
    if scaling is not None:
        freqs = scaling.scale_frequencies(freqs)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(positions, freqs)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, s, heads, head_dim] by position, channels in adjacent pairs (0,1), (2,3), ...

    cos/sin are [s, head_dim // 2].
    """
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, s, heads, head_dim] by position, channel i paired with channel i + head_dim/2.

    cos/sin are [s, head_dim // 2].
    """
    xf = x.float()
    x0, x1 = xf.chunk(2, dim=-1)
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).type_as(x)


def apply_rope_half_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope_half` on the first 2 * cos.shape[-1] channels of each head (partial rotary: the tables were built
    for that rotary dimension); the other channels pass unrotated."""
    rotary = 2 * cos.shape[-1]
    if rotary == x.shape[-1]:
        return apply_rope_half(x, cos, sin)
    return torch.cat((apply_rope_half(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `factor` times: 0.1·mscale·ln(factor) + 1 (1 if factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass
class YarnScaling:
    """YaRN RoPE scaling (Peng et al. 2023), as DeepSeek-V2/V3 use it to stretch a context `factor` times.

    Frequencies that turn more than `beta_fast` times over the original context are kept, those turning fewer
    than `beta_slow` times are divided by `factor`, and a linear ramp over the pair index blends the band in
    between (its ends rounded outward to whole pairs when `truncate`, as DeepSeek's reference does).

    Attention is sharpened to make up for the stretch, in two places:
    * `rope_attention_factor` multiplies the cos/sin tables, so the rotated channels of q and k each carry it
      (`attention_factor` when set, else yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim), or
      yarn_mscale(factor) when either mscale is 0);
    * `softmax_scale_factor` multiplies the softmax scale: yarn_mscale(factor, mscale_all_dim)² (1 when
      mscale_all_dim is 0). DeepSeek-V3 sets mscale = mscale_all_dim = 1, so only this one acts there.
    """

    factor: float
    original_max_seq_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise UserError(f"yarn rope_scaling.factor must be > 0, got {self.factor}")
        if self.original_max_seq_len <= 0:
            raise UserError(f"yarn rope_scaling.original_max_seq_len must be > 0, got {self.original_max_seq_len}")
        # Equal betas (Kimi K2 ships beta_fast = beta_slow = 1) make the ramp a step, as in Hugging Face's YaRN.
        if not self.beta_fast >= self.beta_slow > 0:
            raise UserError(
                f"yarn rope_scaling needs beta_fast >= beta_slow > 0, got beta_fast={self.beta_fast}, beta_slow={self.beta_slow}"
            )

    @property
    def rope_attention_factor(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def scale_frequencies(self, freqs: torch.Tensor) -> torch.Tensor:
        """freqs: theta^(-2i/d) for pairs i = 0 .. d/2 - 1, as `rope_tables` makes them (d and theta are read back)."""
        pairs = freqs.numel()
        if pairs < 2:
            raise UserError(f"yarn rope scaling needs a rotary dimension of at least 4, got {2 * pairs}")
        dim = 2 * pairs
        log_theta = -math.log(float(freqs[1])) * dim / 2

        def correction_dim(rotations: float) -> float:
            # The (fractional) pair index whose wavelength fits `rotations` times into the original context.
            return dim * math.log(self.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * log_theta)

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # a ramp of zero width would divide by zero
        ramp = ((torch.arange(pairs, dtype=freqs.dtype, device=freqs.device) - low) / (high - low)).clamp(0, 1)
        # ramp = 0 keeps a frequency, ramp = 1 divides it by factor.
        return freqs / self.factor * ramp + freqs * (1 - ramp)
