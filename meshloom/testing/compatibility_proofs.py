"""The proofs of docs/compatibility.md that are not matrix cells: layouts combined, and declared features that are no
value of a matrix axis. tests/test_compatibility.py checks that every named test exists with its case and its step
count, and that every declared feature is an axis value or has an entry here."""

from __future__ import annotations

MATRIX_TEST = "tests/test_matrix.py::test_cell_matches_its_reference"
LAYOUT_TEST = "tests/test_parity.py::test_layout_matches_one_process"
CP_TEST = "tests/test_context_parallel_parity.py::test_context_parallel_layout_matches_one_process"
PP_TEST = "tests/test_pipeline.py::test_every_schedule_and_3d_layout_matches_one_process"
EP_TEST = "tests/test_expert_parallel.py::test_expert_parallel_layouts_match_one_process"
# Steps each layout parity test trains (the named test file must say so: `steps=N`, or N in its reference's steps).
LAYOUT_TEST_STEPS = {LAYOUT_TEST: 6, CP_TEST: 6, PP_TEST: 6, EP_TEST: 6}

# Two layouts of the matrix combined: (test, the case in it). A layout that contains the other is marked so.
CONTAINS = {("fsdp", "hsdp"), ("fsdp", "ep"), ("fsdp", "fsdp_tp"), ("tp", "fsdp_tp")}
LAYOUT_PROOFS: dict[tuple[str, str], tuple[str, str]] = {
    ("hsdp", "tp"): (LAYOUT_TEST, "dp_replicate=2,dp_shard=2,tp=2"),
    ("hsdp", "fsdp_tp"): (LAYOUT_TEST, "dp_replicate=2,dp_shard=2,tp=2"),
    ("fsdp", "tp"): (LAYOUT_TEST, "dp_shard=2,tp=2"),
    ("fsdp", "pp"): (PP_TEST, "pp=2,dp_shard=2"),
    ("hsdp", "pp"): (PP_TEST, "pp=2,dp_replicate=2"),
    ("tp", "pp"): (PP_TEST, "pp=2,tp=2"),
    ("pp", "fsdp_tp"): (PP_TEST, "pp=2,dp_shard=2,tp=2,pipeline.microbatches=2"),
    ("fsdp", "cp"): (CP_TEST, "dp_shard=2,cp=2"),
    ("hsdp", "cp"): (CP_TEST, "dp_replicate=2,cp=2"),
    ("tp", "cp"): (CP_TEST, "tp=2,cp=2"),
    ("pp", "cp"): (CP_TEST, "pp=2,cp=2"),
    ("cp", "fsdp_tp"): (CP_TEST, "dp_shard=2,tp=2,cp=2"),
    ("hsdp", "ep"): (EP_TEST, "hsdp_ep2_compile_sac"),
    ("tp", "ep"): (EP_TEST, "tp2_ep2_compile_sac"),
    ("pp", "ep"): (EP_TEST, "pp2_ep2_compile_sac"),
    ("cp", "ep"): (EP_TEST, "cp2_ep2_compile_sac"),
    ("ep", "fsdp_tp"): (EP_TEST, "tp2_ep2_compile_sac"),
}

# Declared features (meshloom/planning/features.py) that are no matrix value: what proves each, with which others.
# Every pair of such a feature that the declaration refuses is in the page's list of declared constraints.
REFUSAL_TEST = "tests/test_features.py::test_each_declared_pair_is_refused_with_its_line"
NON_AXIS_PROOFS: dict[str, list[tuple[str, str]]] = {
    # Features that only name a condition of the model, the tokenizer or a setting under which a pair is refused: what
    # proves them is the refusal itself, each pair's line asserted by the generated test.
    "no_qk_clip": [(REFUSAL_TEST, "QK-clip on a family whose attention cannot rescale per head: refused in one line")],
    "no_hf_shape": [(REFUSAL_TEST, "an HF export of a model its format cannot hold: refused in one line")],
    "shared_bos_eos": [(REFUSAL_TEST, "document masks with a tokenizer whose bos is its eos: refused in one line")],
    "no_checkpoints": [(REFUSAL_TEST, "rollback without checkpoints: refused in one line")],
    "fsdp_reshard_always": [(REFUSAL_TEST, "a zero-bubble schedule with FSDP resharding after forward: refused in one line")],
    "mtp": [(
        "tests/test_deepseek_v3_parallel.py::test_multi_rank_parity_with_mtp_and_moe",
        "DeepSeek-V3 with multi-token prediction and MoE under several layouts: every loss within the parity bound of one "
        "process; with CP it is refused in one line (the generated refusal test)",
    )],
    "tied_embeddings": [(
        "tests/test_parallel.py::test_tensor_parallel_keeps_a_tied_llama_output_tied",
        "a tied Llama under TP keeps its output tied; under PP it is refused in one line "
        "(tests/test_pipeline.py::test_tied_embeddings_cannot_be_pipelined)",
    )],
    "zero_bubble": [(
        "tests/test_pipeline.py::test_every_schedule_and_3d_layout_matches_one_process",
        "every schedule, the zero-bubble ones included, and PP x FSDP x TP: every loss within the parity bound of one process",
    )],
    "hf_export": [(
        "tests/test_hf_export_training.py::test_parallel_exports_equal_the_dcp_checkpoint_of_their_step",
        "under FSDP, TP, PP and CP (Llama 3) and EP (Qwen3 MoE), 2 ranks, 2 steps: the export's logits equal those "
        "of the DCP checkpoint of its step within 1e-5",
    )],
    "rollback": [(
        "tests/test_nonfinite.py::test_rollback_reloads_the_checkpoint_and_skips_the_bad_batch",
        "one process with checkpoints, 7 steps: the losses equal, bit for bit, a run without the poisoned batch",
    )],
    "elastic_resize": [(
        "tests/test_multihost.py::test_elastic_run_continues_on_the_host_left_with_the_data_parallel_degree_halved",
        "FSDP over 2 hosts, one host killed in step 6: the run continues from the step-4 checkpoint with dp_shard "
        "2 -> 1 to step 8",
    )],
    "ac_memory_budget": [(
        "tests/test_compile.py::test_compiled_modes_match_eager_and_keep_fewer_activations",
        "with compile (which it needs), one process, 4 steps: every loss within 1e-5 of eager without AC",
    )],
    "ac_whole_blocks": [(
        "tests/test_activation_checkpoint.py::test_every_eager_mode_keeps_loss_parity_with_none",
        "full and selective_layer (every 2nd block), one process, 4 steps: every loss within 1e-5 of no AC",
    )],
    "moe_aux_loss": [(
        EP_TEST,
        "Qwen3 MoE with the sequence-wise loss (1e-2) under EP 2, FSDP x EP, HSDP x EP, TP x EP and PP x EP, with "
        "compile and selective AC: every loss within 1e-5 of one process",
    )],
    "moe_bias": [(
        EP_TEST,
        "the same runs with bias balancing on: every loss within 1e-5 of one process, the biases bit-equal; the "
        "matrix's MoE cells run with the families' default rates, but for DiLoCo and LocalSGD (rate 0)",
    )],
    "expert_loop": [(
        "tests/test_moe.py::test_grouped_mm_and_loop_agree_in_outputs_and_gradients",
        "one MoE layer: the loop's outputs and gradients equal grouped_mm's",
    )],
    "flex_attention": [(MATRIX_TEST, "gpt-oss's attention kernel: every gpt-oss cell of the matrix trains it")],
    "dense": [(MATRIX_TEST, "Llama 3 and Qwen3: the matrix's dense families")],
    "no_compile": [(MATRIX_TEST, "the matrix's eager value")],
}
