"""One rule: no forward asks about the device. Device type, capability, dtype support, the autocast state and library
versions are decided by the run's kernel plan before any process group (meshloom/planning/kernels.py) and reach the
modules as plain values. A query inside a forward breaks torch.compile's guards on CUDA (gpt-oss's capability query did,
on the first GPU) and hides the choice from the plan.

Two checks: every source file whose code runs inside a forward (every model file, and the cores the parallelize driver
swaps in) is read for such queries; and every family's tiny model trains a step in bf16 autocast, through the same
build as the trainer, with each query patched to fail."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

from meshloom.config.loader import load_config
from meshloom.planning.run_plan import RunPlan
from meshloom.train.model_setup import build_model

ROOT = Path(__file__).resolve().parents[1] / "meshloom"
# Code that runs inside a forward: the models, and the cores and dispatches parallel/apply.py installs in them.
# models/registry.py finds family plugins by import, at start-up only.
FORWARD_SOURCES = sorted(
    [path for path in (ROOT / "models").rglob("*.py") if path.name != "registry.py"]
    + [ROOT / "parallel" / name for name in (
        "context.py", "ring_blocks.py", "state_passing.py", "expert_parallel.py", "moe_tensor.py",
        "sequence_layout.py", "sequence_shift.py",
    )]
)  # fmt: skip
# Attribute calls that ask the device, the autocast state or a library.
QUERIES = {
    "get_device_capability", "is_available", "get_device_name", "get_device_properties", "is_autocast_enabled",
    "get_autocast_dtype", "get_autocast_gpu_dtype", "device_count", "current_device", "is_bf16_supported",
    "find_spec", "import_module",
}


def _queries(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT.parent)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute):
            if node.attr in QUERIES:
                found.append(f"{where} .{node.attr}")
            elif node.attr == "cuda" and isinstance(node.value, ast.Name) and node.value.id == "torch":
                found.append(f"{where} torch.cuda")
            elif node.attr in ("__version__", "version") and isinstance(node.value, ast.Name) and node.value.id == "torch":
                found.append(f"{where} torch.{node.attr}")
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "type":
            # `x.device.type == "cuda"`: a branch on the device inside a forward
            value = node.left.value
            if (isinstance(value, ast.Attribute) and value.attr == "device") or (isinstance(value, ast.Name) and value.id == "device"):
                found.append(f"{where} device.type comparison")
        elif isinstance(node, ast.FunctionDef):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)) and any(
                    alias.name.split(".")[0] in ("fla", "triton", "torchao", "tilelang")
                    for alias in inner.names
                ) | (isinstance(inner, ast.ImportFrom) and (inner.module or "").split(".")[0] in ("fla", "triton", "torchao")):
                    found.append(f"{where} import of an optional kernel library inside {node.name}")
    return found


def test_no_source_that_runs_in_a_forward_asks_the_device():
    assert len(FORWARD_SOURCES) > 40, "the walk must cover every model file"
    found = [query for path in FORWARD_SOURCES for query in _queries(path)]
    assert found == [], "\n".join(found)


def test_the_walk_sees_the_queries_it_forbids(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torch\n"
        "def forward(x):\n"
        "    if torch.cuda.get_device_capability(0) >= (9, 0) and torch.is_autocast_enabled('cuda'):\n"
        "        import fla.ops\n"
        "    return x.device.type == 'cuda'\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path / "x"
    try:
        found = _queries(probe)
    finally:
        ROOT = saved
    kinds = sorted({entry.split(" ", 1)[1] for entry in found})
    assert kinds == [".get_device_capability", ".is_autocast_enabled", "device.type comparison",
                     "import of an optional kernel library inside forward", "torch.cuda"]  # fmt: skip


FAMILIES = [
    ("llama3", "tiny"), ("qwen3", "tiny_moe"), ("deepseek_v3", "tiny"), ("gpt_oss", "tiny"), ("qwen3_next", "tiny"),
]


def _refusing(original):
    """`original`, failing when meshloom's own code calls it (torch's autocast context asks the state itself)."""

    def call(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if str(ROOT) in caller:
            raise AssertionError(f"a forward asked the device or the autocast state: {original.__name__} from {caller}")
        return original(*args, **kwargs)

    return call


def test_every_family_trains_in_bf16_autocast_without_asking_the_device(monkeypatch):
    """The trainer's build (RunPlan, kernel plan, parallelize), then forward and backward under bf16 autocast with every
    query patched to fail: the MoE path (grouped_mm = auto) included. Today's code asked the autocast state."""
    for name, flavor in FAMILIES:
        config = load_config(["--model.name", name, "--model.flavor", flavor, "--data.vocab_size", "512",
                              "--training.mixed_precision", "bf16", "--training.seq_len", "32"])  # fmt: skip
        plan = RunPlan.build(config, 1, torch.device("cpu"))
        torch.manual_seed(0)
        model = build_model(plan, torch.device("cpu"))
        tokens = torch.randint(0, 512, (2, 32))
        with torch.autocast("cpu", dtype=torch.bfloat16), monkeypatch.context() as patch:
            # Patched inside the autocast region: entering it asks the autocast state itself.
            for module, attr in (
                (torch.cuda, "get_device_capability"), (torch.cuda, "is_available"), (torch, "is_autocast_enabled"),
                (torch, "get_autocast_dtype"), (torch.cuda, "get_device_name"),
            ):  # fmt: skip
                patch.setattr(module, attr, _refusing(getattr(module, attr)))
            out = model(tokens)
            logits = out if isinstance(out, torch.Tensor) else out[0]
            logits.float().logsumexp(-1).mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        # Every block's parameters got a finite gradient (modules outside the plain forward, e.g. MTP heads, may not).
        assert any(".experts." in n or "layers.0." in n for n in grads) and all(torch.isfinite(g).all() for g in grads.values()), name
