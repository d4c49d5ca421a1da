"""Finds every call in a package that writes, replaces, links or deletes a file, from the syntax tree.

Names are resolved through each module's imports, relative ones included (`from .folders import remove`,
`from . import folders`), so an alias (`from shutil import rmtree as rm`) is found as well as `shutil.rmtree`.
Each call is reported on its own (module, enclosing function, the call's text), so a list of allowed writers
can name single calls: a new writer added beside an allowed one is still found.

A call inside `with staged_file(...) as tmp:` (or `staged_folder`) is through the output rule only when it
writes into the staged temporary: its target names `tmp`. Any other writer in such a block is reported."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

STAGED = {"staged_file", "staged_folder"}

# Module-level functions and classes that write (or make a file or folder that outlives them), by full name.
QUALIFIED = {
    "torch.save", "torch.jit.save", "torch.export.save", "torch.onnx.export", "torch.cuda.memory._dump_snapshot",
    "torch.distributed.checkpoint.save", "torch.distributed.checkpoint.async_save",
    "torch.profiler.tensorboard_trace_handler", "torch.utils.tensorboard.SummaryWriter", "tensorboardX.SummaryWriter",
    "numpy.save", "numpy.savez", "numpy.savez_compressed", "numpy.savetxt",
    "safetensors.torch.save_file", "safetensors.torch.save_model", "safetensors.numpy.save_file",
    "os.replace", "os.rename", "os.renames", "os.remove", "os.unlink", "os.rmdir", "os.removedirs",
    "os.symlink", "os.link", "os.truncate", "os.mkfifo", "os.mknod", "os.mkdir", "os.makedirs",
    "shutil.copy", "shutil.copy2", "shutil.copyfile", "shutil.copytree", "shutil.move", "shutil.rmtree",
    "shutil.copyfileobj", "shutil.make_archive", "shutil.unpack_archive",
    "tempfile.mkstemp", "tempfile.mkdtemp", "tempfile.NamedTemporaryFile", "tempfile.TemporaryDirectory",
    "logging.FileHandler", "logging.handlers.RotatingFileHandler", "logging.handlers.TimedRotatingFileHandler",
    "logging.handlers.WatchedFileHandler", "wandb.init", "sqlite3.connect",
}  # fmt: skip
# Classes and functions that write only when given a folder to write into (Ray's run storage).
WITH_KEYWORD = {"storage_path", "log_dir", "logdir", "dir"}
KEYWORD_CALLS = {"ray.train.RunConfig", "ray.air.RunConfig", "ray.tune.RunConfig", "ray.init", "ray.train.CheckpointConfig"}
# Methods that write whatever the object (Path, Figure, ndarray, profiler, transformers model): no other type in
# meshloom has methods of these names.
METHODS = {
    "write_text", "write_bytes", "touch", "mkdir", "savefig", "unlink", "rmdir", "rename", "hardlink_to", "symlink_to",
    "tofile", "save_pretrained", "export_chrome_trace", "export_memory_timeline", "export_stacks", "to_json_file",
}  # fmt: skip
# File-like constructors that write with a writing mode.
OPENERS = {"open", "io.open", "builtins.open", "gzip.open", "bz2.open", "lzma.open", "tarfile.open", "zipfile.ZipFile"}
WRITE_FLAGS = ("O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC")


@dataclass(frozen=True)
class Writer:
    where: str  # "module:function"
    line: int
    call: str  # the call's text, arguments included

    @property
    def key(self) -> str:
        return f"{self.where} {self.call}"


def _module_name(path: Path, package: Path) -> str:
    return path.relative_to(package.parent).with_suffix("").as_posix().replace("/", ".")


def _imports(tree: ast.Module, module: str, is_package: bool) -> dict[str, str]:
    """Local name -> full dotted name, from every import of the module (functions' own and relative ones)."""
    names: dict[str, str] = {}
    parts = module.split(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                anchor = parts if is_package else parts[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                names[alias.asname or alias.name] = f"{base}.{alias.name}"
    names.setdefault("np", "numpy")
    return names


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)) is not None:
        return f"{base}.{node.attr}"
    return None


def _mode_writes(mode: ast.expr | None, default_writes: bool = False) -> bool:
    if mode is None:
        return default_writes
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
        return any(c in mode.value for c in "wax+")
    return True  # a mode computed at run time: counted as a writer


def _writes_mode(call: ast.Call, method: bool) -> bool:
    """open(path, mode) or Path.open(mode) with a mode that writes, appends or creates."""
    args = call.args if method else call.args[1:]
    mode = next((k.value for k in call.keywords if k.arg == "mode"), args[0] if args else None)
    return _mode_writes(mode)


def _full_name(func: ast.expr, names: dict[str, str]) -> str | None:
    dotted = _dotted(func)
    if dotted is None:
        return None
    head, _, rest = dotted.partition(".")
    return names.get(head, head) + (f".{rest}" if rest else "")


def writer_kind(call: ast.Call, names: dict[str, str], module: str, writing_functions: set[str]) -> str | None:
    """"call" for a function that writes where its arguments say, "method" for a method that writes its object,
    None for a call that does not write."""
    func = call.func
    full = _full_name(func, names)
    if full is not None:
        if full in QUALIFIED or full in writing_functions or f"{module}.{_dotted(func)}" in writing_functions:
            return "call"
        if full in KEYWORD_CALLS:
            return "call" if any(k.arg in WITH_KEYWORD for k in call.keywords) else None
        if full in OPENERS:
            return "call" if _writes_mode(call, method=False) else None
        if full in ("numpy.memmap", "numpy.lib.format.open_memmap"):
            mode = next((k.value for k in call.keywords if k.arg == "mode"), call.args[2] if len(call.args) > 2 else None)
            return "call" if _mode_writes(mode, default_writes=full == "numpy.memmap") else None  # memmap's default is r+
        if full == "os.open":  # flags, not a mode
            return "call" if len(call.args) > 1 and any(f in ast.unparse(call.args[1]) for f in WRITE_FLAGS) else None
    if isinstance(func, ast.Attribute):
        if func.attr in METHODS:
            return "method"
        if func.attr == "open":
            return "method" if _writes_mode(call, method=True) else None
        # Path.replace(target) takes one argument; str.replace takes two.
        if func.attr == "replace" and len(call.args) == 1 and not call.keywords and _dotted(func.value) != "dataclasses":
            return "method"
    return None


def _names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _into_staged(call: ast.Call, kind: str, staged: set[str]) -> bool:
    """The call's target (a function's arguments; a method's object or arguments) names the staged temporary."""
    if not staged:
        return False
    assert isinstance(call.func, ast.Attribute) or kind == "call"
    # A method writes its object (Path.write_text) or its argument (Figure.savefig, Profile.export_chrome_trace).
    targets = [*call.args, *(k.value for k in call.keywords)] + ([call.func.value] if kind == "method" else [])  # type: ignore[union-attr]
    return any(_names_in(t) & staged for t in targets)


def find_writers(package: Path, writing_functions: set[str], skip: str = "") -> list[Writer]:
    """Every writer under `package` but the module `skip` (the output rule itself). Two identical calls in one
    function are told apart by " #2", " #3" after the second and later ones."""
    found: list[Writer] = []
    for path in sorted(package.rglob("*.py")):
        module = _module_name(path, package)
        tree = ast.parse(path.read_text(), filename=str(path))
        names = _imports(tree, module, path.name == "__init__.py")
        relpath = path.relative_to(package.parent).as_posix()
        if relpath == skip:
            continue

        def visit(node: ast.AST, scope: list[str], staged: set[str]) -> None:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                scope = [*scope, node.name]
            if isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    expr = item.context_expr
                    if isinstance(expr, ast.Call) and (_dotted(expr.func) or "").split(".")[-1] in STAGED:
                        if isinstance(item.optional_vars, ast.Name):
                            staged = {*staged, item.optional_vars.id}
            kind = writer_kind(node, names, module, writing_functions) if isinstance(node, ast.Call) else None
            if kind is not None and not _into_staged(node, kind, staged):  # type: ignore[arg-type]
                where = f"{relpath}:{'.'.join(s for s in scope if s != '<lambda>')}"
                text = ast.unparse(node)
                seen = sum(1 for w in found if w.where == where and w.call.split(" #")[0] == text)
                found.append(Writer(where, node.lineno, text + (f" #{seen + 1}" if seen else "")))
            for child in ast.iter_child_nodes(node):
                visit(child, scope, staged)

        visit(tree, [], set())
    return found
