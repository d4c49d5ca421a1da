"""`meshloom generate`: continue prompts with a trained model (run folder, checkpoint or Hugging Face folder)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from meshloom.cli.numbers import count, fraction, number, CommandParser
from meshloom.config.ranges import Range
from meshloom.output import check_output_file, write_output_file
from meshloom.config.errors import UserError
from meshloom.inference.sampling import SamplingSettings

DESCRIPTION = """Continue one prompt (streamed to the console) or a file of prompts (written as JSONL) with a trained
model: a run folder (its latest complete checkpoint and its tokenizer settings), a checkpoint step folder, or a
Hugging Face folder (config.json + safetensors + tokenizer.json). Greedy when --temperature is 0."""


# The range of each numeric option (meshloom/cli/numbers.py).
NUMBERS = {
    "--max-new-tokens": (int, Range(1)),
    "--temperature": (float, Range(0, note="0 = greedy")),
    "--top-k": (int, count("0 = no top-k cut")),
    "--top-p": (float, fraction("1 = no nucleus cut")),
    "--seed": (int, count()),  # torch's generators take up to 2**64 - 1; each batch adds its index
    "--batch-size": (int, Range(1)),
}


def parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="meshloom generate", description=DESCRIPTION)
    p.add_argument("source", type=Path, help="RUN_DIR | CHECKPOINT | HF_FOLDER")
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", help="one prompt; its tokens stream to the console")
    prompts.add_argument("--prompts", type=Path, help="a .jsonl file ({\"prompt\": ...} per line) or a text file (one prompt a line)")
    p.add_argument("--max-new-tokens", type=number(NUMBERS, "--max-new-tokens"), default=64)
    p.add_argument("--temperature", type=number(NUMBERS, "--temperature"), default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=number(NUMBERS, "--top-k"), default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=number(NUMBERS, "--top-p"), default=1.0, help="sample within the smallest set of tokens of this total probability")
    p.add_argument("--seed", type=number(NUMBERS, "--seed"), default=0, help="seed of the sampler (each batch of --prompts adds its index)")
    p.add_argument("--batch-size", type=number(NUMBERS, "--batch-size"), default=8, help="prompts decoded together (left-padded)")
    p.add_argument("--output", type=Path, default=None,
                   help="JSONL of the completions (default with --prompts: PROMPTS-generations.jsonl beside it; with --prompt: none)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json or tiktoken file instead of the source's own")
    p.add_argument("--no-bos", action="store_true", help="do not start prompts with the tokenizer's BOS token")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    return p


class TextStream:
    """Prints a growing token list as text, holding back an incomplete UTF-8 character."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out, self.ids, self.printed = tokenizer, out or sys.stdout, [], 0

    def add(self, token: int) -> None:
        self.ids.append(token)
        self._write(final=False)

    def finish(self) -> None:
        self._write(final=True)
        self.out.write("\n")

    def _write(self, final: bool) -> None:
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") and not final:
            return
        self.out.write(text[self.printed :])
        self.out.flush()
        self.printed = len(text)


def run(args: argparse.Namespace) -> int:
    from meshloom.checkpoint.hf import parse_dtype  # noqa: PLC0415
    from meshloom.inference import loading  # noqa: PLC0415
    from meshloom.inference.generate import check_prompts, generate, max_context  # noqa: PLC0415
    from meshloom.inference.prompts import read_prompts  # noqa: PLC0415

    settings = SamplingSettings(args.temperature, args.top_k, args.top_p, args.seed).check().check_cuts_apply()
    device, dtype = loading.parse_device(args.device, "--device"), parse_dtype(args.dtype)
    texts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts, "--prompts")
    output = args.output
    if output is None and args.prompts is not None:
        output = args.prompts.with_name(args.prompts.stem + "-generations.jsonl")
    if output is not None:  # before any heavy work: a bad path fails now, not after the generation
        inputs = (("the --prompts file", args.prompts),) if args.prompts is not None else ()
        inputs += (("the --tokenizer file", Path(args.tokenizer)),) if args.tokenizer else ()
        check_output_file(output, args.overwrite, inputs)
    source = loading.resolve(args.source)
    model_args = loading.inference_plan(source, device, args.tokenizer).model_args
    tokenizer = loading.load_tokenizer(source, args.tokenizer)
    bos = [] if args.no_bos else [tokenizer.bos_id]
    prompts = [bos + tokenizer.encode(text) for text in texts]
    check_prompts(prompts, args.max_new_tokens, model_args.max_seq_len)
    model = loading.load_model(source, device, dtype)
    assert max_context(model) == model_args.max_seq_len
    print(f"loaded {source.describe()} on {device}", file=sys.stderr)
    stop = [tokenizer.eos_id]
    if args.prompt is not None:
        stream = TextStream(tokenizer)
        sys.stdout.write(args.prompt)
        result = generate(model, prompts, args.max_new_tokens, settings, stop, on_tokens=lambda ids: int(ids[0]) in stop or stream.add(int(ids[0])))
        stream.finish()
        results = [result]
    else:
        results = []
        for start in range(0, len(prompts), args.batch_size):
            batch_settings = dataclasses.replace(settings, seed=settings.seed + start // args.batch_size)
            results.append(generate(model, prompts[start : start + args.batch_size], args.max_new_tokens, batch_settings, stop))
    if output is not None:
        lines = []
        for result in results:
            for i, tokens in enumerate(result.tokens):
                n = len(lines)
                record = {
                    "prompt": texts[n], "completion": tokenizer.decode(tokens), "prompt_tokens": len(prompts[n]),
                    "completion_tokens": len(tokens), "finish": "stop" if result.stopped[i] else "length",
                }  # fmt: skip
                lines.append(json.dumps(record, ensure_ascii=False) + "\n")
        write_output_file(output, "".join(lines), args.overwrite, inputs)
        print(f"wrote {len(lines)} completions to {output}", file=sys.stderr)
    _report(results)
    return 0


def _report(results: list) -> None:
    """Prefill (prompt) and decode throughput, measured apart; the first new token of each row comes from the prefill."""
    prompt = sum(r.prompt_tokens for r in results)
    prefill = sum(r.prefill_seconds for r in results)
    generated = sum(r.generated_tokens for r in results)
    decoded = generated - sum(len(r.tokens) for r in results)
    decode = sum(r.decode_seconds for r in results)
    print(
        f"prompt: {prompt} tokens, prefill {prefill:.3f} s ({prompt / max(prefill, 1e-9):,.1f} tok/s) | "
        f"generated: {generated} tokens, decode {decode:.3f} s ({decoded / max(decode, 1e-9):,.1f} tok/s)",
        file=sys.stderr,
    )


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except UserError as err:
        print(f"meshloom: error: {err}", file=sys.stderr)
        return 2
