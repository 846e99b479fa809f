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


def imports(path: Path, typing_too: bool = False) -> set[str]:
    """Absolute names of every module this file imports at run time (relative imports resolved); typing_too:
    the imports under `if TYPE_CHECKING:` (annotations only) as well."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(block)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only and not typing_too:  # annotations only: never imported at run time
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
WITH_TYPES = {module_name(p): imports(p, typing_too=True) for p in ENGINE.rglob("*.py")}  # (type-only imports too)


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def offenders(importers: str, forbidden: tuple[str, ...], allowed_importers: tuple[str, ...] = ()) -> list[str]:
    return sorted(f"{m} imports {i}" for m, deps in MODULES.items() if under(m, importers)
                  and not any(under(m, a) for a in allowed_importers)
                  for i in deps if any(under(i, f) for f in forbidden))


def test_the_rules_see_the_engine():
    assert {"engine.run.loop", "engine.algo.methods.pg", "engine.model.arch.llama", "engine.model.unit_types.kv_groups",
            "engine.algo.metrics.wanda_sp", "engine.tools.chat", "engine.ui.jobs"} <= set(MODULES)
    assert "engine.algo.policy" in MODULES["engine.algo.methods.pg"]  # relative imports are resolved


@pytest.mark.parametrize("importers, forbidden, allowed", [
    # the exported modeling file travels alone with every export: torch and transformers only
    ("engine.model.modeling_pruned", ("engine",), ()),
    # registries know nothing of the run that uses them, nor of the CLI, the tools or the app
    ("engine.algo.methods", ("engine.run.loop", "engine.cli", "engine.settings.config", "engine.tools", "engine.ui"), ()),
    ("engine.algo.metrics", ("engine.run.loop", "engine.cli", "engine.settings.config", "engine.algo.methods",
                             "engine.tools", "engine.ui"), ()),
    ("engine.model.unit_types", ("engine.run.loop", "engine.cli", "engine.settings.config", "engine.model.masking",
                                 "engine.algo.metrics", "engine.algo.methods", "engine.export", "engine.tools",
                                 "engine.ui"), ()),
    ("engine.model.arch", ("engine.run.loop", "engine.cli", "engine.settings.config", "engine.model.masking",
                           "engine.model.unit_types", "engine.algo.metrics", "engine.algo.methods", "engine.tools",
                           "engine.ui"), ("engine.model.arch.base",)),
    ("engine.export", ("engine.run.loop", "engine.cli", "engine.tools", "engine.ui"), ()),
    # the settings depend on the registries they offer choices from, never on the run, its hooks, the loader or what
    # writes files
    ("engine.settings", ("engine.run", "engine.hooks", "engine.model.loading", "engine.export", "engine.plan",
                         "engine.cli", "engine.api", "engine.tools", "engine.ui"), ()),
    # the algorithms never reach the run (the joint mix scored on the run's model is engine/run/mix.py)
    ("engine.algo", ("engine.run", "engine.hooks", "engine.cli", "engine.api", "engine.tools", "engine.ui"), ()),
    # the engine never reaches up into its side tools or the app's services (the CLI dispatches to tools)
    ("engine", ("engine.tools",), ("engine.tools", "engine.cli", "engine.ui")),
    ("engine", ("engine.ui",), ("engine.ui",)),
    # nothing in the engine draws or talks to Streamlit
    ("engine", ("streamlit",), ()),
])
def test_layering(importers, forbidden, allowed):
    assert offenders(importers, forbidden, allowed) == []


def test_the_adapter_never_reaches_up_to_the_unit_types():
    # unit_types.unit_sizes(adapter) lists the units: the adapter answers structural questions only
    assert offenders("engine.model.arch", ("engine.model.unit_types",)) == []


# --- issue 23: no import cycles, nothing low reaching up ---------------------------------------------------------
def _graph(modules: dict[str, set[str]] = MODULES) -> dict[str, set[str]]:
    """Module -> the engine modules it imports (an imported name collapses to the module that holds it)."""
    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return name

    return {m: {owner(i) for i in deps if owner(i) and owner(i) != m} for m, deps in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    # no allow-list: every cycle (registry packages <-> their entries, arch <-> unit_types, loading <-> rundir) is gone
    cycles = import_cycles(_graph())
    assert cycles == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_import_cycles_counting_type_only_imports():
    # (a module that names another in its annotations alone still depends on it: the run's modules take
    # engine/run/resources.py's RunResources, never the loop, so no circle runs through engine/run/loop.py)
    cycles = import_cycles(_graph(WITH_TYPES))
    assert cycles == [], "import cycles with the type-only imports: " + "; ".join(" <-> ".join(c) for c in cycles)


# the modules that start a run: they build the loop and call it (every other module takes RunResources, RunState or
# less: engine/run/resources.py)
STARTS_RUNS = {"engine.run.loop", "engine.cli", "engine.api", "engine.ui.jobs", "engine.tools.model_copy"}


def test_only_the_loop_and_the_front_ends_that_start_runs_import_prunerun():
    importers = {m for m, deps in WITH_TYPES.items() if "engine.run.loop.PruneRun" in deps}
    assert importers - STARTS_RUNS == set(), "these modules name the loop; take engine.run.resources' RunResources"
    assert "engine.ui.jobs" in importers  # (the check sees an import inside a function)


def test_the_type_only_check_sees_an_annotation_import():
    base = ENGINE / "hooks" / "base.py"  # (its RunState is named under `if TYPE_CHECKING:` alone)
    assert "engine.run.state.RunState" in imports(base, typing_too=True)
    assert "engine.run.state.RunState" not in imports(base)


def test_the_cycle_check_sees_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# the leaves import nothing of the engine but other leaves; the loader, registries and exporters never reach the run
LEAVES = ("engine.errors", "engine.storage.io", "engine.settings.fields", "engine.run.files", "engine.storage.outdir",
          "engine.algo.policy", "engine.settings.registry")


@pytest.mark.parametrize("importers, forbidden", [
    *[(leaf, tuple(m for m in MODULES if m.startswith("engine.") and m not in LEAVES and m != leaf  # (a package
                   and not any(x.startswith(m + ".") for x in LEAVES))) for leaf in LEAVES],  # above a leaf: its modules)
    ("engine.model.loading", ("engine.run.folder", "engine.settings.config", "engine.run.loop", "engine.algo.budget", "engine.hooks")),
    ("engine.export", ("engine.run.folder", "engine.settings.config", "engine.hooks", "engine.algo.budget")),
    ("engine.algo.methods", ("engine.hooks", "engine.run.checkpoints", "engine.run.initialise", "engine.run.results", "engine.run.masks")),
    ("engine.hooks", ("engine.run.loop", "engine.cli", "engine.settings.config", "engine.tools", "engine.ui")),
])
def test_nothing_low_imports_something_higher(importers, forbidden):
    assert offenders(importers, forbidden) == []


# --- issue 23: a run loop that never branches on an option's name (issue 52 dropped the class-size cap: the code met
# it by packing assignments into tuples, not by splitting classes) ---------------------------------------------
# the names a run's options choose between: a method, an estimator, a baseline, a schedule, a final mask
_OPTION_NAMES = {"pg", "gumbel", "metric", "paper", "sqrt", "moving-average", "leave-one-out", "none", "cosine",
                 "constant", "last", "best-val", "random-progressive", "init-metric", "scores"}
RUN_LOOP = ("engine/run/loop.py", "engine/run/initialise.py", "engine/run/masks.py", "engine/run/checkpoints.py", "engine/run/results.py")


def _string_branches(path: Path) -> list[str]:
    """`if`/conditional expressions in path that compare something with one of the option names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            for sub in ast.walk(node.test):
                if isinstance(sub, ast.Constant) and sub.value in _OPTION_NAMES:
                    found.append(f"{path.name}:{node.lineno} ({sub.value!r})")
    return found


