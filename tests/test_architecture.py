"""The engine's layering, checked on its import statements (docs/architecture.md draws it).

Each rule names what a package may not import; the imports are read with ast, so an import inside a
function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parent.parent / "engine"


def module_name(path: Path) -> str:
    parts = path.relative_to(ENGINE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Absolute names of every module this file imports at run time (relative imports resolved)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(block)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:  # annotations only: never imported at run time
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # `from . import x` imports module x
    return out


MODULES = {module_name(p): imports(p) for p in ENGINE.rglob("*.py")}


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def offenders(importers: str, forbidden: tuple[str, ...], allowed_importers: tuple[str, ...] = ()) -> list[str]:
    return sorted(f"{m} imports {i}" for m, deps in MODULES.items() if under(m, importers)
                  and not any(under(m, a) for a in allowed_importers)
                  for i in deps if any(under(i, f) for f in forbidden))


def test_the_rules_see_the_engine():
    assert {"engine.pruner", "engine.methods.pg", "engine.arch.llama", "engine.unit_types.kv_groups",
            "engine.metrics.wanda_sp", "engine.tools.chat", "engine.ui.jobs"} <= set(MODULES)
    assert "engine.masking" in MODULES["engine.methods.pg"]  # relative imports are resolved


@pytest.mark.parametrize("importers, forbidden, allowed", [
    # the exported modeling file travels alone with every export: torch and transformers only
    ("engine.modeling_pruned", ("engine",), ()),
    # registries know nothing of the run that uses them, nor of the CLI, the tools or the app
    ("engine.methods", ("engine.pruner", "engine.cli", "engine.config", "engine.tools", "engine.ui"), ()),
    ("engine.metrics", ("engine.pruner", "engine.cli", "engine.config", "engine.methods", "engine.tools", "engine.ui"), ()),
    ("engine.unit_types", ("engine.pruner", "engine.cli", "engine.config", "engine.masking", "engine.metrics",
                           "engine.methods", "engine.export", "engine.tools", "engine.ui"), ()),
    ("engine.arch", ("engine.pruner", "engine.cli", "engine.config", "engine.masking", "engine.unit_types",
                     "engine.metrics", "engine.methods", "engine.tools", "engine.ui"), ("engine.arch.base",)),
    ("engine.exporters", ("engine.pruner", "engine.cli", "engine.tools", "engine.ui"), ()),
    # the engine never reaches up into its side tools or the app's services (the CLI dispatches to tools)
    ("engine", ("engine.tools",), ("engine.tools", "engine.cli", "engine.ui")),
    ("engine", ("engine.ui",), ("engine.ui",)),
    # nothing in the engine draws or talks to Streamlit
    ("engine", ("streamlit",), ()),
])
def test_layering(importers, forbidden, allowed):
    assert offenders(importers, forbidden, allowed) == []


def test_arch_base_reaches_the_unit_types_only_to_list_their_sizes():
    # ModelAdapter.unit_sizes() is a convenience over the unit-type registry, imported lazily
    assert offenders("engine.arch.base", ("engine.unit_types",)) == ["engine.arch.base imports engine.unit_types",
                                                                     "engine.arch.base imports engine.unit_types.UNIT_TYPES"]
