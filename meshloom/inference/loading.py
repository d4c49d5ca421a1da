"""Weights and tokenizer for inference from a run folder, a checkpoint step folder or a Hugging Face folder.

* run folder: its config.json (the run's settings) and the latest complete checkpoint under checkpoint.folder;
* checkpoint: a step-N folder (or a checkpoint root: its latest complete step), with model_args.json and, when
  written by a run, the run's config.json;
* Hugging Face folder: config.json + safetensors (+ tokenizer.json when present).

The tokenizer of a run comes from its `[data]` settings: `data.tokenizer` as a tokenizer.json or tiktoken file,
or `builtin`, the BPE the run trained on its corpus and cached under `data.cache_dir` (found again by the
corpus' identity, never retrained here).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from meshloom.checkpoint import folders
from meshloom.checkpoint.hf import INDEX_FILE, WEIGHTS_FILE, HFFolder, from_hf
from meshloom.config.errors import UserError
from meshloom.config.schema import Config, DataConfig
from meshloom.models.spec import ModelSpec

if TYPE_CHECKING:
    from meshloom.planning.run_plan import RunPlan

HF_TOKENIZER_FILE = "tokenizer.json"


@dataclass
class InferenceSource:
    """What a path holds, resolved without reading weights."""

    kind: str  # "run", "checkpoint" or "hf"
    path: Path
    checkpoint: folders.CheckpointInfo | None = None
    hf: HFFolder | None = None
    run_config: dict[str, Any] | None = None  # the run's settings (config.json of the run or checkpoint)

    def describe(self) -> str:
        if self.checkpoint is not None:
            return f"{self.kind} {self.path} (step {self.checkpoint.step} at {self.checkpoint.path})"
        return f"{self.kind} {self.path}"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"{path} is unreadable: {err}") from None


def _is_run_config(config: dict[str, Any]) -> bool:
    return isinstance(config.get("job"), dict) and isinstance(config.get("model"), dict)


def parse_device(name: str | None, setting: str) -> torch.device:
    """auto (CUDA when present), cpu or cuda[:N] as a device; UserError naming `setting` when this torch cannot use it."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"{setting} {name!r} is not a device; use auto, cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"{setting} {name!r} is not supported; use auto, cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "has no CUDA support" if torch.version.cuda is None else "sees no GPU"
        raise UserError(f"{setting} {name}: this torch ({torch.__version__}) {why}; use cpu (or auto)")
    return device


def resolve(path: str | Path) -> InferenceSource:
    """Classify RUN_DIR | CHECKPOINT | HF_FOLDER; ValueError naming what is missing."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path} not found; give a run folder, a checkpoint (step-N folder) or a Hugging Face model folder")
    config_file = path / folders.CONFIG_FILE
    config = _read_json(config_file) if config_file.is_file() else None
    if config is not None and not _is_run_config(config) and ((path / WEIGHTS_FILE).is_file() or (path / INDEX_FILE).is_file()):
        return InferenceSource("hf", path, hf=HFFolder(path))
    if folders.is_complete(path) or (path / folders.MODEL_ARGS_FILE).is_file():
        info = folders.open_checkpoint(path)
        return InferenceSource("checkpoint", path, checkpoint=info, run_config=config)
    if config is not None and _is_run_config(config):
        from meshloom.checkpoint.dcp import checkpoint_root  # noqa: PLC0415 (heavy import only when needed)

        root = checkpoint_root(_config_of(config), path)
        complete, _ = folders.list_checkpoints(root)
        if not complete:
            raise UserError(
                f"run folder {path} holds no complete checkpoint under {root}{folders.describe_without_complete(root)}; "
                "train with --checkpoint.enable true (and checkpoint.interval), or point at a checkpoint or Hugging Face folder"
            )
        return InferenceSource("run", path, checkpoint=complete[-1], run_config=config)
    if (path / "step-0").exists() or folders.list_checkpoints(path)[0]:
        info = folders.open_checkpoint(path)
        return InferenceSource("checkpoint", path, checkpoint=info, run_config=_checkpoint_run_config(info))
    raise UserError(
        f"{path} is neither a run folder (config.json of a run + checkpoints), a checkpoint (step-N folder with "
        f"{folders.MARKER_FILE}) nor a Hugging Face model folder (config.json + {WEIGHTS_FILE} or {INDEX_FILE})"
    )


def _checkpoint_run_config(info: folders.CheckpointInfo) -> dict[str, Any] | None:
    file = info.path / folders.CONFIG_FILE
    return _read_json(file) if file.is_file() else None


def _config_of(values: dict[str, Any]) -> Config:
    """A Config from a saved config.json; unknown or missing keys (other versions) keep the defaults."""
    config = Config()
    for section in dataclasses.fields(config):
        saved = values.get(section.name)
        if not isinstance(saved, dict):
            continue
        current = getattr(config, section.name)
        known = {f.name for f in dataclasses.fields(current)}
        setattr(config, section.name, dataclasses.replace(current, **{k: v for k, v in saved.items() if k in known}))
    return config


def run_config(source: InferenceSource) -> Config | None:
    """The saved run settings of a run folder or checkpoint, if any."""
    values = source.run_config
    if values is None and source.checkpoint is not None:
        values = _checkpoint_run_config(source.checkpoint)
    return _config_of(values) if values is not None else None


def model_args(source: InferenceSource) -> tuple[ModelSpec, Any]:
    """The model family and shape, from model_args.json or the Hugging Face config.json."""
    if source.hf is not None:
        return source.hf.spec, source.hf.args
    from meshloom.checkpoint.offline import read_model_args  # noqa: PLC0415

    spec, args, _ = read_model_args(source.checkpoint)
    return spec, args


def inference_plan(source: InferenceSource, device: torch.device, tokenizer: str | None = None) -> RunPlan:
    """The RunPlan of one process running the source's model on `device`, with its checks: the run's model, training
    and data settings (defaults for a Hugging Face folder) and the tokenizer file it will read (`tokenizer`, else a
    Hugging Face folder's own); what only training uses (layout, compile, Float8, checkpoints, optimizer) stays at
    its defaults, since the whole model is loaded on one device."""
    from meshloom.planning.run_plan import RunPlan  # noqa: PLC0415

    spec, args = model_args(source)
    saved = run_config(source) or Config()
    if tokenizer is None and source.hf is not None:
        tokenizer = str(source.path / HF_TOKENIZER_FILE)
    data = saved.data if tokenizer is None else dataclasses.replace(saved.data, tokenizer=tokenizer)
    training = dataclasses.replace(saved.training, seq_len=min(saved.training.seq_len, args.max_seq_len), device=device.type)
    config = Config(model=dataclasses.replace(saved.model, name=spec.name), training=training, data=data)
    config.given = set()  # the run's own settings, none of them given here: none is refused as idle
    return RunPlan.build(config, 1, device, model_args=args)


def load_model(source: InferenceSource, device: torch.device, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The whole model on one device, in eval mode."""
    if source.hf is not None:
        return from_hf(source.path, dtype, device)
    from meshloom.checkpoint.offline import read_model_weights  # noqa: PLC0415

    spec, args = model_args(source)
    weights = read_model_weights(source.checkpoint)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device=device)
    model.init_weights()  # buffers such as RoPE tables; the weights are overwritten below
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise UserError(
            f"checkpoint {source.checkpoint.path} does not fit the model its {folders.MODEL_ARGS_FILE} describes: {err}"
        ) from None
    return model.to(dtype).eval()