def test_the_run_loop_never_branches_on_an_option_name():
    assert [b for f in RUN_LOOP for b in _string_branches(ENGINE.parent / f)] == []


def test_the_branch_check_sees_a_branch(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('if config.final_mask == "best-val":\n    pass\nx = 1 if c.baseline == "none" else 2\n')
    assert _string_branches(probe) == ["probe.py:1 ('best-val')", "probe.py:3 ('none')"]


def _assigned_loop_fields(path: Path) -> set[str]:
    """The LoopState fields a module assigns (`x.loop.FIELD = ...`, tuple targets too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Attribute) and e.value.attr == "loop":
                    out.add(e.attr)
                elif isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "loop":
                    out.add(e.attr)
    return out


def test_only_the_loop_sets_the_loop_state_and_the_resources_are_frozen():
    """LoopState's stages and widths' metric change only where the loop applies a hook's RunChanges, its plan and
    progress only in the loop; the init's statistics memo lives in initialise's fresh_state alone. RunResources
    refuses an assignment."""
    import dataclasses

    from engine.run.resources import LoopState, RunResources

    by_module = {module_name(p): _assigned_loop_fields(p) for p in ENGINE.rglob("*.py")}
    setters = {m: f for m, f in by_module.items() if f}
    assert setters == {"engine.run.loop": {"stages", "unit_metric", "progress", "plan", "plan_steps"},
                       "engine.run.initialise": {"stats_memo"}}
    assert {f.name for f in dataclasses.fields(LoopState)} == {"stages", "unit_metric", "progress", "plan",
                                                                "plan_steps", "stats_memo"}
    res = RunResources(**{f.name: None for f in dataclasses.fields(RunResources)})
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.model = "another"
