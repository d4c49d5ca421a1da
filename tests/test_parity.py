"""Loss parity of every supported layout against one process over 6 steps (fp32: 1e-5; bf16: the bound measured in
testing/layout_parity.py).

All layouts run in three launches (2, 4 and 8 ranks; testing/ranks.py), each running every layout of its size in turn.
Six steps (two of warm-up, four of decay): a layout's first step costs its ranks more than the others together
(DTensor plans every operator once per mesh), and a layout that is wrong shows from its second step.
"""

import math
import os

import pytest

from meshloom.testing.layout_parity import BF16_TOLERANCE, FP32_TOLERANCE, compare, plot
from meshloom.testing.ranks import RanksFailed, run_ranks

# FSDP 2, TP 2 and HSDP 2 x 2 on their own are cells of the pairwise matrix (tests/test_matrix.py).
LAYOUTS = [
    "tp=2,loss_parallel=false",  # the output gathered, plain cross-entropy
    "dp_replicate=2",  # pure replication (HSDP with shards of 1)
    "dp_shard=2,mixed_precision=bf16",
    "dp_shard=2,fsdp_reduce_dtype=bfloat16",  # fp32 compute, gradients reduce-scattered in bf16
    "tp=2,mixed_precision=bf16",  # bf16 autocast under TP (no FSDP)
    "dp_shard=4",
    "tp=4",
    "dp_shard=2,tp=2",
    "dp_shard=4,fsdp_cpu_offload=true",
    "dp_replicate=2,dp_shard=2,tp=2",
]


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    os.environ.pop("WORLD_SIZE", None)
    workdir = tmp_path_factory.mktemp("parity")
    reference, comparisons = compare(LAYOUTS, steps=6, workdir=workdir)
    return workdir, reference, {c.layout.spec: c for c in comparisons}


@pytest.mark.parametrize("spec", LAYOUTS)
def test_layout_matches_one_process(parity, spec):
    _, reference, comparisons = parity
    c = comparisons[spec]
    assert len(c.curve.losses) == 6
    tolerance = BF16_TOLERANCE if "bf16" in spec or "bfloat16" in spec else FP32_TOLERANCE
    assert c.layout.tolerance == tolerance
    print(f"{spec}: max |dloss| {c.max_loss_diff:.2e}, |dgrad_norm| {c.grad_norm_diff:.2e}")
    assert c.max_loss_diff <= tolerance, (spec, reference.losses, c.curve.losses)
    assert c.grad_norm_diff <= tolerance
    assert c.ok


def test_reference_learns_and_bf16_really_differs(parity):
    _, reference, comparisons = parity
    assert reference.losses[-1] < reference.losses[0] - 0.3
    assert all(math.isfinite(x) for x in reference.losses)
    # bf16 must actually change the numbers, otherwise its bound proves nothing. Rounding only the reduced
    # gradients moves the loss least (measured 1.2e-4), but still well past anything fp32 layouts do (<= 1e-6).
    for spec in LAYOUTS:
        if "bf16" in spec:
            assert comparisons[spec].max_loss_diff > 10 * FP32_TOLERANCE, spec
        elif "bfloat16" in spec:
            assert comparisons[spec].max_loss_diff > FP32_TOLERANCE, spec


def test_comparison_plot_is_written(parity):
    workdir, reference, comparisons = parity
    out = plot(reference, list(comparisons.values()), workdir / "parity.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _fail_on_rank_one(marker: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError(f"rank 1 fails: {marker}")
    dist.barrier()  # rank 0 waits here until the launcher stops it


def test_a_failing_rank_stops_the_launch_with_its_error() -> None:
    with pytest.raises(RanksFailed, match=r"(?s)_fail_on_rank_one on 2 ranks failed: .*ValueError: rank 1 fails: seen"):
        run_ranks(_fail_on_rank_one, 2, "seen")


def test_command_refuses_a_folder_or_plot_it_did_not_make(tmp_path) -> None:
    """`meshloom parity` writes runs, a data cache and curves into --workdir: a folder holding anything, or a plot file
    that exists, is refused before any training, and left as it was."""
    from meshloom.cli.parity import main
    from meshloom.config.errors import UserError

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(UserError, match=r"--workdir .*mine is not an empty folder"):
        main(["--layout", "dp_shard=2", "--workdir", str(mine)])
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep"
    (tmp_path / "curves.png").write_bytes(b"png")
    with pytest.raises(UserError, match=r"curves.png already exists; pass --overwrite to replace it"):
        main(["--layout", "dp_shard=2", "--workdir", str(tmp_path / "new"), "--plot", str(tmp_path / "curves.png")])
    assert not (tmp_path / "new").exists() and (tmp_path / "curves.png").read_bytes() == b"png"


def test_steps_are_refused_in_parity_s_own_words(tmp_path, capsys) -> None:
    """`meshloom parity` takes --steps, not --training.steps: a bad count, or training.steps hidden in --common or a
    --layout, is one line naming parity's flag, before any run."""
    from cli_checks import one_line_error
    from meshloom.cli import main as cli

    work = tmp_path / "work"
    cases = [
        (["--steps", "0"], "--steps must be positive, got 0"),
        (["--steps", "-3"], "--steps must be positive, got -3"),
        (["--common", "training.steps=3"], "parity: --common 'training.steps=3' sets training.steps; every run trains --steps steps, so pass --steps instead"),
        (["--layout", "tp=2,training.steps=0"], "parity: --layout 'tp=2,training.steps=0' sets training.steps"),
    ]  # fmt: skip
    for extra, message in cases:
        line = one_line_error(cli(["parity", "--layout", "dp_shard=2", "--workdir", str(work), *extra]), capsys.readouterr().err, message)
        assert "--training.steps" not in line
    assert not work.exists()

