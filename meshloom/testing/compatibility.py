"""docs/compatibility.md: which features train together, each pair proven by a test or refused by the declaration.

The table's features are the values of the pairwise matrix's axes (meshloom/testing/matrix.py). A pair of values of
two axes is "refused" when the declaration (meshloom/planning/features.py, read by RunPlan.build) refuses it, and
otherwise "proven" by the matrix cell that trains it. Two layouts combine as a layout of their own, proven by the
layout parity tests named in LAYOUT_PROOFS. tests/test_compatibility.py regenerates the page and fails when the
committed one differs, when a pair is neither proven nor refused, or when a named test does not exist.

`python -m meshloom.testing.compatibility > docs/compatibility.md` writes it anew.
"""

from __future__ import annotations

import itertools

from meshloom.testing import matrix
from meshloom.testing.matrix_cells import CELLS

# The table's rows and columns: every value but the ones that turn nothing on, with its heading.
TITLES = {
    "llama3": "Llama 3", "qwen3": "Qwen3", "qwen3_moe": "Qwen3 MoE", "deepseek_v3": "DeepSeek-V3",
    "gpt_oss": "gpt-oss", "qwen3_next": "Qwen3-Next",
    "fsdp": "FSDP", "hsdp": "HSDP", "tp": "TP", "pp": "PP", "cp": "CP", "ep": "EP", "fsdp_tp": "FSDP×TP",
    "ac_full": "AC full", "ac_selective": "AC selective", "compile": "compile", "float8": "Float8",
    "muon": "Muon", "muon_qk_clip": "Muon+QK-clip", "shards": "shards+stages", "streaming": "streaming",
    "document_mask": "doc masks", "replica_groups": "replica groups", "diloco": "DiLoCo", "local_sgd": "LocalSGD",
    "kill_restart": "kill+restart", "resume_other_layout": "resume elsewhere", "chunked_loss": "chunked loss",
}  # fmt: skip

MATRIX_TEST = "tests/test_matrix.py::test_cell_matches_its_reference"
LAYOUT_TEST = "tests/test_parity.py::test_layout_matches_one_process"
CP_TEST = "tests/test_context_parallel_parity.py::test_context_parallel_layout_matches_one_process"
PP_TEST = "tests/test_pipeline.py::test_every_schedule_and_3d_layout_matches_one_process"
EP_TEST = "tests/test_expert_parallel.py::test_expert_parallel_layouts_match_one_process"

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
    ("cp", "ep"): (EP_TEST, "cp2_ep2"),
    ("ep", "fsdp_tp"): (EP_TEST, "tp2_ep2_compile_sac"),
}


def _axis(name: str) -> str:
    return next(axis for axis, values in matrix.AXES.items() if name in [v.name for v in values])


def _key(a: str, b: str) -> tuple[str, str]:
    """The pair in the matrix's axis order (and, within the layouts, the table's)."""
    order = list(TITLES)
    return (a, b) if order.index(a) < order.index(b) else (b, a)


def statuses() -> dict[tuple[str, str], str]:
    """Every pair of the table's features: "—" (one per run), "contains", ("M", cell id), ("P", test, case) or
    ("R", line); a pair with none of these maps to "unproven"."""
    refused = {_key(*pair): line for pair, line in matrix.refused_pairs().items()}
    cells: dict[tuple[str, str], str] = {}
    for cell in CELLS:
        for pair in matrix.pairs_of(dict(cell)):
            if all(name in TITLES for name in pair):
                cells.setdefault(_key(*pair), matrix.cell_id(cell))
    out: dict[tuple[str, str], object] = {}
    for a, b in itertools.combinations(TITLES, 2):
        same_axis = _axis(a) == _axis(b)
        if same_axis and _axis(a) != "layout":
            out[(a, b)] = "—"
        elif (a, b) in CONTAINS:
            out[(a, b)] = "contains"
        elif same_axis:
            proof = LAYOUT_PROOFS.get((a, b))
            out[(a, b)] = ("P", *proof) if proof else "unproven"
        elif (a, b) in refused:
            out[(a, b)] = ("R", refused[(a, b)])
        elif (a, b) in cells:
            out[(a, b)] = ("M", cells[(a, b)])
        else:
            out[(a, b)] = "unproven"
    return out  # type: ignore[return-value]


def render() -> str:
    found = statuses()
    codes: dict[object, str] = {}
    notes: dict[str, list[str]] = {"M": [], "P": [], "R": []}

    def code(status: object) -> str:
        if isinstance(status, str):
            return {"—": "—", "contains": "⊂", "unproven": "**?**"}[status]
        if status not in codes:
            kind = status[0]
            codes[status] = f"{kind}{len(notes[kind]) + 1}"
            if kind == "M":
                notes["M"].append(f"`{MATRIX_TEST}[{status[1]}]`")
            elif kind == "P":
                notes["P"].append(f"`{status[1]}` ({status[2]})")
            else:
                notes["R"].append(status[1])
        return codes[status]

    names = list(TITLES)
    lines = [
        "# Features that train together",
        "",
        "Generated by `python -m meshloom.testing.compatibility` from the declaration of features and constraints",
        "(`meshloom/planning/features.py`, which `RunPlan.build` reads) and the pairwise matrix",
        "(`meshloom/testing/matrix.py`); `tests/test_compatibility.py` fails when this page and the code disagree.",
        "",
        "Each cell is a pair of features. **M**: proven by that cell of the pairwise matrix, which trains both",
        "together (with the other axes' values the cell names) and matches its reference (one process within 1e-5",
        "in fp32; see tests/test_matrix.py). **P**: proven by a layout parity test. **R**: refused by the",
        "declaration with the one line below, before anything is built. —: one value per run. ⊂: one layout holds",
        "the other. A pair with none of these would read **?**; the test refuses such a page.",
        "",
        "| | " + " | ".join(TITLES[n] for n in names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for row in names:
        cells = []
        for col in names:
            if row == col:
                cells.append("")
                continue
            status = found[(row, col)] if (row, col) in found else found[(col, row)]
            cells.append(code(status))
        lines.append(f"| **{TITLES[row]}** | " + " | ".join(cells) + " |")
    lines += ["", "## Proven by the pairwise matrix", ""]
    lines += [f"- M{i}: {note}" for i, note in enumerate(notes["M"], 1)]
    lines += ["", "## Proven by a layout parity test", ""]
    lines += [f"- P{i}: {note}" for i, note in enumerate(notes["P"], 1)]
    lines += ["", "## Refused", ""]
    lines += [f"- R{i}: refused: {note}" for i, note in enumerate(notes["R"], 1)]
    lines += ["", *_declaration_lines()]
    return "\n".join(lines) + "\n"


def _declaration_lines() -> list[str]:
    """Every constraint the declaration holds, the table's and the others."""
    from meshloom.planning.features import CONFLICTS
    from meshloom.planning.setting_scopes import SCOPES

    lines = ["## Every declared constraint", "", "Pairs that cannot train together:", ""]
    lines += [f"- {conflict.line()}" for conflict in CONFLICTS]
    lines += ["", "Settings that act only under a condition (given otherwise, they are refused as having no effect):", ""]
    for scope in SCOPES:
        keys = ", ".join(f"`{k}`" for k in scope.keys)
        but = f" (but {', '.join(f'`{k}`' for k in scope.except_keys)})" if scope.except_keys else ""
        lines.append(f"- {keys}{but}: only when {scope.condition}")
    return lines


if __name__ == "__main__":
    print(render(), end="")
