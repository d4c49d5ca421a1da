"""Every call in meshloom/ that writes, replaces or deletes a file either goes through the output rule
(meshloom/output.py) or writes into a folder that the run itself owns. The second kind are listed in WRITERS, each
with its reason; a new writer fails this test until it is one or the other.

The calls are found in the syntax tree, with names resolved through each module's imports, so an alias
(`from shutil import rmtree as rm`) is found as well as `shutil.rmtree`."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "meshloom"
RULE = "meshloom/output.py"
STAGED = {"staged_file", "staged_folder"}  # a call lexically inside `with staged_*(...) as tmp:` goes through the rule

# Module-level functions that write, by their full name.
QUALIFIED = {
    "torch.save", "numpy.save", "numpy.savez", "numpy.savez_compressed",
    "safetensors.torch.save_file", "safetensors.torch.save_model", "safetensors.numpy.save_file",
    "torch.distributed.checkpoint.save", "torch.distributed.checkpoint.async_save",
    "os.replace", "os.rename", "os.renames", "os.remove", "os.unlink", "os.rmdir", "os.removedirs",
    "shutil.copy", "shutil.copy2", "shutil.copyfile", "shutil.copytree", "shutil.move", "shutil.rmtree",
}  # fmt: skip
# Methods that write whatever the object (Path, Figure): no other type in meshloom has methods of these names.
METHODS = {"write_text", "write_bytes", "savefig", "unlink", "rmdir", "rename", "hardlink_to", "symlink_to"}

# meshloom's own writing helpers, which write where their caller says: a call to one is a writer too, so a command
# that hands one a user's path (not a staged temporary) fails here like a bare write.
HELPERS = {
    "meshloom.checkpoint.hf.write_hf_folder", "meshloom.checkpoint.offline.save_weights",
    "meshloom.checkpoint.offline.write_side_files", "meshloom.data.tokenizer.atomic_write_bytes",
    "meshloom.data.shard_format.write_json", "meshloom.checkpoint.folders.write_json_atomic",
    "meshloom.checkpoint.folders.remove", "meshloom.testing.layout_parity.plot",
}  # fmt: skip

# "module:function" -> why it may write without the output rule. Each writes into a folder its run owns.
WRITERS: dict[str, str] = {
    "meshloom/checkpoint/dcp.py:Checkpointer._save": "the run's own step-N folder: claimed with save.json first, foreign ones refused at start-up",
    "meshloom/checkpoint/folders.py:write_json_atomic": "markers inside a step folder the run claimed (save.json, complete.json)",
    "meshloom/checkpoint/folders.py:remove": "deletes a step folder of this run's lineage only (prune, a crashed save of this run)",
    "meshloom/checkpoint/folders.py:prune": "removes this lineage's own older step folders (owned_by), never another's",
    "meshloom/checkpoint/folders.py:commit": "complete.json in a step folder this run claimed",
    "meshloom/checkpoint/folders.py:claim": "save.json that marks a step folder as this run's",
    "meshloom/checkpoint/hf.py:write_hf_folder": "fills the folder its caller gives: a staged_folder temporary or the run's hf/.step-N.tmp",
    "meshloom/checkpoint/hf_export.py:HFExporter._write": "<run>/hf/step-N of this run; foreign step folders refused at start-up, never replaced",
    "meshloom/checkpoint/offline.py:write_side_files": "side files of a step folder being saved (the run's, or a staged_folder temporary)",
    "meshloom/checkpoint/offline.py:save_weights": "fills a new, empty folder (asserted): a staged_folder temporary",
    "meshloom/data/loader.py:tokenize_corpus": "the token cache in data.cache_dir: a name derived from the corpus and tokenizer, via a temporary",
    "meshloom/data/prepare.py:prepare": "removes only the --output folders this prepare made, when it finished no shard",
    "meshloom/data/prepare.py:_prepare_into": "meta.json of the prepare folder checked by check_resumable_folder (its own prepare_state.json)",
    "meshloom/data/prepare.py:_prepare_into.close_shard": "prepare_state.json of the checked prepare folder",
    "meshloom/data/prepare.py:_ShardWriter.flush": "a new shard's files in the checked prepare folder",
    "meshloom/data/shard_format.py:write_json": "prepare's state and meta files in its checked folder",
    "meshloom/data/tokenizer.py:_builtin": "the trained tokenizer's cache file in data.cache_dir",
    "meshloom/data/tokenizer.py:atomic_write_bytes": "the helper itself: write to a temporary, then rename (its callers are checked)",
    "meshloom/launch/ray_train.py:_attempt_of_this_run": "the attempt count in the launch's own Ray folder of the run",
    "meshloom/observe/flight_recorder.py:dump": "<run>/flight_recorder/attempt-N/rank-R.json of this run, via a temporary",
    "meshloom/observe/logging.py:MetricLogger.__init__": "appends to the run's metrics.jsonl (check_run_folder: this run's, or the one it resumes)",
    "meshloom/observe/cpu_peak.py:keep_cpu_peak": "meshloom's own CPU peak file in ~/.cache/meshloom, via a temporary",
    "meshloom/testing/layout_parity.py:launch": "the parity harness's cases file in its own new work folder",
    "meshloom/testing/layout_parity.py:worker": "a worker's result file in the harness's own work folder",
    "meshloom/testing/layout_parity.py:plot": "writes where `meshloom parity` says: a staged_file temporary",
    "meshloom/testing/replica_launch.py:start_training": "a log file in the harness's own work folder",
    "meshloom/testing/replica_launch.py:Lighthouse.__init__": "the Lighthouse log in the harness's own work folder",
    "meshloom/testing/resume_parity.py:launch": "the resume harness's cases file in its own work folder",
    "meshloom/testing/resume_parity.py:worker": "a worker's result file in the harness's own work folder",
    "meshloom/testing/ranks.py:_rank_main": "a forked test rank's log in the launcher's own log folder",
    "meshloom/testing/matrix_run.py:_sharing_the_cache": "a link to the data cache inside the matrix's own work folder",
    "meshloom/train/nonfinite.py:write_dump": "<run>/diagnostics/nonfinite_stepN.json: a dump of the failing step in the run's own folder",
    "meshloom/train/run_folder.py:write_run_config": "the run's config record, created exclusively ('x'): never over an existing file",
}


@dataclass(frozen=True)
class Writer:
    where: str  # "module:function"
    line: int
    call: str


def _imports(tree: ast.Module) -> dict[str, str]:
    """Local name -> full dotted name, from every import of the module (functions' own imports included)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    names.setdefault("np", "numpy")
    return names


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)) is not None:
        return f"{base}.{node.attr}"
    return None


