"""Hugging Face model folders (config.json + safetensors, single file or sharded with an index), in and out.

Only the `safetensors` package reads and writes weights, so nothing is ever unpickled. Which family a folder
holds, its config fields, tensor names and per-tensor transforms come from the family's `HFAdapter`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from meshloom.config.errors import UserError
from meshloom.models.hf_adapter import HFAdapter
from meshloom.models.registry import spec_for_hf_config
from meshloom.models.spec import ModelSpec

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a plain byte count."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?i?[bB]?)\s*", text)
    if not match:
        raise UserError(f"cannot read size {text!r}; write e.g. 5GB, 500MB or a byte count")
    number, unit = float(match.group(1)), match.group(2).upper().rstrip("B")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(number * scale)


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; choose bfloat16 or float32")
    return DTYPES[name]


class HFFolder:
    """A Hugging Face model folder, checked on opening: config (and so the model family), weight files and the
    index's shard list."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise UserError(f"Hugging Face model folder {self.path} not found")
        config_path = self.path / CONFIG_FILE
        if not config_path.is_file():
            raise UserError(f"{self.path} has no {CONFIG_FILE}; a Hugging Face model folder needs one next to its weights")
        try:
            self.config: dict[str, Any] = json.loads(config_path.read_text())
        except json.JSONDecodeError as err:
            raise UserError(f"{config_path} is not valid JSON: {err}") from None
        self.spec: ModelSpec = spec_for_hf_config(self.config, str(config_path))
        self.adapter: HFAdapter = self.spec.hf
        self.args = self.adapter.args_from_config(self.config, str(config_path))
        self.weight_map = self._weight_map()

    def _weight_map(self) -> dict[str, Path]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise UserError(f"{index} is not a safetensors index (needs a 'weight_map'): {err}") from None
            files = {name: self.path / file for name, file in weight_map.items()}
            for file in sorted(set(files.values())):
                if not file.is_file():
                    raise UserError(f"shard file {file.name} listed in {index} is missing; download or copy it into {self.path}")
            return files
        single = self.path / WEIGHTS_FILE
        if single.is_file():
            with safe_open(single, framework="pt") as f:
                return {name: single for name in f.keys()}
        other = sorted(p.name for p in self.path.glob("*.bin")) + sorted(p.name for p in self.path.glob("*.pt*"))
        hint = f" (found {other[:3]}: pickled weights are never loaded; re-save them with safetensors)" if other else ""
        raise UserError(f"{self.path} has neither {WEIGHTS_FILE} nor {INDEX_FILE}{hint}")

    def expected_shapes(self) -> dict[str, torch.Size]:
        """meshloom name -> shape for every tensor the config implies (a tied output is the embedding)."""
        with torch.device("meta"):
            model = self.spec.model_cls(self.args)
        return {name: t.shape for name, t in model.state_dict().items()}

    def check(self) -> None:
        """Every needed tensor present with the right shape; nothing unknown. Reads headers only."""
        shapes = self.expected_shapes()
        ours = self.adapter.exported_names(list(shapes), self.args)
        needed = {hf_name: name for name in ours for hf_name in self.adapter.sources(name, self.args)}
        for hf_name in needed:
            if hf_name not in self.weight_map:
                raise UserError(f"{self.path} lacks tensor {hf_name!r}, which its config.json implies")
        optional = self.adapter.optional_hf_tensors(self.args)
        for hf_name in self.weight_map:
            ignored = hf_name.endswith(self.adapter.ignored_suffixes) or hf_name.startswith(self.adapter.ignored_prefixes)
            if hf_name not in needed and hf_name not in optional and not ignored:
                raise UserError(
                    f"{self.path} holds tensor {hf_name!r}, which a {self.spec.name} model with this config.json does not have"
                )
        with ExitStack() as stack:
            handles = {f: stack.enter_context(safe_open(f, framework="pt")) for f in set(self.weight_map.values())}
            for name in ours:
                sources = self.adapter.sources(name, self.args)
                found = [torch.empty(handles[self.weight_map[h]].get_slice(h).get_shape(), device="meta") for h in sources]
                shape = tuple(self.adapter.from_hf(name, found, self.args).shape)
                if shape != tuple(shapes[name]):
                    what = f"tensor {sources[0]!r}" if len(sources) == 1 else f"tensors {sources[0]!r} .. {sources[-1]!r} (stacked)"
                    raise UserError(f"{what} in {self.path} has shape {list(shape)}, but config.json implies {list(shapes[name])}")

    def tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(meshloom name, tensor) for the given meshloom names, read lazily file by file."""
        with ExitStack() as stack:
            handles: dict[Path, Any] = {}
            for name in names:
                tensors = []
                for hf_name in self.adapter.sources(name, self.args):
                    file = self.weight_map[hf_name]
                    if file not in handles:
                        handles[file] = stack.enter_context(safe_open(file, framework="pt"))
                    tensors.append(handles[file].get_tensor(hf_name))
                yield name, self.adapter.from_hf(name, tensors, self.args)


def _layer_groups(names: list[str]) -> list[list[str]]:
    """Names grouped per transformer block (others alone), so at most one block is materialised at a time."""
    groups: dict[str, list[str]] = {}
    for name in names:
        key = ".".join(name.split(".")[:2]) if name.startswith("layers.") else name
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _has_hf_name(folder: HFFolder, name: str) -> bool:
    """Whether the format holds meshloom tensor `name`: training-only modules (multi-token prediction) have no
    Hugging Face name and keep the values the run initialised them with."""
    try:
        folder.adapter.sources(name, folder.args)
    except KeyError:
        return False
    return True


@torch.no_grad()
def load_into_model_parts(model_parts: list[nn.Module], folder: HFFolder) -> None:
    """Fill (possibly sharded) model parts with the weights of a checked folder; each rank reads full tensors
    lazily and keeps its own shard, so any layout gets the same weights."""
    for part in model_parts:
        template = get_model_state_dict(part)
        for group in _layer_groups([name for name in template if _has_hf_name(folder, name)]):
            full = {name: t.to(template[name].dtype) for name, t in folder.tensors(group)}
            set_model_state_dict(part, full, options=StateDictOptions(full_state_dict=True, strict=False))


def from_hf(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> nn.Module:
    """A ready meshloom model (eval mode) from a Hugging Face folder: `model(tokens)` gives logits."""
    folder = HFFolder(path)
    folder.check()
    with torch.device("meta"):
        model = folder.spec.model_cls(folder.args)
    model.to_empty(device=device)
    model.init_weights()  # RoPE tables; every parameter is overwritten below
    state = dict(folder.tensors(list(model.state_dict())))
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval()


def write_hf_folder(
    state: dict[str, torch.Tensor],
    spec: ModelSpec,
    args: Any,
    out: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    base_config: dict[str, Any] | None = None,
) -> Path:
    """config.json plus model.safetensors, or model-0000i-of-0000n.safetensors shards and their index."""
    if spec.hf is None:
        raise UserError(f"the {spec.name} model family has no Hugging Face format to export to")
    adapter = spec.hf
    adapter.check_exportable(state, args)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    for hf_name, tensor in adapter.hf_tensors(state, args):
        tensor = tensor.to(dtype).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and sizes[-1] + nbytes > max_shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][hf_name] = tensor
        sizes[-1] += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], out / WEIGHTS_FILE, metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, out / file, metadata=metadata)
            weight_map.update(dict.fromkeys(shard, file))
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (out / CONFIG_FILE).write_text(json.dumps(adapter.config_from_args(args, dtype, base_config), indent=2))
    return out
