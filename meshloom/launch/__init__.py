"""`meshloom launch`: a recipe and a cluster shape turned into what SLURM, Kubernetes or Ray runs.

meshloom brings no scheduler of its own: `cluster.py` checks the shape against the recipe (the same `RunPlan`
the trainer builds), `torchrun.py` renders the one torchrun command every scheduler runs, and `slurm.py`,
`k8s.py` and `ray_train.py` wrap it as an sbatch script, a Kubeflow Trainer `TrainJob`, or a Ray Train run.
"""
