"""The Compare page's pieces, as plain data (no Streamlit here).

    names = parse_names(query_params.get(URL_KEY))      # the runs picked, kept in the URL (?runs=a,b,c)
    order = merge_order(order, picked)                   # a new pick goes last: run A stays A
    rows = table_rows(runs, busy)                        # the picker's table: one row per run
    colours = run_colours(order)                         # one colour per run, in every chart
    differences(a.config, b.config)                      # the settings that differ and apply to both runs
    counterpart(a, runs), counterpart_problem(a, scope)  # run A's match in the other scope: one that exists, or
                                                         # why none can (a joint run has no uniform match)
    run_masks(info)                                      # a run's own masks (saved, else its last step's)
    mask_diff_rows(masks_a, masks_b)                     # per layer and unit type: kept by both, by A only, ...

Every number is the run's own: the parameters removed are results.json's params_removed (the budget's count,
the one Prune shows), the masks are masks.safetensors' (or the last step's report): none is derived here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Callable

from ..settings.config import PruneConfig
from ..errors import UserError
from ..algo.methods import METHODS, option_fields
from ..model.unit_types import UNIT_TYPES
from . import masks as M
from .jobs import RunInfo, read_metrics

URL_KEY = "runs"  # st.query_params key: the picked run folders' names, comma-separated, A first
PICK_KEY = "cmp_runs"  # session state: the picked names, A first (kept across pages: not a widget's key)
SEEN_KEY = "cmp_seen"  # session state: (table key, names) the picker's table held at the last run
RUNNING = "running"
# one colour per run: the picked order's (A, B, C, ...), the same in every chart (Tableau 10)
RUN_COLOURS = ("#4e79a7", "#e15759", "#59a14f", "#b07aa1", "#f28e2b", "#76b7b2", "#edc948", "#ff9da7",
               "#9c755f", "#bab0ac")
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


# --- the pick ---------------------------------------------------------------------------------------------
def parse_names(text: str | list | None) -> list[str]:
    """The URL's run names (comma-separated; a repeated ?runs= too), each once, in order."""
    parts = text if isinstance(text, list) else [text or ""]
    out = []
    for part in parts:
        for name in str(part).split(","):
            if (name := name.strip()) and name not in out:
                out.append(name)
    return out


def url_value(names: list[str]) -> str:
    return ",".join(names)


def merge_order(order: list[str], picked: list[str]) -> list[str]:
    """The picked names in the order they were picked: those already in `order` keep their place (run A stays
    A when a run is added or another dropped), new ones go last."""
    return [n for n in order if n in picked] + [n for n in picked if n not in order]


def default_pick(runs: list[RunInfo]) -> list[str]:
    """What Compare opens on with nothing picked: the newest finished global run (else the newest run) and a
    run that makes a fair pair with it in the other scope (else the next run)."""
    if not runs:
        return []
    done = [r for r in runs if r.results]
    a = next((r for r in done if r.config.get("scope") == "global"), None) or (done or runs)[0]
    match = counterpart(a, runs)
    b = match or next((r for r in done if r.name != a.name), None) or next((r for r in runs if r.name != a.name), None)
    return [a.name] + ([b.name] if b is not None else [])


def table_key(names: list[str]) -> str:
    """The picker table's widget key: one per set of runs on disk, so that a run that appears or goes makes a
    new table, seeded with the pick (a table's selection is row numbers, which a new run would shift)."""
    return "cmp_pick-" + hashlib.sha1("\0".join(sorted(names)).encode()).hexdigest()[:10]


def run_colours(names: list[str]) -> dict[str, str]:
    return {n: RUN_COLOURS[i % len(RUN_COLOURS)] for i, n in enumerate(names)}


def letter(i: int) -> str:
    return LETTERS[i] if i < len(LETTERS) else f"#{i + 1}"


# --- the table ----------------------------------------------------------------------------------------------
def run_status(info: RunInfo, busy: bool) -> str:
    """A run's status in words: running while this app's job writes it (its checkpoint would say "stopped")."""
    return RUNNING if busy else info.status


