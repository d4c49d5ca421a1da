"""What one transformer block keeps for backward, asked of torch itself: the family's block, cut out of its model as a
one-block pipeline stage (`carve_stage`), built on fake tensors on CPU (shapes only: no memory, no process group)
and run once on a batch of one sequence, with the run's activation checkpointing and Float8 applied as the trainer
applies them.

- `compiled_block_saved`: under torch.compile, what a block saves is what AOTAutograd's min-cut rematerialization
  partitioner (`torch._functorch.partitioners.min_cut_rematerialization_partition`, the partition inductor runs)
  puts between the forward and the backward graph: it fuses the norms, the SwiGLU and RoPE and recomputes them in
  backward. The saved values are the backward graph's inputs other than its tangents.
- `eager_block_saved`: without compile, the tensors autograd packs for backward (`saved_tensors_hooks`), one per
  storage, the block's own parameters and buffers left out. The shape models count these by hand for the compute
  dtype the blocks see under FSDP; this trace gives what differs from that, e.g. under autocast without FSDP, where
  the residual stream stays fp32 (the embedding's output) and each linear keeps its own bf16 cast of its input.

Each result separates what grows with the tokens (`per_token`) from what does not (`weights`: copies of the block's
weights saved for backward, such as autocast's bf16 casts). Traces take seconds (a Float8 block under compile tens of
seconds), so each is cached per (family, model args, block, mode, dtypes, Float8 recipe, sequence length).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from dataclasses import dataclass

import torch
from torch import nn

from meshloom.config.errors import UserError

# How a block's weights and inputs are typed (`compute_kind`): "fp32"; "bf16": FSDP's MixedPrecisionPolicy hands the
# blocks bf16 weights and the embedding's output is bf16; "autocast": fp32 weights and an fp32 residual stream with
# autocast casting each op's inputs (bf16 without FSDP).
COMPUTE_KINDS = ("fp32", "bf16", "autocast")
# aten ops whose output shares its input's storage: a saved view of a saved tensor is no memory of its own.
_VIEW_OPS = {"view", "_unsafe_view", "reshape", "transpose", "t", "unsqueeze", "squeeze", "permute", "expand", "slice",
             "select", "alias", "detach", "as_strided", "split", "unbind"}  # fmt: skip


@dataclass(frozen=True)
class SavedBytes:
    """What one block keeps for backward: bytes per token of its input, and bytes that do not grow with the tokens."""

    per_token: float
    weights: int


def compute_kind(mixed_precision: str, sharded_data_parallel: bool) -> str:
    """The dtypes a block runs in: FSDP's bf16 weights, autocast over fp32 weights without it, or fp32."""
    if mixed_precision != "bf16":
        return "fp32"
    return "bf16" if sharded_data_parallel else "autocast"


def _spec_of(args):
    from meshloom.models.registry import MODEL_REGISTRY

    for spec in MODEL_REGISTRY.values():
        if isinstance(args, spec.args_cls):
            return spec
    raise UserError(f"no registered model family has arguments of type {type(args).__name__}")


def _up_to(args, layer: int):
    """`args` with the blocks after `layer` cut off (building a 61-block model only to keep one of them takes seconds),
    where the family's arguments allow it (not, e.g., DeepSeek-V3's below its dense blocks); else `args`."""
    try:
        return dataclasses.replace(args, n_layers=layer + 1) if layer + 1 < args.n_layers else args
    except (TypeError, ValueError):  # the family's own check of its arguments (ConfigError and UserError among them)
        return args


def _one_block_stage(args, layer: int, kind: str, ac: str, float8: str | None) -> tuple[nn.Module, nn.Module]:
    """A meta-device model cut down to block `layer` (no embedding, no head), with Float8 and checkpointing applied in
    the trainer's order (meshloom.parallel.apply.parallelize), its weights in the dtype `kind` gives them."""
    from meshloom.config.schema import ActivationCheckpointConfig, Float8Config
    from meshloom.parallel.activation_checkpoint import apply_activation_checkpointing
    from meshloom.parallel.apply import apply_kernel_plan, carve_stage
    from meshloom.planning.kernels import KernelPlan
    from meshloom.parallel.float8 import convert_to_float8

    spec = _spec_of(args)
    with torch.device("meta"):
        model = spec.model_cls(_up_to(args, layer))
    carve_stage(model, spec.parallel, [layer], first=False, last=False)
    # The routed experts as a GPU run plans them (meshloom/planning/kernels.py): one grouped matmul per weight, which
    # traces on fake tensors (the per-expert loop splits by data-dependent counts), cast to bf16 under autocast; the
    # eager FlexAttention operator, which runs a backward on CPU where the trace is made.
    plan = KernelPlan(grouped_mm=True, expert_dtype=torch.bfloat16 if kind == "autocast" else None, flex_eager_operator=True)
    apply_kernel_plan(model, spec.parallel, plan)
    if float8 is not None:
        convert_to_float8(model, Float8Config(enable=True, recipe=float8), fsdp=False, tp=1)
    if kind == "bf16":
        # FSDP's param_dtype casts the parameters, not the buffers (RoPE tables stay fp32).
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None:
                    module._parameters[name] = nn.Parameter(param.to(torch.bfloat16))
    blocks = nn.ModuleDict(dict(spec.parallel.blocks(model)))
    apply_activation_checkpointing(blocks, ActivationCheckpointConfig(mode=ac))
    return model, blocks[str(layer)]


