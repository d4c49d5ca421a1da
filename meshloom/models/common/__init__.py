"""Single-device building blocks shared by the model families: norms, RoPE variants, attention, MLPs, MoE."""