def params_removed(results: dict | None) -> int | None:
    """The parameters a finished run removed: results.json's params_removed (its budget's count; the Prune page's).
    A run from before that field: dense minus pruned. (The exported model's count, params_pruned, also holds the
    biases that bias compensation adds, so dense minus pruned is fewer.)"""
    if not results:
        return None
    if "params_removed" in results:
        return int(results["params_removed"])
    if "params_dense" in results and "params_pruned" in results:
        return int(results["params_dense"]) - int(results["params_pruned"])
    return None


def table_rows(runs: list[RunInfo], busy: Callable[[RunInfo], bool], speedup: Callable[[RunInfo], float | None]
               = lambda r: None) -> list[dict]:
    """One row per run for the picker (numbers stay numbers, so that the table sorts them; None: not known)."""
    rows = []
    for r in runs:
        c, res = r.config, r.results or {}
        rows.append({  # the key columns first, so that they fit a 1400 px window
            "run": r.name, "status": run_status(r, busy(r)), "scope": c.get("scope"), "rate": c.get("prune_ratio"),
            "removed": params_removed(r.results), "ppl pruned": res.get("ppl_pruned"), "speed-up": speedup(r),
            "of decoder": res.get("removed_of_decoder"), "ppl dense": res.get("ppl_dense"),
            "ppl init": res.get("ppl_init"), "steps": f"{r.steps_done}/{c.get('steps')}", "method": c.get("method"),
            "units": ",".join(c.get("units") or []) or None, "budget": c.get("budget"),
        })
    return rows


# --- settings that differ ------------------------------------------------------------------------------------
def _layers(c: PruneConfig) -> bool:
    return any(UNIT_TYPES[u].whole_layer for u in c.units if u in UNIT_TYPES)


def _widths(c: PruneConfig) -> bool:
    return any(not UNIT_TYPES[u].whole_layer for u in c.units if u in UNIT_TYPES)


def _optimises(c: PruneConfig) -> bool:
    return c.method in METHODS and METHODS[c.method].optimises


def _refits(c: PruneConfig) -> bool:
    return c.reconstruct and _widths(c)


def _self_text(c: PruneConfig) -> bool:
    from ..data.calib_sources import source_of

    return source_of(c) != "data"


# when a setting applies to a run (any setting not named here always does): a difference in a setting that one
# of the two runs does not use says nothing, and the settings that make it so (units, method, ...) are named
APPLIES: dict[str, Callable[[PruneConfig], bool]] = {
    "init": _widths, "prob_map": _widths, "init_batches": _widths, "bias_compensation": _widths,
    "within_layer_ranking": _widths, "unit_multiple": _widths,
    "score_const": lambda c: _widths(c) and c.prob_map == "score-const",
    "progressive_increment": lambda c: c.init == "random-progressive",
    "layer_init": _layers, "layer_prob_map": _layers, "layer_init_batches": _layers,
    "layer_score_const": lambda c: _layers(c) and c.layer_prob_map == "score-const",
    "sleb_finalists": lambda c: _layers(c) and c.layer_init == "sleb",
    "prob_temperature": lambda c: (_widths(c) and c.prob_map == "sigmoid-cut")
    or (_layers(c) and c.layer_prob_map == "sigmoid-cut"),
    # the joint method: whole layers and widths on one budget
    "mix_batches": lambda c: _layers(c) and _widths(c), "mix_search": lambda c: _layers(c) and _widths(c),
    "mix_refine_batches": lambda c: _layers(c) and _widths(c),
    "mix_refit": lambda c: _layers(c) and _widths(c) and c.reconstruct,
    "reconstruct": _widths, "reconstruct_batches": _refits, "refit_stream": _refits, "reconstruct_ridge": _refits,
    "self_docs": _self_text, "self_tokens": _self_text, "self_temperature": _self_text,
    # the optimisation's own
    "steps": _optimises, "time_budget": _optimises, "lr": _optimises, "lr_schedule": _optimises,
    "num_mask_samples": _optimises, "sample_forward": _optimises, "val_every": _optimises,
    "early_stop": _optimises, "final_mask": _optimises,
    "val_batches": lambda c: c.validates, "best_val_margin": lambda c: c.validates and c.final_mask == "best-val",
    "val_refit": lambda c: c.validates and _refits(c),
    "step_refit": lambda c: _optimises(c) and _refits(c),
}
# a method's option that serves another one's choice only: (method, option) -> when it applies
OPTION_APPLIES: dict[tuple[str, str], Callable[[dict], bool]] = {
    ("pg", "baseline_window"): lambda o: o.get("baseline") == "moving-average",
}
NOT_COMPARED = ("scope", "checkpoint_every", "checkpoint_minutes", "device")  # Compare sets scope apart on purpose


