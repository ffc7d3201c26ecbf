"""The package layout is the architecture: these tests keep its arrows pointing down.

Layers, bottom up: core (numpy + msgspec only) -> models (transformers config classes) ->
engines (transport, connector, offload, pool) -> integrations (vLLM) -> proofs, bench, testing -> cli.
Imports are read from the source (function-level ones included; `if TYPE_CHECKING:` blocks are
type hints, not imports), so a lazy import cannot hide a wrong arrow.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "kvbridge"

LAYERS = {  # first dotted part under kvbridge -> layer rank (lower may not import higher)
    "errors": 0, "_lazy": 0, "_version": 0, "core": 0,
    "models": 1,
    "transport": 2, "connector": 2, "offload": 2, "pool": 2, "routing": 2,
    "integrations": 3,
    "proofs": 4, "bench": 4, "testing": 4,
    "cli": 5, "__init__": 5,
}
# What the core may import from outside the standard library.
CORE_THIRD_PARTY = {"numpy", "msgspec"}
# Heavy or proof-only third-party packages the engines must not import.
NOT_IN_ENGINES = {"transformers", "safetensors"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] if len(parts) > 1 else parts
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, module: str, top_level_only: bool = False) -> set[str]:
    """Absolute names of the modules `path` imports."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST, depth: int) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub, depth)
                continue
            nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))
            if top_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".")
                    is_pkg = path.name == "__init__.py"
                    base = base[: len(base) - child.level + (1 if is_pkg else 0)]
                    name = ".".join(base + ([child.module] if child.module else []))
                else:
                    name = child.module or ""
                found.add(name)
                for alias in child.names:  # `from kvbridge.proofs import hf` imports kvbridge.proofs.hf
                    found.add(f"{name}.{alias.name}")
            visit(child, depth + (1 if nested else 0))

    visit(tree, 0)
    return found


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> tuple[str, int]:
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    return key, LAYERS[key]


def test_every_module_has_a_layer() -> None:
    unknown = sorted(m for m in MODULES if (m.split(".") + ["__init__"])[1] not in LAYERS)
    assert not unknown, f"modules outside the known layers: {unknown}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_arrows_point_down(module: str) -> None:
    key, rank = _layer(module)
    wrong = []
    for name in _imports(MODULES[module], module):
        root = name.split(".")[0]
        if root == "kvbridge":
            if name == "kvbridge" or name.split(".")[1] not in LAYERS:
                target_key, target_rank = "__init__", LAYERS["__init__"]
            else:
                target_key, target_rank = _layer(name)
            if target_key == key:
                continue
            if target_rank > rank:
                wrong.append(name)
        elif rank == 0 and root not in CORE_THIRD_PARTY and root not in sys.stdlib_module_names:
            wrong.append(name)
        elif rank in (2, 3) and root in NOT_IN_ENGINES:
            wrong.append(name)
    assert not wrong, f"{module} ({key}) imports {sorted(wrong)} against the layering"


def test_no_import_cycles() -> None:
    """Module-level imports between kvbridge modules form no cycle."""
    def ancestor(pkg: str, m: str) -> bool:  # importing a submodule runs its package first: not a cycle
        return m.startswith(pkg + ".")

    graph = {m: {i for i in _imports(p, m, top_level_only=True) if i in MODULES and i != m and not ancestor(i, m)}
             for m, p in MODULES.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                walk(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m)


def test_core_and_package_import_without_torch_or_numba() -> None:
    code = ("import sys, kvbridge, kvbridge.core.plan, kvbridge.core.topology, kvbridge.core.integrity, "
            "kvbridge.core.blocks, kvbridge.errors; "
            "print(','.join(m for m in ('torch', 'numba', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"the core pulled in {out.stdout.strip()}"


def test_long_files_say_why() -> None:
    """A file over ~500 lines states the reason in its docstring (a paragraph starting 'Length:')."""
    long = []
    for module, path in MODULES.items():
        lines = path.read_text().count("\n")
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > 520 and "Length:" not in doc:
            long.append(f"{module} ({lines} lines)")
    assert not long, f"files over 500 lines without a 'Length:' reason: {long}"
