"""A hook never assigns to its run, nor to the run's state but its own data. It reads the run and returns what it
changes (RunChanges), which the run applies in one place (PruneRun.apply_changes); what it keeps across steps and
sessions it writes in its own part of the state, `self.own(state)` (RunState.hooks[its name], in the checkpoint);
the mask transforms apply in one explicit order (engine.hooks.MASK_TRANSFORMS).

The first check reads engine/hooks/*.py with ast: in every function, the names that reach the run (a `run`
or `state` parameter, `self.run`, and whatever is bound from them: `r, c = self.run, self.run.config`, `reward =
run.ctx.reward`, `self.x = self.run.y`) may not be assignment targets' bases (`run.x = ...`, `r.ctx.steps += 1`,
`run.masks.measured[k] = ...`, `del run.x`), nor be handed to setattr/delattr, nor have a container's mutating
method called on them (`run.masks.measured.clear()`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

HOOKS = Path(__file__).resolve().parent.parent / "engine" / "hooks"
MUTATORS = {"append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault", "add",
            "discard", "__setitem__", "__delitem__", "__setattr__"}


def _reaches(node, names: set[str], self_names: set[str]) -> bool:
    """Is `node` the run or a part of it, read through attributes and subscripts (no calls)?"""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                and node.attr in self_names):
            return True
        node = node.value
    return isinstance(node, ast.Name) and node.id in names


def _targets(target):
    """The single targets of an assignment target (tuples and lists unpacked)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        for t in target.elts:
            yield from _targets(t)
    else:
        yield target


def _pairs(target, value):
    """(target, value) pairs of an assignment, a tuple of values spread over a tuple of targets."""
    if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
            and len(target.elts) == len(value.elts):
        for t, v in zip(target.elts, value.elts):
            yield from _pairs(t, v)
    else:
        yield target, value


def _self_aliases(cls: ast.ClassDef) -> set[str]:
    """The attributes of `self` that hold the run or a part of it: `run`, and any `self.x = <the run's part>`."""
    found, grew = {"run"}, True
    while grew:
        grew = False
        for node in ast.walk(cls):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    for t, v in _pairs(target, node.value):
                        if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                                and t.attr not in found and _reaches(v, set(), found)):
                            found.add(t.attr)
                            grew = True
    return found


def _function_offences(fn, self_names: set[str], where: str) -> list[str]:
    args = fn.args
    # the run, and the run's state a hook is handed: a hook writes only its own data, through self.own(state)
    names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs] if a.arg in ("run", "state")}
    body = [n for n in ast.walk(fn)]
    grew = True
    while grew:  # the aliases: names bound from the run or its parts (also by tuple assignment, `with ... as`)
        grew = False
        for node in body:
            pairs = []
            if isinstance(node, ast.Assign):
                pairs = [p for t in node.targets for p in _pairs(t, node.value)]
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                pairs = [(node.target, node.value)]
            for t, v in pairs:
                if isinstance(t, ast.Name) and t.id not in names and _reaches(v, names, self_names):
                    names.add(t.id)
                    grew = True
    out = []
    for node in body:
        targets = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in _targets(target)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = [t for target in node.targets for t in _targets(target)]
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in ("setattr", "delattr") and node.args \
                    and _reaches(node.args[0], names, self_names):
                out.append(f"{where}:{node.lineno} {ast.unparse(node)}")
            elif isinstance(f, ast.Attribute) and f.attr in MUTATORS and _reaches(f.value, names, self_names):
                out.append(f"{where}:{node.lineno} {ast.unparse(node)}")
        for t in targets:  # (`self.run = run` binds the hook's own attribute: what is assigned *to* must reach the run)
            t = t.value if isinstance(t, ast.Starred) else t
            if isinstance(t, (ast.Attribute, ast.Subscript)) and _reaches(t.value, names, self_names):
                out.append(f"{where}:{node.lineno} {ast.unparse(t)}")
    return out