def _config(c: dict) -> PruneConfig | None:
    try:
        return PruneConfig.from_dict(dict(c))
    except (UserError, TypeError, ValueError):
        return None


def _differ(va, vb) -> bool:
    if isinstance(va, float) and isinstance(vb, float):
        return not math.isclose(va, vb, rel_tol=1e-9)
    return va != vb


def differences(a: dict, b: dict, ignore: tuple[str, ...] = NOT_COMPARED) -> list[tuple[str, object, object]]:
    """(label, A's value, B's value) of each setting the two run configs differ in and that applies to both runs
    (APPLIES); a method's options only between runs of one method, each option apart ("pg: Baseline")."""
    from .settings import setting_label

    x, y = _config(a), _config(b)
    if x is None or y is None:  # a config today's fields cannot read: every field as it is
        from .settings import config_differences

        return config_differences(a, b, ignore)
    out = []
    for f in dataclasses.fields(PruneConfig):
        name = f.name
        if name in ignore or name == "method_options":
            continue
        applies = APPLIES.get(name)
        if applies is not None and not (applies(x) and applies(y)):
            continue
        va, vb = getattr(x, name), getattr(y, name)
        if _differ(va, vb):
            out.append((setting_label(name), va, vb))
    if x.method == y.method:
        out += _option_differences(x.method, x.method_options or {}, y.method_options or {})
    return out


def _option_differences(method: str, a: dict, b: dict) -> list[tuple[str, object, object]]:
    fields = {f.name: f for f in option_fields(method)}
    defaults = {n: f.default for n, f in fields.items() if f.default is not dataclasses.MISSING}
    oa, ob = {**defaults, **a}, {**defaults, **b}
    out = []
    for name in sorted(set(oa) | set(ob), key=lambda n: list(fields).index(n) if n in fields else len(fields)):
        applies = OPTION_APPLIES.get((method, name))
        if applies is not None and not (applies(oa) and applies(ob)):
            continue
        if _differ(oa.get(name), ob.get(name)):
            label = (fields[name].metadata.get("label") if name in fields else None) or name.replace("_", " ")
            out.append((f"{method}: {label}", oa.get(name), ob.get(name)))
    return out


# --- run A's match in the other scope ------------------------------------------------------------------------
def other_scope(scope: str | None) -> str:
    return "uniform" if scope == "global" else "global"


def same_plan(a: dict, b: dict) -> bool:
    """Two runs that make a fair pair: same model, units, budget, rate, steps and method (the scope may differ)."""
    from .settings import same_plan as plan

    return plan(a, b)


def matching_config(config: dict, results: dict | None, scope: str) -> dict:
    """Run A's settings in the other scope, on the same parameter budget (UserError: none can be known yet)."""
    if config.get("budget", "units") == "params":
        return {**config, "scope": scope}
    if not results or "removed_of_decoder" not in results:
        raise UserError("run A counted units (budget units) and has not finished: the share of parameters it "
                        "removes is not known yet; wait for it to finish, or start the other scope on Prune under "
                        "the parameter budget")
    return {**config, "scope": scope, "budget": "params", "prune_ratio": round(results["removed_of_decoder"], 6)}


def counterpart_problem(a: RunInfo, scope: str) -> str | None:
    """Why no run of run A's settings can exist in `scope`, in the page's words (None: one can). The run's own
    validation decides (engine.settings.config): a joint run, whole layers and widths on one parameter budget, exists only
    in global scope."""
    from ..algo.budget import scope_problem

    try:
        wanted = matching_config(a.config, a.results, scope)
    except UserError as e:
        return str(e)
    units = [u for u in wanted.get("units") or [] if u in UNIT_TYPES]
    if wanted.get("budget") == "params" and scope_problem(units, scope) is not None:
        return (f"whole layers and widths on one parameter budget (a joint run) exist only in global scope: "
                f"{scope} removes the same fraction of every layer, and a layer is removed whole")
    try:
        PruneConfig.from_dict(wanted).validate()
    except UserError as e:
        return str(e)
    return None