def _run_on_fake(model: nn.Module, dim: int, tokens: int, kind: str, pack=None) -> set[int]:
    """One forward of the one-block stage on fake CPU tensors; returns the storages of its parameters and buffers."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model.to_empty(device="cpu")
        own = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
        dtype = torch.bfloat16 if kind == "bf16" else torch.float32
        x = torch.empty(1, tokens, dim, dtype=dtype, requires_grad=True)
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if pack else _nothing()
        with hooks, torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "autocast"):
            model(x)
    return own


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@contextlib.contextmanager
def _quiet_torch():
    """Dynamo's advice for running code (e.g. on context_fn under checkpointing) is no news to a trace: keep it out
    of the dry run's report."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _eager_total(args, layer: int, ac: str, kind: str, float8: str | None, tokens: int) -> int:
    stored: dict[int, int] = {}
    own: set[int] = set()

    def pack(tensor):
        storage = tensor.untyped_storage()
        stored[storage._cdata] = storage.nbytes()
        return tensor

    model, _ = _one_block_stage(args, layer, kind, ac, float8)
    own = _run_on_fake(model, args.dim, tokens, kind, pack)
    return sum(size for key, size in stored.items() if key not in own)


# The two sequence lengths an eager block is run at: what autograd saves in eager mode is a fixed set of tensors for
# any length, each growing with the tokens (or the square of them, for attention without a fused kernel, which
# autocast's fp32 residual stream does not change), so two lengths separate it from the weights' casts.
EAGER_TOKENS = (256, 512)


@functools.lru_cache(maxsize=1024)
def _eager_cached(key: tuple, args_holder: _Args) -> SavedBytes:
    layer, ac, kind, float8 = key[2:]
    short, long = (min(tokens, args_holder.args.max_seq_len // (2 - i)) for i, tokens in enumerate(EAGER_TOKENS))
    small = _eager_total(args_holder.args, layer, ac, kind, float8, short)
    full = _eager_total(args_holder.args, layer, ac, kind, float8, long)
    per_token = (full - small) / (long - short)
    return SavedBytes(per_token, int(full - per_token * long))


class _Args:
    """A family's model arguments as a cache key (their dataclasses are not hashable): equal by their repr."""

    # id(args) -> (args, its repr): a search estimates the same args object millions of times, and its repr was a
    # quarter of the search's time. The args object is kept, so its id is not reused; args are never edited in place.
    _keys: dict[int, tuple[object, str]] = {}

    def __init__(self, args):
        known = _Args._keys.get(id(args))
        if known is None or known[0] is not args:
            known = _Args._keys[id(args)] = (args, repr(args))
        self.args, self.key = args, known[1]

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Args) and other.key == self.key


def eager_block_saved(args, layer: int, ac: str, kind: str, float8: str | None) -> SavedBytes:
    """What block `layer` of the model `args` describes keeps for backward in eager mode (checkpointing mode `ac`, dtypes
    `kind`, Float8 recipe or None), per token (at EAGER_TOKENS). Under checkpointing the block's own hooks hold its
    tensors, which are not seen here: use it for ac "none"."""
    holder = _Args(args)
    return _eager_cached(("eager", holder.key, layer, ac, kind, float8), holder)


def _view_base(node):
    """The node whose storage a saved node shares: through view ops back to the op that made the memory."""
    while node.op == "call_function" and getattr(node.target, "__name__", "").split(".")[0] in _VIEW_OPS:
        node = node.args[0]
    return node


def _saved_by_partitioner(args, layer: int, ac: str, kind: str, float8: str | None, tokens: int) -> SavedBytes:
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs = []

    def partition(joint, joint_inputs, **kwargs):
        forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kwargs)
        graphs.append((forward, backward))
        return forward, backward

    backend = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm, partition_fn=partition)
    model, block = _one_block_stage(args, layer, kind, ac, float8)
    # As meshloom.parallel.compile.apply_compile: the block's forward, whole (fullgraph), after checkpointing wrapped it.
    block.forward = torch.compile(block.forward, backend=backend, fullgraph=True)
    torch._dynamo.reset()
    try:
        with _quiet_torch():
            _run_on_fake(model, args.dim, tokens, kind)
    finally:
        torch._dynamo.reset()
    (forward, backward), = graphs
    nodes = {node.name: node for node in forward.graph.nodes}
    # The block's hidden-state input is the one graph input of its shape; what depends on it grows with the tokens.
    hidden = [n for n in forward.graph.find_nodes(op="placeholder") if tuple(n.meta["val"].shape) == (1, tokens, args.dim)]
    depends = set(hidden)
    for node in forward.graph.nodes:
        if any(parent in depends for parent in node.all_input_nodes):
            depends.add(node)
    per_token, weights, bases = 0, 0, set()
    for saved in backward.graph.find_nodes(op="placeholder"):
        value = saved.meta.get("val")
        if saved.name.startswith("tangents") or not isinstance(value, torch.Tensor):
            continue
        if saved.name not in nodes:  # the random-number generator's state a checkpointed region replays: bytes
            continue
        base = _view_base(nodes[saved.name])
        # Graph inputs other than the hidden state are the block's parameters and buffers, alive anyway.
        if base in bases or (base.op == "placeholder" and base not in hidden):
            continue
        bases.add(base)
        size = base.meta["val"].numel() * base.meta["val"].element_size()
        if base in depends:
            per_token += size
        else:
            weights += size
    return SavedBytes(per_token / tokens, weights)


