"""The package's source inside an exported model folder, for transformers' remote code (`trust_remote_code=True`);
docs/transformers.md, "Export and remote code".
"""

from __future__ import annotations

import ast
import pprint
import shutil
from pathlib import Path

PACKAGE = "hybrid_attention"
ENTRY = "modeling_hybrid_attention"
LISTING = "hybrid_attention_files"
ROOTS = ("hybrid_attention.hf", "hybrid_attention.hf.configuration", "hybrid_attention.hf.modeling")
_SOURCE = Path(__file__).resolve().parents[1]  # the package directory


def _file_of(module: str) -> tuple[Path, bool] | None:
    """(source file, is a package) of a module of this package, or None when it is not one."""
    path = _SOURCE.parent.joinpath(*module.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py", True
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py"), False
    return None


def _named_modules(source: str) -> set[str]:
    """The package's modules a source text names: imports anywhere in it (lazy ones too), submodules imported by
    `from package import submodule`, and module names written as strings (for importlib)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
    return {name for name in found if name.split(".")[0] == PACKAGE and _file_of(name)}


def model_modules() -> dict[str, tuple[Path, bool]]:
    """{module: (source file, is a package)} for every module the transformers model can import, parents included."""
    modules, todo = {}, list(ROOTS)
    while todo:
        name = todo.pop()
        if name in modules:
            continue
        modules[name] = _file_of(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += sorted(_named_modules(modules[name][0].read_text(encoding="utf-8")))
    return dict(sorted(modules.items()))


def flat_name(module: str, is_package: bool) -> str:
    """hybrid_attention.ops.kda -> hybrid_attention__ops__kda__init.py (a package), ...kda.naive -> ...kda__naive.py"""
    return "__".join(module.split(".")) + ("__init" if is_package else "") + ".py"


def write_remote_code(folder: str | Path) -> dict[str, str]:
    """Write the entry module, the listing and the package's modules into `folder`; returns config.json's auto_map."""
    folder = Path(folder)
    table = {}
    for module, (source, is_package) in model_modules().items():
        table[module] = (flat_name(module, is_package), is_package)
        shutil.copyfile(source, folder / table[module][0])
    imports = "".join(f"    from .{file.removesuffix('.py')} import *  # noqa: F403\n" for file, _ in table.values())
    listing = (
        '"""The modules of the hybrid_attention package in this folder: {module: (file, is a package)}."""\n\n'
        "from typing import TYPE_CHECKING\n\n"
        f"MODULES = {pprint.pformat(table, width=120)}\n\n"
        "if TYPE_CHECKING:  # never run: transformers copies the files that relative imports name\n" + imports
    )
    (folder / f"{LISTING}.py").write_text(listing, encoding="utf-8")
    shutil.copyfile(Path(__file__).with_name("remote_entry.py"), folder / f"{ENTRY}.py")
    return {
        "AutoConfig": f"{ENTRY}.HybridAttentionConfig",
        "AutoModelForCausalLM": f"{ENTRY}.HybridAttentionForCausalLM",
    }