def counterpart(a: RunInfo, runs: list[RunInfo]) -> RunInfo | None:
    """A run on disk (finished, stopped or running) that is run A's match in the other scope: the same plan, or
    the settings matching_config would start. The newest such run; None when there is none."""
    scope = other_scope(a.config.get("scope"))
    try:
        wanted = matching_config(a.config, a.results, scope)
    except UserError:
        wanted = None
    for r in runs:
        if r.name == a.name or r.damaged or r.config.get("scope") != scope:
            continue
        if same_plan(r.config, a.config) or (wanted is not None and same_plan(r.config, wanted)):
            return r
    return None


# --- curves -----------------------------------------------------------------------------------------------
def curves(history: list[dict], results: dict | None = None) -> dict[str, list]:
    """A run's calibration loss per step (the mean over its mask samples) and its held-out perplexity per
    validation step (the init mask's at step 0, when results.json has it)."""
    steps, loss = [], []
    for r in history:
        losses = [x for x in r.get("losses") or [] if isinstance(x, (int, float)) and math.isfinite(x)]
        if losses:
            steps.append(r["step"])
            loss.append(sum(losses) / len(losses))
    val = [(r["step"], r["val_ppl"]) for r in history if isinstance(r.get("val_ppl"), (int, float))]
    if results and isinstance(results.get("val_ppl_init"), (int, float)):
        val = [(0, results["val_ppl_init"])] + [v for v in val if v[0] != 0]
    return {"steps": steps, "loss": loss, "val_steps": [v[0] for v in val], "val_ppl": [v[1] for v in val]}


def curves_figure(runs: list[tuple[str, str, dict[str, list]]]):
    """Calibration loss (left) and held-out perplexity (right) per step, one line per run in its colour.
    runs: (label, colour, curves())."""
    from plotly.subplots import make_subplots

    from .figures import _layout

    fig = make_subplots(rows=1, cols=2, subplot_titles=["Calibration loss (sample mean)", "Held-out perplexity"],
                        horizontal_spacing=0.12)
    for label, colour, cv in runs:
        fig.add_scatter(x=cv["steps"], y=cv["loss"], name=label, mode="lines+markers", line=dict(color=colour, width=2),
                        marker=dict(size=5),
                        legendgroup=label, row=1, col=1, hovertemplate="step %{x}: loss %{y:.3f}<extra>" + label + "</extra>")
        fig.add_scatter(x=cv["val_steps"], y=cv["val_ppl"], name=label, mode="lines+markers", showlegend=not cv["steps"],
                        line=dict(color=colour, width=2), marker=dict(size=7, symbol="diamond"), legendgroup=label,
                        row=1, col=2, hovertemplate="step %{x}: held-out ppl %{y:.2f}<extra>" + label + "</extra>")
    fig.update_xaxes(title="step", tickformat="d", rangemode="tozero")
    fig.update_yaxes(title="loss", row=1, col=1)
    fig.update_yaxes(title="perplexity", row=1, col=2)
    return _layout(fig, "Loss and held-out curves<br><sup>loss: the mean over a step's mask samples; held-out: "
                        "the hard mask's perplexity on validation steps (step 0: the init mask)</sup>", height=440)


# --- masks ------------------------------------------------------------------------------------------------
def run_masks(info: RunInfo) -> tuple[str, dict[str, list[list[int]]]] | None:
    """(which mask, unit type -> per layer 0/1) of a run: its saved final mask (masks.safetensors), else its last
    step's (metrics.jsonl); None when it has neither."""
    if info.results:
        final = next((v for v in M.saved_views(info.path, info.results) if v.name == M.FINAL), None)
        if final is not None:
            return final.label, final.masks
    history = read_metrics(info.path)
    view = M.current_view(history[-1]) if history else None
    return (view.label, view.masks) if view is not None else None


def mask_diff_problem(a: dict[str, list[list[int]]], b: dict[str, list[list[int]]]) -> str | None:
    """Why two runs' masks cannot be compared unit by unit (None: they can): one model's units on both sides."""
    common = [u for u in a if u in b]
    if not common:
        return "the two runs prune no unit type in common"
    for u in common:
        if [len(r) for r in a[u]] != [len(r) for r in b[u]]:
            return f"their {UNIT_TYPES[u].title if u in UNIT_TYPES else u} differ in number (two models)"
    return None


