"""Float8 training (torchao) on CPU: which layers convert, loss near bf16, FSDP float8 all-gather, bad dims."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from torch import nn

from meshloom.config.loader import ConfigError, load_config
from meshloom.models.llama3.flavors import LLAMA3_FLAVORS
from meshloom.models.llama3.model import Llama3Args, Transformer
from meshloom.parallel.float8 import FLOAT8_LOSS_BOUND_VS_BF16, float8_targets
from meshloom.testing.layout_parity import base_overrides
from meshloom.train.trainer import Trainer


def _losses(trainer: Trainer, steps: int) -> list[float]:
    return [trainer.train_step().loss for _ in range(steps)]


def test_float8_recipes_convert_the_blocks_and_train_close_to_bf16(tmp_path, data_cache):
    from torchao.float8.float8_linear import Float8Linear

    argv = base_overrides(6, tmp_path) + ["--job.dump_folder", str(tmp_path / "run"), "--data.cache_dir", str(data_cache)]
    argv += ["--training.mixed_precision", "bf16"]
    bf16 = _losses(Trainer(load_config(argv)), 6)
    for recipe in ("tensorwise", "rowwise"):
        trainer = Trainer(load_config(argv + ["--float8.enable", "true", "--float8.recipe", recipe]))
        converted = [name for name, m in trainer.model.named_modules() if isinstance(m, Float8Linear)]
        assert len(converted) == 2 * 7 and all(name.startswith("layers.") for name in converted), converted
        assert type(trainer.model.output) is nn.Linear  # the output projection stays in high precision
        diff = max(abs(a - b) for a, b in zip(bf16, _losses(trainer, 6)))
        print(f"float8 {recipe}: max |dloss| vs bf16 over 6 steps {diff:.2e}")
        assert 0 < diff <= FLOAT8_LOSS_BOUND_VS_BF16, (recipe, diff)


ODD = Llama3Args(dim=40, n_layers=1, n_heads=4, vocab_size=512, multiple_of=24, max_seq_len=64)


def test_dims_that_are_not_multiples_of_16_are_skipped_and_none_usable_is_an_error(tmp_path, monkeypatch):
    converted, skipped = float8_targets(Transformer(ODD))
    assert converted == [] and len(skipped) == 7 and "output" not in skipped
    # Through the trainer, with a model flavour whose every dim is unusable: an error before any data is built.
    monkeypatch.setitem(LLAMA3_FLAVORS, "odd", ODD)
    argv = base_overrides(2, tmp_path) + ["--model.flavor", "odd", "--float8.enable", "true", "--job.dump_folder", str(tmp_path / "r")]
    with pytest.raises(ConfigError, match=r"no linear layer can run in float8.*multiples of 16.*layers\.0\.attention\.wq \(40x40\)"):
        Trainer(load_config(argv))
    assert not (tmp_path / "cache").exists()
    # Under tensor parallel the per-rank slice counts: tiny's kv projections (64 -> 32) split 4 ways are 8 wide.
    tiny = Transformer(Llama3Args(dim=64, n_layers=1, n_heads=8, n_kv_heads=4, vocab_size=64, max_seq_len=16))
    converted, skipped = float8_targets(tiny, tp=4)
    assert sorted(skipped) == ["layers.0.attention.wk", "layers.0.attention.wv"]


FSDP_FLOAT8_SCRIPT = textwrap.dedent(
    """
    import json, math, os, sys
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    from meshloom.config.schema import Float8Config
    from meshloom.models.llama3.flavors import LLAMA3_FLAVORS
    from meshloom.models.llama3.model import Transformer
    from meshloom.parallel.float8 import convert_to_float8, sync_float8_scales
    from meshloom.parallel.fsdp import apply_fsdp

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    torch.manual_seed(0)
    model = Transformer(LLAMA3_FLAVORS["tiny"])
    config = Float8Config(enable=True)
    convert_to_float8(model, config, fsdp=True, tp=1)
    apply_fsdp(model, list(model.layers.values()), init_device_mesh("cpu", (1,)), torch.bfloat16, torch.float32, "default", False)
    weight = model.layers["0"].feed_forward.w1.weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 512, (2, 32))).float().pow(2).mean().backward()
    optimizer.step()
    sync_float8_scales(model, config, fsdp=True)
    local = weight._local_tensor  # the shard FSDP all-gathers (to_local() would return a fresh view)
    expected = torch.finfo(torch.float8_e4m3fn).max / local.detach().float().abs().max().double()
    print(json.dumps({
        "wrapped": isinstance(local, WeightWithDynamicFloat8CastTensor),
        "scale": float(local._precomputed_scale),
        "expected": float(expected),
    }))
    dist.destroy_process_group()
    os._exit(0)
    """
)


def test_fsdp_float8_all_gather_weights_and_per_step_scale_sync(tmp_path):
    script = tmp_path / "fsdp_float8.py"
    script.write_text(FSDP_FLOAT8_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # FSDP holds the shard as torchao's float8-castable weight, so the all-gather moves float8 bytes ...
    assert result["wrapped"]
    # ... cast with the scale the post-step sync computed from the updated weight's amax.
    assert result["scale"] == pytest.approx(result["expected"], rel=1e-6)
