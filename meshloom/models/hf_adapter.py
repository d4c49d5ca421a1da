"""The Hugging Face side of a model family: config.json <-> args, and meshloom tensors <-> Hugging Face tensors.

`meshloom.checkpoint.hf` reads and writes the folders (safetensors only, lazily, shard by shard); an adapter
only says what goes where. One meshloom tensor may be several Hugging Face tensors (a 3-D stack of experts is
one 2-D tensor per expert there), so the mapping is one-to-many: `to_hf` splits a tensor, `sources` names what a
tensor is built from and `from_hf` builds it.

`NameMapAdapter` covers the usual case: names from two tables (top-level, and per block with the block index
substituted), an optional per-tensor transform each way, and per-expert splitting of 3-D stacks.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from meshloom.config.errors import UserError


Transform = Callable[[torch.Tensor, Any], torch.Tensor]


class HFConfigError(UserError):
    """A Hugging Face config.json that meshloom cannot represent."""


def require_hf_keys(config: Mapping[str, Any], required: tuple[str, ...], family: str, where: str) -> None:
    """HFConfigError naming the keys of `required` that a `family` config.json lacks."""
    missing = [key for key in required if key not in config]
    if missing:
        raise HFConfigError(f"{where}: missing {missing}; a {family} config.json needs {list(required)}")


def refuse_unsupported_hf_values(unsupported: Mapping[str, tuple[Any, Any]], family: str, where: str) -> None:
    """HFConfigError for the first key whose (value, the only value meshloom's `family` computes) differ."""
    for key, (value, wanted) in unsupported.items():
        if value != wanted:
            raise HFConfigError(f"{where}: {key}={value!r} is not supported; meshloom's {family} needs {key}={wanted!r}")


class HFAdapter(ABC):
    # Class names in config.json's "architectures" that this family reads, and its "model_type".
    architectures: tuple[str, ...]
    model_type: str
    # Buffers some exports carry that are derived from the config, never trained (ignored on import).
    ignored_suffixes: tuple[str, ...] = (".rotary_emb.inv_freq",)
    # Modules of released checkpoints that transformers leaves out as well (ignored on import).
    ignored_prefixes: tuple[str, ...] = ()

    def claims(self, config: Mapping[str, Any]) -> bool:
        """Whether a config.json describes a model of this family."""
        return config.get("model_type") == self.model_type or bool(set(config.get("architectures") or ()) & set(self.architectures))

    @abstractmethod
    def args_from_config(self, config: Mapping[str, Any], where: str = "config.json") -> Any:
        """The family's args for a config.json; anything meshloom would compute differently is an HFConfigError."""

    @abstractmethod
    def config_from_args(self, args: Any, dtype: torch.dtype, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A transformers-readable config.json. `base` (e.g. the imported config) supplies fields that do not shape
        the network, such as token ids; every field that does is written from args."""

    @abstractmethod
    def shape_differences(self, wanted: Any, found: Any) -> list[str]:
        """Settings in which `found` computes something other than `wanted` ("name: found vs wanted")."""

    @abstractmethod
    def exported_names(self, names: list[str], args: Any) -> list[str]:
        """The meshloom tensors an export holds (a tied output is the embedding, stored once; training-only
        tensors such as multi-token-prediction heads are left out)."""

    @abstractmethod
    def to_hf(self, name: str, tensor: torch.Tensor, args: Any) -> list[tuple[str, torch.Tensor]]:
        """Hugging Face (name, tensor) pairs holding meshloom tensor `name`."""

    @abstractmethod
    def sources(self, name: str, args: Any) -> list[str]:
        """The Hugging Face tensors meshloom tensor `name` is built from."""

    @abstractmethod
    def from_hf(self, name: str, tensors: list[torch.Tensor], args: Any) -> torch.Tensor:
        """Meshloom tensor `name` from its `sources`, in that order."""

    def hf_tensors(self, state: Mapping[str, torch.Tensor], args: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """Every Hugging Face (name, tensor) of an export: each exported tensor's `to_hf`. A family whose Hugging Face
        tensors fuse several of its own (one projection for q, k, v) overrides this to build them from the parts."""
        for name in self.exported_names(list(state), args):
            yield from self.to_hf(name, state[name], args)

    def check_exportable(self, state: Mapping[str, torch.Tensor], args: Any) -> None:
        """Raise ValueError when the weights compute something the Hugging Face format cannot hold."""

    def optional_hf_tensors(self, args: Any) -> set[str]:
        """Hugging Face tensors an import may find and ignore (e.g. lm_head.weight beside a tied embedding)."""
        return set()


class NameMapAdapter(HFAdapter):
    """Adapter for families whose tensors map by name, block by block.

    top_level / per_block: meshloom name -> Hugging Face name; per-block names are relative to `layers.<i>.` and
    `hf_block_prefix.<i>.`. A name listed in `expert_stacks` is a 3-D [n_experts, ...] meshloom tensor whose
    Hugging Face name contains `{e}`, the expert index. to_hf_transforms / from_hf_transforms: per meshloom-name
    suffix, a function (tensor, args) -> tensor applied on the way out / in.
    """

    top_level: Mapping[str, str] = {}
    per_block: Mapping[str, str] = {}
    hf_block_prefix: str = "model.layers"
    expert_stacks: frozenset[str] = frozenset()
    to_hf_transforms: Mapping[str, Transform] = {}
    from_hf_transforms: Mapping[str, Transform] = {}
    # (output projection, embedding): with args.tie_embeddings the output is the embedding, exported once.
    tied_pair: tuple[str, str] | None = None

    _OURS_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")

    def _split(self, name: str) -> tuple[str | None, str]:
        match = self._OURS_BLOCK.fullmatch(name)
        return (match.group(1), match.group(2)) if match else (None, name)

    def hf_name(self, name: str) -> str:
        """The Hugging Face name (with `{e}` for an expert stack) of meshloom tensor `name`."""
        block, rest = self._split(name)
        if block is None and rest in self.top_level:
            return self.top_level[rest]
        if block is not None and rest in self.per_block:
            return f"{self.hf_block_prefix}.{block}.{self.per_block[rest]}"
        raise KeyError(f"no Hugging Face name for meshloom tensor {name!r}")

    def _tied(self, args: Any) -> tuple[str, str] | None:
        return self.tied_pair if self.tied_pair is not None and getattr(args, "tie_embeddings", False) else None

    def exported_names(self, names: list[str], args: Any) -> list[str]:
        tied = self._tied(args)
        return [n for n in names if tied is None or n != tied[0]]

    def optional_hf_tensors(self, args: Any) -> set[str]:
        tied = self._tied(args)
        return {self.hf_name(tied[0])} if tied else set()

    def _transform(self, table: Mapping[str, Transform], name: str, tensor: torch.Tensor, args: Any) -> torch.Tensor:
        for suffix, fn in table.items():
            if name.endswith(suffix):
                return fn(tensor, args)
        return tensor

    def _is_stack(self, name: str) -> bool:
        return self._split(name)[1] in self.expert_stacks

    def to_hf(self, name: str, tensor: torch.Tensor, args: Any) -> list[tuple[str, torch.Tensor]]:
        tensor = self._transform(self.to_hf_transforms, name, tensor, args)
        pattern = self.hf_name(name)
        if self._is_stack(name):
            return [(pattern.format(e=e), tensor[e]) for e in range(tensor.shape[0])]
        return [(pattern, tensor)]

    def sources(self, name: str, args: Any) -> list[str]:
        tied = self._tied(args)
        pattern = self.hf_name(tied[1] if tied and name == tied[0] else name)
        if self._is_stack(name):
            return [pattern.format(e=e) for e in range(self.num_experts(args))]
        return [pattern]

    def from_hf(self, name: str, tensors: list[torch.Tensor], args: Any) -> torch.Tensor:
        tensor = torch.stack(tensors) if self._is_stack(name) else tensors[0]
        return self._transform(self.from_hf_transforms, name, tensor, args)

    def num_experts(self, args: Any) -> int:
        """Routed experts per MoE block (families with expert stacks override this)."""
        raise NotImplementedError(f"{type(self).__name__} lists expert stacks but does not say how many experts")


class UnexportedBalancingBias(NameMapAdapter):
    """A mixture-of-experts family whose Hugging Face format has no place for the aux-loss-free balancing bias: the
    bias is not exported, an import starts it at zero, and exporting a model that trained one is refused with the
    family's own line (`bias_refusal`), since transformers would route its tokens to other experts."""

    balancing_bias = "moe.expert_bias"

    def bias_refusal(self, biased_layers: int, first: str) -> str:
        raise NotImplementedError(f"{type(self).__name__} does not say why its balancing bias cannot be exported")

    def exported_names(self, names: list[str], args: Any) -> list[str]:
        return [n for n in super().exported_names(names, args) if not n.endswith(self.balancing_bias)]

    def sources(self, name: str, args: Any) -> list[str]:
        return [] if name.endswith(self.balancing_bias) else super().sources(name, args)

    def from_hf(self, name: str, tensors: list[torch.Tensor], args: Any) -> torch.Tensor:
        if name.endswith(self.balancing_bias):
            return torch.zeros(args.moe.n_experts)
        return super().from_hf(name, tensors, args)

    def check_exportable(self, state: Mapping[str, torch.Tensor], args: Any) -> None:
        biased = [n for n, tensor in state.items() if n.endswith(self.balancing_bias) and bool(tensor.count_nonzero())]
        if biased:
            raise UserError(self.bias_refusal(len(biased), biased[0]))