def _unit_order(types) -> list[str]:
    order = list(UNIT_TYPES)
    return sorted(types, key=lambda u: order.index(u) if u in order else len(order))


def mask_diff_rows(a: dict[str, list[list[int]]], b: dict[str, list[list[int]]]) -> list[dict]:
    """Per layer and unit type both runs prune: units kept by both, by A only, by B only, removed by both. A layer
    one run removes whole keeps none of its units there."""
    def in_kept_layers(masks):
        whole = next((u for u in masks if u in UNIT_TYPES and UNIT_TYPES[u].whole_layer), None)
        if whole is None:
            return masks
        kept = [bool(r and r[0]) for r in masks[whole]]
        return {u: rows if u == whole else [row if kept[i] else [0] * len(row) for i, row in enumerate(rows)]
                for u, rows in masks.items()}

    a, b = in_kept_layers(a), in_kept_layers(b)
    rows = []
    for u in _unit_order([u for u in a if u in b]):
        title = UNIT_TYPES[u].title if u in UNIT_TYPES else u
        for i, (ra, rb) in enumerate(zip(a[u], b[u])):
            pairs = list(zip(ra, rb))
            rows.append({"layer": i, "unit type": title, "units": len(pairs),
                         "A keeps": sum(x for x, _ in pairs), "B keeps": sum(y for _, y in pairs),
                         "both keep": sum(1 for x, y in pairs if x and y), "A only": sum(1 for x, y in pairs if x and not y),
                         "B only": sum(1 for x, y in pairs if y and not x),
                         "both remove": sum(1 for x, y in pairs if not x and not y)})
    return rows


BOTH_KEEP, BOTH_REMOVE = "#d9e6f2", "#595959"


def mask_diff_figure(a: dict[str, list[list[int]]], b: dict[str, list[list[int]]], colour_a: str, colour_b: str,
                     unit_type: str):
    """One unit type's units, layer by layer (rows, the first on top): kept by both, by A only (A's colour), by B
    only (B's colour), removed by both."""
    import plotly.graph_objects as go

    from .figures import _layout

    rows_a, rows_b = a[unit_type], b[unit_type]
    width = max((len(r) for r in rows_a), default=0)
    code = lambda x, y: 3 if x and y else 2 if x else 1 if y else 0  # noqa: E731
    z = [[code(x, y) for x, y in zip(ra, rb)] + [None] * (width - len(ra)) for ra, rb in zip(rows_a, rows_b)]
    words = {3: "kept by both", 2: "A only", 1: "B only", 0: "removed by both"}
    scale = [[0, BOTH_REMOVE], [0.25, BOTH_REMOVE], [0.25, colour_b], [0.5, colour_b], [0.5, colour_a],
             [0.75, colour_a], [0.75, BOTH_KEEP], [1, BOTH_KEEP]]
    ys = [f"L{i}" for i in range(len(z))]
    fig = go.Figure(go.Heatmap(z=z, y=ys, zmin=-0.5, zmax=3.5, colorscale=scale, xgap=1 if width <= 64 else 0, ygap=2,
                               text=[[words.get(v, "") for v in row] for row in z],
                               colorbar=dict(tickvals=[0, 1, 2, 3], ticktext=[words[k] for k in range(4)],
                                             thickness=12),
                               hovertemplate="%{y}, unit %{x}: %{text}<extra></extra>"))
    fig.update_yaxes(range=[len(z) - 0.5, -0.5], title="layer")
    fig.update_xaxes(title="unit")
    title = UNIT_TYPES[unit_type].title if unit_type in UNIT_TYPES else unit_type
    n = sum(1 for row in z for v in row if v in (1, 2))
    return _layout(fig, f"{title}: A's mask against B's<br><sup>{n} unit{'s' if n != 1 else ''} differ</sup>",
                   height=min(max(260, 130 + 22 * len(z)), 820))


def kept_fractions(info: RunInfo) -> dict[str, list[float]]:
    """A run's kept fraction per layer (a removed layer's units counted removed): results.json's counts, else
    its last step's."""
    from .figures import effective_kept, kept_fractions_from_results

    if info.results:
        return kept_fractions_from_results(info.results)
    history = read_metrics(info.path)
    return effective_kept(history[-1]["kept_fraction"]) if history else {}
