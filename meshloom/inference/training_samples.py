"""`validation.prompts`: continue a few prompts at every evaluation of a training run, under any layout.

The trained weights are gathered whole to global rank 0 (the same gather as the Hugging Face export), loaded into
one single-device copy of the model kept for the run, and decoded there with the KV cache; the other ranks wait at
a barrier. Compared with decoding on the sharded model, this costs one gather of the weights per evaluation instead
of one FSDP all-gather (or TP collective, or pipeline hand-over) per generated token, and needs room for one more
copy of the weights on rank 0's device. Decoding must finish within comm.train_timeout_seconds, the time the
other ranks wait.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from meshloom.checkpoint.hf_export import gather_full_state
from meshloom.config.errors import ConfigError, UserError
from meshloom.config.schema import Config
from meshloom.inference.generate import check_prompts, generate
from meshloom.inference.prompts import read_prompts
from meshloom.inference.sampling import SamplingSettings
from meshloom.parallel.distributed import rank
from meshloom.planning.run_plan import RunPlan

SETTING_NAMES = {"temperature": "validation.temperature", "top_k": "validation.top_k", "top_p": "validation.top_p"}


def check_sampling_config(config: Config) -> list[str]:
    """The prompts of validation.prompts (empty when unset); ConfigError for a bad file or sampling setting."""
    v = config.validation
    if not v.prompts:
        return []
    try:
        SamplingSettings(v.temperature, v.top_k, v.top_p, v.sample_seed).check(SETTING_NAMES).check_cuts_apply(SETTING_NAMES)
        if v.max_new_tokens < 1:
            raise UserError(f"validation.max_new_tokens must be >= 1, got {v.max_new_tokens}")
        return read_prompts(v.prompts, "validation.prompts")
    except UserError as err:
        raise ConfigError(str(err)) from None


class PromptSampler:
    def __init__(self, plan: RunPlan, prompts: list[str], tokenizer: Any, model_parts: list[nn.Module], device: torch.device, logger: Any):
        v = plan.config.validation
        self.plan, self.texts, self.tokenizer, self.parts, self.device, self.logger = plan, prompts, tokenizer, model_parts, device, logger
        self.settings = SamplingSettings(v.temperature, v.top_k, v.top_p, v.sample_seed)
        self.max_new_tokens = v.max_new_tokens
        self.prompts = [[tokenizer.bos_id, *tokenizer.encode(text)] for text in prompts]
        try:
            check_prompts(self.prompts, self.max_new_tokens, plan.model_args.max_seq_len, what="validation.prompts prompt")
        except UserError as err:
            raise ConfigError(str(err).replace("--max-new-tokens", "validation.max_new_tokens")) from None
        self._copy: nn.Module | None = None
        self.seconds: list[float] = []

    def _single_device_copy(self, state: dict[str, torch.Tensor]) -> nn.Module:
        if self._copy is None:
            with torch.device("meta"):
                self._copy = self.plan.spec.model_cls(self.plan.model_args)
            self._copy.to_empty(device=self.device)
            self._copy.init_weights()  # buffers (RoPE tables); the weights come from the state below
            self._copy.eval()
        self._copy.load_state_dict(state, strict=True)
        return self._copy

    @torch.no_grad()
    def sample(self, step: int) -> None:
        """Every rank calls this at the same step; rank 0 decodes, prints and logs the samples."""
        start = time.perf_counter()
        state = gather_full_state(self.parts, self.plan)
        if state is not None:
            model = self._single_device_copy(state)
            del state
            result = generate(model, self.prompts, self.max_new_tokens, self.settings, [self.tokenizer.eos_id])
            for i, (text, tokens) in enumerate(zip(self.texts, result.tokens)):
                sample = text + self.tokenizer.decode(tokens)
                tqdm.write(f"step {step} | sample {i}: {sample!r}")
                self.logger.log_text(step, f"samples/{i}", sample)
        if dist.is_initialized() and self.plan.world_size > 1:
            dist.barrier()
        self.seconds.append(time.perf_counter() - start)
        if rank() == 0:
            tqdm.write(f"step {step} | sampling {len(self.prompts)} prompts took {self.seconds[-1]:.3f} s")


def build_prompt_sampler(
    plan: RunPlan, prompts: list[str], tokenizer: Any, model_parts: list[nn.Module], device: torch.device, logger: Any
) -> PromptSampler | None:
    return PromptSampler(plan, prompts, tokenizer, model_parts, device, logger) if prompts else None
