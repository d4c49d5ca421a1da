"""lm-evaluation-harness adapter: `--model meshloom --model_args path=RUN_DIR|CHECKPOINT|HF_FOLDER`.

lm_eval 0.4 finds models only in its own registry (it has no plugin entry points), so the model is registered
when this module is imported: `import meshloom.integrations.lm_eval` before `lm_eval.simple_evaluate(model=
"meshloom", ...)`, or run the harness's command line through `meshloom lm-eval ...` (same arguments as `lm_eval`).

model_args: path (required), device (auto), dtype (float32 | bfloat16), tokenizer (a tokenizer.json or tiktoken
file instead of the source's own), add_bos_token (false, as lm_eval's `hf` model for tokenizers that add none),
max_length (default: the model's max_seq_len), max_gen_toks (256).

Tokenisation and context handling come from lm_eval's TemplateLM (the same path its `hf` model takes); scoring
is one forward pass per batch of right-padded sequences, generation is meshloom's KV-cache decoding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from meshloom.checkpoint.hf import parse_dtype
from meshloom.config.errors import UserError
from meshloom.inference import loading
from meshloom.inference.generate import generate
from meshloom.inference.sampling import SamplingSettings

MODEL_ARGS = ("path", "device", "dtype", "batch_size", "tokenizer", "add_bos_token", "max_length", "max_gen_toks")
# Keys lm_eval's own command line adds to every model's arguments.
PASSED_BY_LM_EVAL = {"max_batch_size"}
GEN_KWARG_NAMES = {"temperature": "gen_kwargs temperature", "top_k": "gen_kwargs top_k", "top_p": "gen_kwargs top_p"}


def _flag(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


def check_model_args(
    path: str | None, device: str | None, dtype: str, unused: dict[str, Any]
) -> tuple[loading.InferenceSource, torch.device, torch.dtype]:
    """UserError for a bad --model_args or --device; the checks that need no model, so that `meshloom lm-eval` can
    run them before lm_eval spends its minute indexing every task."""
    unknown = sorted(set(unused) - PASSED_BY_LM_EVAL)
    if unknown:
        raise UserError(
            f"unknown --model_args key {unknown[0]!r} for --model meshloom; its keys are: {', '.join(MODEL_ARGS)}"
            + (" (path= takes the place of hf's pretrained=)" if unknown[0] == "pretrained" else "")
        )
    if not path:
        raise UserError("--model_args needs path=RUN_DIR|CHECKPOINT|HF_FOLDER for --model meshloom")
    return loading.resolve(path), loading.parse_device(device, "--device"), parse_dtype(dtype)


@register_model("meshloom")
class MeshloomLM(TemplateLM):
    def __init__(
        self,
        path: str | None = None,
        device: str | None = "auto",
        dtype: str = "float32",
        batch_size: int | str | None = 8,
        tokenizer: str | None = None,
        add_bos_token: bool | str = False,
        max_length: int | str | None = None,
        max_gen_toks: int | str = 256,
        **unused: Any,
    ) -> None:
        super().__init__()
        source, self._device, model_dtype = check_model_args(path, device, dtype, unused)
        self.meshloom_tokenizer = loading.load_tokenizer(source, tokenizer)
        self.model = loading.load_model(source, self._device, model_dtype)
        self.batch_size = 8 if batch_size in (None, "auto") or str(batch_size).startswith("auto") else int(batch_size)
        self.add_bos_token = _flag(add_bos_token)
        self.max_length = int(max_length) if max_length else int(self.model.args.max_seq_len)
        self.max_gen_toks = int(max_gen_toks)
        self.source = source

    # ------------------------------------------------------------------ tokens

    @property
    def eot_token_id(self) -> int:
        return self.meshloom_tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.meshloom_tokenizer.bos_id

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.meshloom_tokenizer.identity

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs: Any) -> list[int]:
        ids = self.meshloom_tokenizer.encode(string)
        bos = self.add_bos_token if add_special_tokens is None else add_special_tokens and self.add_bos_token
        if bos and (not ids or ids[0] != self.prefix_token_id):
            ids = [self.prefix_token_id, *ids]
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.meshloom_tokenizer.decode(ids)

    # ------------------------------------------------------------------ scoring

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, override_bs: int | None = None) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives the continuation) per request."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        size = override_bs or self.batch_size
        for start in tqdm(range(0, len(order), size), disable=disable_tqdm or len(order) <= size, desc="meshloom loglikelihood"):
            chunk = order[start : start + size]
            rows = [(requests[i][1] + requests[i][2])[-(self.max_length + 1) :][:-1] for i in chunk]
            width = max(len(r) for r in rows)
            inputs = torch.zeros(len(rows), width, dtype=torch.long)
            for j, row in enumerate(rows):
                inputs[j, : len(row)] = torch.tensor(row)  # right padding: earlier positions never see it
            logprobs = F.log_softmax(self.model(inputs.to(self._device)).float(), dim=-1)
            for j, i in enumerate(chunk):
                continuation = requests[i][2]
                end = len(rows[j])
                scores = logprobs[j, end - len(continuation) : end]
                target = torch.tensor(continuation, device=self._device)
                answer = (float(scores.gather(-1, target[:, None]).sum()), bool((scores.argmax(-1) == target).all()))
                results[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts, in disjoint windows of max_length tokens (as lm_eval's own models do)."""
        results = []
        for request in tqdm(requests, disable=disable_tqdm, desc="meshloom loglikelihood_rolling"):
            (text,) = request.args
            windows = [
                (None, *make_disjoint_window(w))
                for w in get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1)
            ]
            total = sum(score for score, _ in self._loglikelihood_tokens(windows, disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            results.append(total)
        return results

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        eos_text = self.tok_decode([self.eot_token_id])
        outputs = []
        for request in tqdm(requests, disable=disable_tqdm, desc="meshloom generate_until"):
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_new = kwargs.pop("max_gen_toks")
            if max_new >= self.max_length:
                raise UserError(f"gen_kwargs max_gen_toks={max_new} must be less than the model's max_length {self.max_length}")
            sampling = SamplingSettings(
                float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
                int(kwargs.get("top_k") or 0), float(kwargs.get("top_p") or 1.0), int(kwargs.get("seed", 1234)),
            ).check(GEN_KWARG_NAMES)  # fmt: skip
            prompt = self.tok_encode(context, left_truncate_len=self.max_length - max_new) or [self.prefix_token_id]

            def reached_stop(row: int, tokens: list[int]) -> bool:
                text = self.tok_decode(tokens)
                return any(stop in text for stop in until)

            result = generate(self.model, [prompt], max_new, sampling, [self.eot_token_id], should_stop=reached_stop)
            text = postprocess_generated_text(self.tok_decode(result.tokens[0]), until, None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            outputs.append(text)
        return outputs