def run_assignments(source: str, name: str = "<hook>") -> list[str]:
    """`file:line target` of every assignment to (or mutation of) the run or a part of it, in `source`."""
    tree = ast.parse(source)
    out = []
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    owner = {id(fn): cls for cls in classes for fn in ast.walk(cls) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            cls = owner.get(id(fn))
            if cls is not None and (cls.name, fn.name) == ("RunHook", "own"):  # (the one writer of a hook's data)
                continue
            self_names = _self_aliases(cls) if cls is not None else set()
            out += _function_offences(fn, self_names, name)
    return sorted(set(out), key=lambda s: (int(s.split(":")[1].split()[0]), s))


def test_no_hook_assigns_to_its_run():
    found = [x for path in sorted(HOOKS.glob("*.py")) for x in run_assignments(path.read_text(), path.name)]
    assert found == [], "hooks assign to their run (return RunChanges instead): " + "; ".join(found)


@pytest.mark.parametrize("source, expected", [
    ("class H:\n    def on_setup(self):\n        self.run.stages = 1\n", ["self.run.stages"]),
    ("class H:\n    def f(self):\n        run, c = self.run, self.run.config\n        run.ctx.steps = 3\n", ["run.ctx.steps"]),
    ("class H:\n    def f(self):\n        r = self.run\n        r.masks.measured = {}\n", ["r.masks.measured"]),
    ("class H:\n    def f(self):\n        self.run.ctx.steps += 1\n", ["self.run.ctx.steps"]),
    ("class H:\n    def f(self):\n        x: int = 0\n        self.run.ctx.steps: int = 1\n", ["self.run.ctx.steps"]),
    ("class H:\n    def f(self):\n        self.run.masks.measured[1] = 2\n", ["self.run.masks.measured[1]"]),
    ("class H:\n    def f(self):\n        setattr(self.run, 'steps', 3)\n", ["setattr(self.run, 'steps', 3)"]),
    ("class H:\n    def f(self):\n        c = self.run.config\n        c.steps = 3\n", ["c.steps"]),
    ("class H:\n    def f(self):\n        self.run.masks.measured.clear()\n", ["self.run.masks.measured.clear()"]),
    ("class H:\n    def g(self):\n        self.ctx = self.run.ctx\n    def f(self):\n        self.ctx.comp_means = None\n",
     ["self.ctx.comp_means"]),
    ("def share(run, x):\n    run.started = x\n", ["run.started"]),
    ("class H:\n    def f(self):\n        del self.run.stats_memo\n", ["self.run.stats_memo"]),
    # the state a hook is handed: only its own data, through self.own(state)
    ("class H:\n    def f(self, state):\n        state.best_step = 3\n", ["state.best_step"]),
    ("class H:\n    def f(self, state):\n        state.hooks['validation'] = {}\n", ["state.hooks['validation']"]),
    ("class H:\n    def f(self, state):\n        s = state.scores\n        s['heads'] = 0\n", ["s['heads']"]),
    ("class H:\n    def f(self, state):\n        state.method_state.update(x=1)\n", ["state.method_state.update(x=1)"]),
])
def test_the_check_sees_an_assignment_to_the_run(source, expected):
    assert [x.split(" ", 1)[1] for x in run_assignments(source)] == expected


def test_the_check_leaves_the_hook_its_own_data_and_the_step_report_it_is_handed():
    source = ("class H:\n    def f(self, state, report):\n        run = self.run\n        self.means = run.stats_memo\n"
              "        self.digest, self.unchanged = None, 0\n        self.own(state)['x'] = 3\n"
              "        self.own(state).update(y=1)\n        report.val_ppl = 1.0\n"
              "        self.step_times.append(1.0)\n        masks = run.hard_masks(state.scores)\n"
              "        masks['heads'] = 0\n        return RunChanges(steps=3)\n")
    assert run_assignments(source) == []


# --- what a hook reads: a read-only view of READS --------------------------------------------------------------------
def run_reads(source: str) -> set[str]:
    """The names read of the run itself (`self.run.x`, `run.x` for a `run` parameter or a name bound to the run)."""
    out = set()
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        names = {a.arg for a in fn.args.args if a.arg == "run"}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                names |= {t.id for target in node.targets for t, v in _pairs(target, node.value)
                          if isinstance(t, ast.Name) and _is_run(v, names)}
        out |= {node.attr for node in ast.walk(fn) if isinstance(node, ast.Attribute) and _is_run(node.value, names)}
    return out


def _is_run(node, names: set[str]) -> bool:
    return (isinstance(node, ast.Name) and node.id in names) or (
        isinstance(node, ast.Attribute) and node.attr == "run" and isinstance(node.value, ast.Name) and node.value.id == "self")


def test_every_name_a_hook_reads_of_its_run_is_in_its_view():
    from engine.hooks.view import READS

    read = {name for path in HOOKS.glob("*.py") for name in run_reads(path.read_text())}
    assert {"config", "log", "ctx", "hooks"} <= read  # (the check sees reads)
    assert read - READS == set(), "add these to engine/hooks/view.py's READS, or read them otherwise"
    assert run_reads("class H:\n    def f(self, run):\n        r, c = self.run, run.config\n        r.layout.x, c.y\n") == \
        {"config", "layout"}


def test_the_view_reads_through_to_the_run_and_refuses_assignment():
    from types import SimpleNamespace

    from engine.hooks import RunView

    res = SimpleNamespace(config="c", ctx=SimpleNamespace(steps=3), method="pg", loop=SimpleNamespace(plan={"a": 1}),
                          masks=SimpleNamespace(hard_masks="the masks' own"))
    view = RunView()
    view.bind(res)
    res.config = "changed"
    assert view.config == "changed" and view.ctx.steps == 3  # (read at the moment it is read: patched resources too)
    assert view.plan == {"a": 1} and view.hard_masks == "the masks' own"  # (the loop's state, the masks')
    for act in (lambda: setattr(view, "config", 1), lambda: delattr(view, "ctx"), lambda: view.method):
        with pytest.raises(AttributeError):
            act()
    assert res.config == "changed"


# --- the hooks' changes, applied by the run in one place -------------------------------------------------------------
def _fake_run(hooks=()):
    from types import SimpleNamespace

    from engine.run.loop import PruneRun

    run = SimpleNamespace(res=SimpleNamespace(ctx=SimpleNamespace(steps=10, comp_means="means"), hooks=list(hooks),
                                              loop=SimpleNamespace(stages=[(0, 0.3)], unit_metric="wanda-sp")))
    run.apply_changes = lambda changes: PruneRun.apply_changes(run, changes)
    run.call_hooks = lambda event, *args: PruneRun.call_hooks(run, event, *args)
    return run


def test_the_run_applies_every_field_of_a_hooks_changes_and_nothing_left_kept():
    from dataclasses import fields

    from engine.hooks import KEEP, RunChanges

    where = {"steps": lambda r: r.res.ctx.steps, "comp_means": lambda r: r.res.ctx.comp_means,
             "stages": lambda r: r.res.loop.stages, "unit_metric": lambda r: r.res.loop.unit_metric}
    assert {f.name for f in fields(RunChanges)} == set(where)  # (a new field needs a line in PruneRun.apply_changes)
    for name, read in where.items():
        run = _fake_run()
        before = {k: f(run) for k, f in where.items()}
        run.apply_changes(RunChanges(**{name: None}))  # (None is a value: no compensation means)
        assert read(run) is None and {k: f(run) for k, f in where.items() if k != name} == \
            {k: v for k, v in before.items() if k != name}
    run = _fake_run()
    run.apply_changes(RunChanges())
    run.apply_changes(None)
    assert [f(run) for f in where.values()] == [10, "means", [(0, 0.3)], "wanda-sp"]
    assert all(getattr(RunChanges(), f.name) is KEEP for f in fields(RunChanges))


def test_each_hooks_changes_reach_the_run_before_the_next_hook_is_called():
    from engine.hooks import RunChanges, RunHook, RunView

    seen = []

    class Plans(RunHook):
        def on_step(self, state, report):
            return RunChanges(steps=4)

    class Reads(RunHook):
        def on_step(self, state, report):
            seen.append(self.run.ctx.steps)

    run = _fake_run()
    view = RunView()
    view.bind(run.res)
    run.res.hooks = [Plans(view), Reads(view)]
    run.call_hooks("on_step", None, None)
    assert seen == [4] and run.res.ctx.steps == 4


def test_the_hooks_events_return_their_changes(tiny_path, small_eval_file):
    """random-progressive's stages and metric, and bias compensation's means, come back as RunChanges."""
    from types import SimpleNamespace

    from engine.hooks import BiasCompensation, ProgressiveSchedule, RunChanges
    from engine.algo.policy import progressive_stages

    config = SimpleNamespace(prune_ratio=0.3, steps=6, progressive_increment=0.1)
    assert ProgressiveSchedule(SimpleNamespace(config=config)).on_setup() == RunChanges(
        stages=progressive_stages(0.3, 6, 0.1), unit_metric="random")
    means = {"kv_groups": [torch.ones(2)], "channels": [torch.ones(3)], "layers": None}
    hook = BiasCompensation(SimpleNamespace(layout=SimpleNamespace(unit_types=["kv_groups", "channels"])))
    assert hook.on_resume(SimpleNamespace(input_means=means)).comp_means == {"kv_groups": means["kv_groups"], "channels": means["channels"]}
    assert hook.on_resume(SimpleNamespace(input_means=None)) == RunChanges(comp_means=None)


# --- the mask transforms: one ordered list -----------------------------------------------------------------------------
TRANSFORMS = ("hard_masks", "final_scores", "final_masks", "weights_for")


def _hook_classes():
    import inspect

    import engine.hooks as hooks
    from engine.hooks import RunHook

    return {cls for mod in vars(hooks).values() if inspect.ismodule(mod) and mod.__name__.startswith("engine.hooks.")
            for cls in vars(mod).values() if inspect.isclass(cls) and issubclass(cls, RunHook) and cls is not RunHook}


def test_every_hook_is_listed_once_and_every_transform_in_the_transforms_list():
    from engine.hooks import MASK_TRANSFORMS, RUN_HOOKS, RunHook

    classes = _hook_classes()
    assert len(classes) >= 10 and set(RUN_HOOKS) == classes and len(RUN_HOOKS) == len(set(RUN_HOOKS))
    overridden = {(name, cls) for cls in classes for name in TRANSFORMS if getattr(cls, name) is not getattr(RunHook, name)}
    assert set(MASK_TRANSFORMS) == overridden and len(MASK_TRANSFORMS) == len(overridden)


class _Recorder:
    """A fake hook whose transforms record their calls in `log`."""

    def __init__(self, name, log, edits=False):
        self.name, self.log, self.edits_weights = name, log, edits

    def hard_masks(self, masks, scores):
        self.log.append(("hard_masks", self.name))
        return masks

    def final_scores(self, state, scores):
        self.log.append(("final_scores", self.name))
        return scores

    def final_masks(self, masks, metric):
        self.log.append(("final_masks", self.name))
        return masks

    def weights_for(self, masks, comp_means):
        from contextlib import contextmanager

        @contextmanager
        def edited():
            self.log.append(("weights_for", self.name))
            yield f"{comp_means}+{self.name}"

        return edited()


@pytest.mark.parametrize("reverse", [False, True], ids=["as-listed", "reversed"])
def test_runmasks_applies_the_transforms_in_the_order_it_is_given(reverse):
    from types import SimpleNamespace

    from engine.run.masks import RunMasks

    log = []
    a, b = _Recorder("a", log), _Recorder("b", log, edits=True)
    order = [(t, h) for t in ("final_scores", "hard_masks", "final_masks", "weights_for") for h in ((b, a) if reverse else (a, b))]
    res = SimpleNamespace(config=SimpleNamespace(keep_ratio=0.5), budget=SimpleNamespace(hard_masks=lambda s, k: dict(s)),
                          ctx=SimpleNamespace(reward=SimpleNamespace(frozen=False)))
    masks = RunMasks(order).bind(res)
    masks.measured = {"before": 1.0}
    scores = masks.final_scores(None, {"kv_groups": torch.ones(2)})
    final = masks.final_masks(scores, None)
    with masks.weights(final) as comp_means:
        seen = dict(masks.measured)
    assert log == [(t, h.name) for t, h in order]  # (each point in the list's order; the points as the end of a run takes them)
    assert comp_means == ("KEEP+a+b" if not reverse else "KEEP+b+a")  # (the run's own comp_means, KEEP, through both)
    assert seen == {} and masks.measured == {"before": 1.0}  # (b edits the weights: the perplexities set aside, then back)


def test_a_run_applies_its_transforms_in_the_listed_order(tiny, tiny_path, small_eval_file, tmp_path, monkeypatch):
    """A run with every transform on (unit multiples, best-val, the time budget, within-layer ranking,
    reconstruction): from the
    method's final scores to the weights evaluated, the transforms are called in MASK_TRANSFORMS' order."""
    import engine.hooks as hooks
    from engine.run.loop import PruneRun

    from test_pruner import small_config

    calls = []
    for name, cls in hooks.MASK_TRANSFORMS:
        real = getattr(cls, name)

        def spy(self, *args, _real=real, _key=(name, cls)):
            calls.append(_key)
            return _real(self, *args)

        monkeypatch.setattr(cls, name, spy)
    config = small_config(tiny_path, small_eval_file, steps=2, val_every=1, unit_multiple={"channels": 4},
                          within_layer_ranking="init-metric", reconstruct=True, reconstruct_batches=2,
                          final_mask="best-val", time_budget=60.0)
    from engine.hooks.time_budget import TimeBudget  # (its transform joins; its step planning is not this test's)

    monkeypatch.setattr(TimeBudget, "on_start", lambda self, state: None)
    monkeypatch.setattr(TimeBudget, "on_step", lambda self, state, report: None)
    run = PruneRun(config, tmp_path / "r", model=tiny[0], tokenizer=tiny[1], log=lambda m: None)
    assert [type(h) for _, h in run.res.masks.transforms] == [cls for _, cls in hooks.MASK_TRANSFORMS]
    assert all(isinstance(h.run, hooks.RunView) for h in run.res.hooks)  # (what each hook holds: the read-only view)
    calls.clear()
    assert run.run(progress=False)["status"] == "done"
    start = calls.index(("final_scores", hooks.BestValFinal))
    end = calls.index(("weights_for", hooks.Reconstruction), start)
    assert calls[start:end + 1] == hooks.MASK_TRANSFORMS