def _writes_mode(call: ast.Call, method: bool) -> bool:
    """open(path, mode) or Path.open(mode) with a mode that writes, appends or creates."""
    args = call.args if method else call.args[1:]
    mode = next((k.value for k in call.keywords if k.arg == "mode"), args[0] if args else None)
    if mode is None:
        return False
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
        return any(c in mode.value for c in "wax+")
    return True  # a mode computed at run time: counted as a writer


def _is_writer(call: ast.Call, names: dict[str, str], module: str) -> bool:
    func = call.func
    dotted = _dotted(func)
    if dotted is not None:
        head, _, rest = dotted.partition(".")
        full = names.get(head, head) + (f".{rest}" if rest else "")
        if full in QUALIFIED or full in HELPERS or f"{module}.{dotted}" in HELPERS:
            return True
        if full == "open" or full == "io.open" or full == "builtins.open":
            return _writes_mode(call, method=False)
        if full == "os.open":  # flags, not a mode
            return len(call.args) > 1 and any(f in ast.unparse(call.args[1]) for f in ("O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"))
    if isinstance(func, ast.Attribute):
        if func.attr in METHODS:
            return True
        if func.attr == "open":
            return _writes_mode(call, method=True)
        # Path.replace(target) takes one argument; str.replace takes two.
        if func.attr == "replace" and len(call.args) == 1 and not call.keywords and _dotted(func.value) != "dataclasses":
            return True
    return False


def find_writers(package: Path = PACKAGE) -> list[Writer]:
    found = []
    for path in sorted(package.rglob("*.py")):
        module = path.relative_to(package.parent).as_posix()
        if module == RULE:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        names = _imports(tree)

        def visit(node: ast.AST, scope: list[str], staged: bool) -> None:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                scope = [*scope, node.name]
            if isinstance(node, (ast.With, ast.AsyncWith)):
                if any(isinstance(i.context_expr, ast.Call) and (_dotted(i.context_expr.func) or "").split(".")[-1] in STAGED for i in node.items):
                    staged = True
            if isinstance(node, ast.Call) and not staged and _is_writer(node, names, module.removesuffix(".py").replace("/", ".")):
                found.append(Writer(f"{module}:{'.'.join(s for s in scope if s != '<lambda>')}", node.lineno, ast.unparse(node.func)))
            for child in ast.iter_child_nodes(node):
                visit(child, scope, staged)

        visit(tree, [], False)
    return found


def test_every_writer_goes_through_the_output_rule_or_is_listed() -> None:
    writers = find_writers()
    unlisted = [w for w in writers if w.where not in WRITERS]
    assert not unlisted, "writers that bypass meshloom/output.py; route them through it, or list them with the folder the run owns:\n" + "\n".join(
        f"  {w.where} (line {w.line}): {w.call}(...)" for w in unlisted
    )
    stale = sorted(set(WRITERS) - {w.where for w in writers})
    assert not stale, f"listed writers that no longer write (remove them from WRITERS): {stale}"


def test_the_walk_finds_each_kind_of_writer(tmp_path: Path) -> None:
    """The finder itself: each kind of call the rule covers is found, aliases resolved; reads and look-alikes are not."""
    package = tmp_path / "meshloom"
    package.mkdir()
    (package / "sample.py").write_text(
        "import os, shutil, torch\nimport numpy as np\nfrom shutil import rmtree as rm\nfrom safetensors.torch import save_file\n"
        "import dataclasses\nfrom pathlib import Path\n\n"
        "def writes(p, fig, figure, x):\n"
        "    open(p, 'w'); open(p, mode='ab'); Path(p).open('x'); p.write_text('a'); p.write_bytes(b'a'); fig.savefig(p)\n"
        "    torch.save(x, p); save_file(x, p); np.save(p, x); shutil.copy(p, p); shutil.move(p, p); rm(p)\n"
        "    os.replace(p, p); os.rename(p, p); os.remove(p); os.unlink(p); p.unlink(); p.replace(p)\n"
        "    os.open(p, os.O_WRONLY | os.O_CREAT)\n\n"
        "def reads(p, s, x):\n"
        "    open(p); open(p, 'rb'); Path(p).open(); s.replace('a', 'b'); dataclasses.replace(x, a=1); [].remove(1)\n"
        "    os.open(p, os.O_RDONLY)\n"
        "    with staged_file(p) as tmp:\n"
        "        tmp.write_text('through the rule')\n"
    )
    calls = [w.call for w in find_writers(package)]
    assert all(w.where == "meshloom/sample.py:writes" for w in find_writers(package))
    assert len(calls) == 19, calls