def load_tokenizer(source: InferenceSource, override: str | None = None):
    """The tokenizer the model was trained with (or `override`, a tokenizer.json / tiktoken file)."""
    from meshloom.data.tokenizer import build_tokenizer  # noqa: PLC0415

    if override:
        if not Path(override).is_file():
            raise UserError(f"--tokenizer {override}: no such file; give a tokenizer.json or a tiktoken BPE file")
        return build_tokenizer(override, [], 0, Path("."))
    if source.hf is not None:
        return hf_folder_tokenizer(source.hf)
    config = run_config(source)
    if config is None:
        raise UserError(
            f"{source.describe()} has no run config.json, so its tokenizer is unknown; pass --tokenizer PATH "
            "(a tokenizer.json or tiktoken file)"
        )
    return data_tokenizer(config.data, source.describe())


def hf_folder_tokenizer(folder: HFFolder):
    """tokenizer.json of a Hugging Face folder; BOS/EOS ids from config.json when it names them."""
    from meshloom.data.tokenizer import HFTokenizer, build_tokenizer  # noqa: PLC0415

    file = folder.path / HF_TOKENIZER_FILE
    if not file.is_file():
        raise UserError(f"Hugging Face folder {folder.path} has no {HF_TOKENIZER_FILE}; pass --tokenizer PATH")
    bos, eos = folder.config.get("bos_token_id"), folder.config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    try:
        tokenizer = build_tokenizer(str(file), [], 0, folder.path)
    except ValueError:
        if not (isinstance(bos, int) and isinstance(eos, int)):
            raise
        import tokenizers  # noqa: PLC0415

        from meshloom.data.tokenizer import _digest  # noqa: PLC0415 (the identity `meshloom prepare` records)

        raw = file.read_bytes()
        return HFTokenizer(tokenizers.Tokenizer.from_str(raw.decode("utf-8")), bos, eos, identity=f"hf-json:{_digest(raw)[:20]}")
    if isinstance(bos, int) and isinstance(eos, int):  # config.json's ids win over names guessed from the vocabulary
        tokenizer.bos_id, tokenizer.eos_id = bos, eos
    return tokenizer


def data_tokenizer(data: DataConfig, where: str):
    """A run's tokenizer from its [data] settings, without training one."""
    from meshloom.data.build import cache_dir  # noqa: PLC0415
    from meshloom.data.builtin_corpus import load_documents, split_documents  # noqa: PLC0415
    from meshloom.data.tokenizer import build_tokenizer, hash_texts  # noqa: PLC0415

    if data.tokenizer != "builtin":
        if not Path(data.tokenizer).expanduser().is_file():
            raise UserError(
                f"{where}: its tokenizer, data.tokenizer = {data.tokenizer!r}, is not found; restore the file or pass "
                "--tokenizer PATH"
            )
        return build_tokenizer(data.tokenizer, [], data.vocab_size, cache_dir(data))
    try:
        docs = load_documents(data.path or None, data.glob, data.max_bytes or None)
    except UserError as err:
        raise UserError(f"{where}: the built-in tokenizer is found by the corpus it was trained on, and {err}") from None
    train_docs, _ = split_documents(docs, data.validation_fraction)
    texts = [text for _, text in train_docs]

    def not_cached() -> list[str]:
        raise UserError(
            f"{where}: data.tokenizer = 'builtin' (vocab_size {data.vocab_size}) is not cached in data.cache_dir = "
            f"{cache_dir(data)} for this corpus (tokenizer-*.json there); restore that folder, or pass --tokenizer PATH"
        )

    return build_tokenizer("builtin", not_cached, data.vocab_size, cache_dir(data), texts_identity=hash_texts(texts))