@functools.lru_cache(maxsize=1024)
def _compiled_cached(key: tuple, args_holder: _Args) -> SavedBytes | None:
    """None where the partitioner cannot be asked on fake tensors: a block with data-dependent sizes (an MoE layer's
    token counts per expert, `aten._local_scalar_dense`) graph-breaks there, so the estimate counts it as eager."""
    try:
        return _saved_by_partitioner(args_holder.args, *key[2:])
    except UserError:
        raise
    except Exception as err:
        if "_local_scalar_dense" in str(err) or "data-dependent" in str(err).lower() or "DataDependent" in type(err).__name__:
            return None
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"compile.enable: the memory estimate traces a compiled block of {type(args_holder.args).__name__} on fake "
            f"tensors and torch refused it ({first}); set compile.enable = false to estimate the eager run"
        ) from err


def compiled_block_saved(args, layer: int, ac: str, kind: str, float8: str | None, tokens: int) -> SavedBytes | None:
    """What block `layer` of the model `args` describes saves for backward under torch.compile (checkpointing mode
    `ac`, dtypes `kind`, Float8 recipe or None), for a sequence of `tokens`; None where its sizes depend on the data
    (see _compiled_cached)."""
    if kind not in COMPUTE_KINDS:
        raise ValueError(kind)
    holder = _Args(args)
    return _compiled_cached(("compiled", holder.key, layer, ac, kind, float8, tokens), holder)


@dataclass(frozen=True)
class LossSaved:
    """What the compiled loss keeps for backward besides its input, whether it keeps the input, and how many
    vocabulary-wide gradients its backward graph returns."""

    per_token: float
    keeps_input: bool
    grads: int


@functools.lru_cache(maxsize=256)
def compiled_loss_saved(vocab: int, tokens: int) -> LossSaved:
    """meshloom.train.loss.cross_entropy_loss compiled (as build_loss_fn does) on fp32 logits of one sequence of
    `tokens`, partitioned by AOTAutograd's min-cut partitioner on fake tensors."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._subclasses.fake_tensor import FakeTensorMode

    from meshloom.train.loss import cross_entropy_loss

    graphs = []

    def partition(joint, joint_inputs, **kwargs):
        graphs.append(min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kwargs))
        return graphs[-1]

    backend = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm, partition_fn=partition)
    torch._dynamo.reset()
    try:
        with FakeTensorMode():
            logits = torch.empty(1, tokens, vocab, requires_grad=True)
            labels = torch.zeros(1, tokens, dtype=torch.long)
            torch.compile(cross_entropy_loss, backend=backend, fullgraph=True)(logits, labels)
    finally:
        torch._dynamo.reset()
    (forward, backward), = graphs
    nodes = {node.name: node for node in forward.graph.nodes}
    extra, keeps_input, bases = 0, False, set()
    for saved in backward.graph.find_nodes(op="placeholder"):
        value = saved.meta.get("val")
        if saved.name.startswith("tangents") or not isinstance(value, torch.Tensor):
            continue
        base = _view_base(nodes[saved.name])
        if base in bases:
            continue
        bases.add(base)
        if base.op == "placeholder":
            keeps_input = keeps_input or tuple(base.meta["val"].shape) == (1, tokens, vocab)
            continue
        extra += base.meta["val"].numel() * base.meta["val"].element_size()
    outputs = backward.graph.find_nodes(op="output")[0].args[0]
    wide = [o for o in outputs if o is not None and o.meta["val"].numel() == tokens * vocab]
    return LossSaved(extra / tokens, keeps_input, len(wide))
