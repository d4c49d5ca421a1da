"""An sbatch script: one torchrun agent per node (srun, one task per node), c10d rendezvous on the first node."""

from __future__ import annotations

import shlex

from meshloom.launch.cluster import ClusterShape
from meshloom.launch.torchrun import torchrun_args

# The rendezvous, filled in by the shell on the allocated nodes.
RENDEZVOUS = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "$HEAD_NODE:$RDZV_PORT", "--rdzv-id", "$SLURM_JOB_ID"]


def _shell_words(words: list[str]) -> str:
    """Every word quoted for the shell (shlex.quote), so nothing a user typed is expanded or run; only the words of
    the rendezvous, which are this module's own, keep their $VARIABLES expandable (inside double quotes)."""
    return " ".join(f'"{w}"' if w in RENDEZVOUS and "$" in w else shlex.quote(w) for w in words)


def _comment(text: str) -> str:
    """`text` as comment lines: a line break in it (from an argument) cannot end the comment and start a command."""
    return "\n".join(f"# {line}" for line in text.replace("\r", "\n").split("\n"))


def sbatch_script(name: str, shape: ClusterShape, max_restarts: int, train: list[str], note: str) -> str:
    nodes = f"{shape.min_nodes}-{shape.nodes}" if shape.elastic else str(shape.nodes)
    args = torchrun_args(shape, max_restarts, RENDEZVOUS, train)
    # Elastic: a lost node must not end the job (--no-kill) nor the other nodes' agents (--kill-on-bad-exit=0);
    # the agents left restart their ranks on fewer nodes.
    keep = "#SBATCH --no-kill\n" if shape.elastic else ""
    kill_on_bad_exit = 0 if shape.elastic else 1
    return f"""#!/bin/bash
{_comment(note)}
# Submit from the directory the recipe path is relative to:  sbatch {{this file}}
# TORCHRUN (default .venv/bin/torchrun) and RDZV_PORT (default 29500) may be set in the environment.
#SBATCH --job-name={name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={shape.gpus_per_node}
#SBATCH --exclusive
{keep}set -euo pipefail
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
RDZV_PORT=${{RDZV_PORT:-29500}}
TORCHRUN=${{TORCHRUN:-.venv/bin/torchrun}}
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-8}}
# A restarted group must not read the previous attempt's addresses from torchrun's shared store (pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
cd "${{SLURM_SUBMIT_DIR:-.}}"
srun --kill-on-bad-exit={kill_on_bad_exit} "$TORCHRUN" {_shell_words(args)}
"""
