"""The package's layering: no stage imports a later one.

``pulsar.core`` and the neutral modules (``utils``, ``errors``, ``ui``, ``context``) sit below every
stage and import no stage; then config < frontend < quant < compiler < runtime, each importing only
itself and what is below it. The entry points at the top (``cli``, ``api``, ``preflight``, ``recompile``, the
package ``__init__`` / ``__main__``) may import anything. Every import counts: module level, inside
functions and under ``if TYPE_CHECKING``; ``import pulsar.x``, ``from pulsar.x import y``,
``from pulsar import x`` and relative imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pulsar

ROOT = Path(pulsar.__file__).parent

NEUTRAL = ("core", "utils", "errors", "ui", "context", "plugins")
STAGES = ("config", "frontend", "quant", "compiler", "runtime", "evaluation")
TOP = ("cli", "api", "preflight", "recompile", "search", "__init__", "__main__")
ROOT_CONSTANTS = ("pulsar.__version__",)  # set by pulsar/__init__.py itself, which imports nothing eagerly
RANK = {**dict.fromkeys(NEUTRAL, 0), **{s: i + 1 for i, s in enumerate(STAGES)}}
ORDER = " < ".join([", ".join(NEUTRAL), *STAGES])


def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of every pulsar import anywhere in ``tree``, in the order ``ast.walk`` meets
    them; ``from pulsar import x`` gives ``pulsar.x`` (a subpackage or an attribute of the root)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package.split(".")
                target = ".".join(base[: len(base) - node.level + 1] + ([target] if target else []))
            if target == "pulsar":
                found += [(node.lineno, f"pulsar.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, target))
    return [(line, name) for line, name in found if name == "pulsar" or name.startswith("pulsar.")]


def _layer(dotted: str, root: Path) -> str:
    """``pulsar.quant.samples`` -> ``quant``; the package root and its attributes (``pulsar.build``) -> ``__init__``."""
    parts = dotted.split(".")
    if len(parts) == 1 or not ((root / parts[1]).is_dir() or (root / f"{parts[1]}.py").is_file()):
        return "__init__"
    return parts[1]


def violations(root: Path = ROOT) -> list[str]:
    """One line per import that breaks the layering: ``file:line: <layer> imports <module> (why)``."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        module = _module(path, root)
        own = _layer(module, root)
        if own in TOP:
            continue
        assert own in RANK, f"{path}: a module of no known layer; add it to NEUTRAL or STAGES in {__file__}"
        where = path.relative_to(root.parent)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, name in imported(tree, module, path.name == "__init__.py"):
            target = _layer(name, root)
            if target == own or name in ROOT_CONSTANTS:
                continue
            if target in TOP:
                bad.append(f"{where}:{line}: {own} imports {name} (an entry point)")
            elif target not in RANK:
                bad.append(f"{where}:{line}: {own} imports {name} (a module of no known layer)")
            elif RANK[target] > RANK[own]:
                bad.append(f"{where}:{line}: {own} imports {name} ({'a stage' if RANK[own] == 0 else 'a later stage'})")
    return sorted(bad)


def test_no_stage_imports_a_later_one() -> None:
    bad = violations()
    assert not bad, f"layering ({ORDER}; entry points {', '.join(TOP)} on top) broken by:\n" + "\n".join(bad)


def test_every_kind_of_import_is_seen() -> None:
    src = ("import pulsar.runtime.session\nfrom pulsar.compiler import package\nfrom pulsar import api\n"
           "import numpy, pulsar.ui\n"
           "def f():\n    from ..runtime import io\n    from . import sibling\n    from .x import y\n"
           "    if True:\n        from .. import core\n")
    got = {n for _, n in imported(ast.parse(src), "pulsar.quant.samples", False)}
    assert got == {"pulsar.runtime.session", "pulsar.compiler", "pulsar.api", "pulsar.ui", "pulsar.runtime",
                   "pulsar.quant", "pulsar.quant.x", "pulsar.core"}
    assert {n for _, n in imported(ast.parse("from .. import core\n"), "pulsar.quant", True)} == {"pulsar.core"}
    assert {n for _, n in imported(ast.parse("from . import fixedpoint\n"), "pulsar.core", True)} == {"pulsar.core"}


def test_a_broken_layering_names_file_and_line(tmp_path: Path) -> None:
    root = tmp_path / "pulsar"
    files = {
        "__init__.py": "__version__ = '0'\ndef __getattr__(name): ...\n",
        "api.py": "from pulsar.runtime import run\n",
        "core/__init__.py": "",
        "core/fine.py": "from pulsar import __version__\nfrom pulsar.utils import x\nfrom . import fine\n",
        "core/bad.py": "import os\n\ndef f():\n    from pulsar.compiler.package import load\n",
        "utils.py": "from pulsar import build\n",
        "quant/__init__.py": "",
        "quant/samples.py": "from ..runtime.io import read_inputs\nfrom pulsar.frontend import graph\n",
        "frontend/__init__.py": "",
        "compiler/__init__.py": "",
        "runtime/__init__.py": "from pulsar.compiler import package\nfrom pulsar.config import x\n",
        "config/__init__.py": "",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert violations(root) == [
        "pulsar/core/bad.py:4: core imports pulsar.compiler.package (a stage)",
        "pulsar/quant/samples.py:1: quant imports pulsar.runtime.io (a later stage)",
        "pulsar/utils.py:1: utils imports pulsar.build (an entry point)",
    ]


if __name__ == "__main__":
    print("\n".join(violations()))
