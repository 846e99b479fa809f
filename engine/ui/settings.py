"""The Prune page's form as data, and the small pure pieces of the app's pages (no Streamlit here).

The form is a dict of widget key -> value. `form_values` makes one from a run's config (so Runs' "Load into the
pages" and "Re-run with these settings" fill the form), `form_config` makes the run's PruneConfig from one, on
top of a base config that holds the settings the form does not show (a loaded run's, so a re-run reproduces
it). The widgets themselves are made from the settings' declarations (engine/settings/config.py) by the pages.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from ..settings.config import PRESETS, PruneConfig, default_run, default_run_values
from ..errors import UserError
from ..model.loading import DEFAULT_MODEL

# the run settings under "Hyperparameters": widgets made from their declarations in PruneConfig (key = field)
HYPERPARAMETERS = ("lr", "lr_schedule", "num_mask_samples", "batch_size", "seqlen", "prob_map", "eval_seqlen",
                   "init_batches", "bias_compensation", "seed", "val_every", "checkpoint_every", "reward",
                   "step_refit", "mix_refit")
# widget key -> PruneConfig field, for the widgets that show one field as it is
DIRECT = {"units": "units", "rate": "prune_ratio", "budget": "budget", "scope": "scope", "init": "init",
          "steps": "steps", "time_budget": "time_budget", "method": "method", "layer_init": "layer_init",
          **{h: h for h in HYPERPARAMETERS}}
SETTINGS_FILE = ".app-prune-settings.json"  # the last settings of the Prune page, beside the runs
APP_MAX_WINDOWS = 64  # the app evaluates on the first 64 windows unless told otherwise (all: 13 min for SmolLM2)


def option_key(method: str, name: str) -> str:
    """The widget key of a method's option (pages/_ui.option_widgets with key opt-METHOD)."""
    return f"opt-{method}-{name}"


def form_values(config: dict | PruneConfig) -> dict:
    """The Prune form's widget values that show this config (a config.json dict or a PruneConfig)."""
    from ..algo.methods import option_fields

    c = PruneConfig.from_dict(dict(config)) if isinstance(config, dict) else config
    values = {k: getattr(c, f) for k, f in DIRECT.items()}
    values["units"] = list(c.units)
    values["model_choice"] = "default" if c.model == DEFAULT_MODEL else "local"
    values["model_path"] = "" if c.model == DEFAULT_MODEL else c.model
    values["max_windows"] = c.max_windows or 0
    values["channel_multiple"] = int(c.unit_multiple.get("channels", 1))
    values["fixed_layers"] = c.layer_score_const == 1.0
    fields = option_fields(c.method)
    if fields:
        options = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory() for f in fields}
        options.update(c.method_options or {})
        values.update({option_key(c.method, k): v for k, v in options.items() if k in options})
    return values


def form_config(values: dict, base: dict | None = None) -> PruneConfig:
    """The PruneConfig the form's values describe, on top of `base` (a config dict: the settings the form does
    not show; when None, today's as the command line gives them to a run of these units, scope and budget: the
    default run's, engine/settings/config.py's default_run_values; not an old config's, which PruneConfig.from_dict would
    read into missing fields). Not validated (PruneConfig.validate says what is wrong)."""
    from ..algo.methods import option_fields

    data = dict(base) if base else PruneConfig(**default_run_values(
        values.get("units"), values.get("scope", "global"), values.get("budget", "params"))).to_dict()
    data.pop("method_options", None)
    for key, field in DIRECT.items():
        if key in values:
            data[field] = values[key]
    if values.get("model_choice", "default") == "default":
        data["model"] = DEFAULT_MODEL
    else:
        path = str(values.get("model_path") or "").strip()
        if not path:
            raise UserError("give the path of a local model folder or .gguf file")
        from .paths import app_path

        app_path(path, "the model path")  # (typed in the page: the runs folder or $PG_PRUNE_APP_FOLDERS only)
        data["model"] = path
    data["units"] = list(values.get("units", data.get("units", PruneConfig().units)))
    data["prune_ratio"] = float(data.get("prune_ratio", PruneConfig.prune_ratio))
    if data.get("time_budget") is not None:
        data["time_budget"] = float(data["time_budget"]) or None
    if "max_windows" in values:
        data["max_windows"] = int(values["max_windows"] or 0) or None
    multiple = dict((base or {}).get("unit_multiple") or {})
    multiple.pop("channels", None)
    n = int(values.get("channel_multiple", 1) or 1)
    if n > 1 and "channels" in data["units"]:
        multiple["channels"] = n
    data["unit_multiple"] = multiple
    if "fixed_layers" in values:  # the checkbox: c = 1 fixes the layers; unticked, a run's other c is kept
        fixed = data.get("layer_score_const") == 1.0
        data["layer_score_const"] = 1.0 if values["fixed_layers"] else (None if fixed else data.get("layer_score_const"))
    method = data.get("method", PruneConfig.method)
    names = [f.name for f in option_fields(method)]  # (its own fields by name: "opt-pg-" also begins pg-alloc's keys)
    options = {n: values[option_key(method, n)] for n in names if option_key(method, n) in values}
    if not options and base and base.get("method") == method:
        options = dict(base.get("method_options") or {})
    data["method_options"] = options
    return PruneConfig.from_dict(data)


def preset_values(name: str, method: str = "pg") -> dict:
    """The widget values a preset sets (engine/settings/config.py's PRESETS): its run settings and, for the options of
    `method` it names (e.g. pg's baseline), the option widgets and that method (the form's default run takes no
    steps: a preset of the steps' settings is a run that takes them)."""
    from ..algo.methods import option_fields

    preset, out = PRESETS[name], {}
    fields = {f.name for f in dataclasses.fields(PruneConfig)}
    options = {f.name for f in option_fields(method)}
    keys = {f: k for k, f in DIRECT.items()}
    for field, value in preset.items():
        if field == "layer_score_const":  # shown as the checkbox "fixed layers" (c = 1)
            out["fixed_layers"] = value == 1.0
        elif field in fields and field in keys:
            out[keys[field]] = value
        elif field in options:
            out[option_key(method, field)] = value
            out.setdefault("method", preset.get("method", method))  # (its options' method: the paper's are PG's)
    return out


def default_values() -> dict:
    """The form's values for a fresh run: the default run's (README command 1's, engine/settings/config.py's default_run),
    the options of every method with Options included."""
    from ..algo.methods import METHODS

    values = {**form_values(default_run()), "run_name": "", "max_windows": APP_MAX_WINDOWS}
    for name, cls in METHODS.items():
        if cls.Options is not None:
            for f in dataclasses.fields(cls.Options):
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                values.setdefault(option_key(name, f.name), default)
    return values


def valid_values(values: dict) -> dict:
    """The values a widget can still show: a saved choice that is no longer one (a registry changed, a file
    edited by hand) or a value of the wrong kind is dropped, so the widget takes its default."""
    from ..settings.fields import choices_of
    from ..algo.methods import METHODS
    from ..model.unit_types import UNIT_TYPES

    fields = {k: next(f for f in dataclasses.fields(PruneConfig) if f.name == field) for k, field in DIRECT.items()}
    for name, cls in METHODS.items():
        for f in dataclasses.fields(cls.Options) if cls.Options is not None else ():
            fields[option_key(name, f.name)] = f
    defaults, out = default_values(), {}
    for k, v in values.items():
        if k not in defaults:
            continue
        allowed = choices_of(fields[k]) if k in fields and k != "units" else None
        if allowed is not None and v not in allowed:
            continue
        if k == "units" and not (isinstance(v, list) and all(u in UNIT_TYPES for u in v)):
            continue
        d = defaults[k]
        if d is not None and v is not None and not isinstance(v, type(d)) and not (isinstance(d, float) and isinstance(v, int)):
            continue
        out[k] = float(v) if isinstance(d, float) and isinstance(v, int) and not isinstance(v, bool) else v
    return out


def save_settings(folder: str | Path, values: dict, base: dict | None, source: str | None = None) -> None:
    """The Prune page's last settings, beside the runs (a browser reload starts from them): the form's values,
    the base config of the settings it does not show, and the run they came from."""
    from ..storage.io import atomic_write_text

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = {"values": values, "base": base, "source": source}
    atomic_write_text(folder / SETTINGS_FILE, json.dumps(data, indent=1, default=str) + "\n")


def load_settings(folder: str | Path) -> tuple[dict, dict | None, str | None]:
    """(values, base, source) saved by save_settings; ({}, None, None) when there are none or they are
    unreadable. Values a widget could not show are dropped (valid_values)."""
    try:
        data = json.loads((Path(folder) / SETTINGS_FILE).read_text())
        values, base, source = data["values"], data.get("base"), data.get("source")
    except (OSError, ValueError, KeyError, TypeError):
        return {}, None, None
    values = valid_values(values) if isinstance(values, dict) else {}
    return values, (base if isinstance(base, dict) else None), (source if isinstance(source, str) else None)


# --- progress -----------------------------------------------------------------------------------------------
def seconds_per_step(history: list[dict], recent: int = 5) -> float | None:
    """The mean wall time of the last `recent` steps (one step alone jumps with validation steps)."""
    times = [r["seconds"] for r in history[-recent:] if isinstance(r.get("seconds"), (int, float))]
    return sum(times) / len(times) if times else None


def wall_seconds_per_step(history: list[dict], recent: int = 5) -> float | None:
    """The wall seconds between the last `recent` steps' reports as they arrived ("received", stamped by the app's
    job): the held-out checks, their refits and the checkpoints between steps included; None with fewer than two
    stamped reports."""
    stamps = [r["received"] for r in history[-(recent + 1):] if isinstance(r.get("received"), (int, float))]
    if len(stamps) < 2 or stamps[-1] <= stamps[0]:
        return None
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def eta_seconds(history: list[dict], total_steps: int, recent: int = 5, after: float = 0.0) -> float | None:
    """Seconds left for the steps not yet done at the recent rate between reports as they arrived (the checks
    and refits between steps included; the steps' own seconds where reports carry no arrival time), plus `after`
    (the plan's seconds for what follows the steps: the final evaluation, the export); None before the first step."""
    sps = wall_seconds_per_step(history, recent) or seconds_per_step(history, recent)
    if sps is None:
        return None
    return max(total_steps - history[-1]["step"], 0) * sps + after


# what a run does in each phase of its clock, as the progress line names it while that phase runs
PHASE_WORDS = {"validation": "a held-out check", "refit": "a refit", "evaluations": "an evaluation",
               "statistics": "the refit's statistics", "export": "the export", "init metric": "the init metric",
               "joint mix": "the joint mix", "calibration text": "sampling the calibration text"}


def running_phase_text(clock: dict | None, fmt=lambda s: f"{s:.0f} s") -> str | None:
    """The work running now between or after steps, named ("a held-out check running for 8 s"); None in the steps
    themselves or without a clock."""
    if not clock or clock.get("phase") in (None, "steps", "other", "load"):
        return None
    words = PHASE_WORDS.get(clock["phase"], clock["phase"])
    return f"{words} running for {fmt(clock.get('seconds') or 0.0)}"


def overrun_text(clock: dict | None, fmt=lambda s: f"{s:.0f} s", factor: float = 1.5, slack: float = 10.0) -> str | None:
    """The phase open now when it has run over its plan ("statistics: 5 min 20 s, 32x the plan"): past `factor`
    times its planned seconds and `slack` seconds beyond them; else None."""
    if not clock or not clock.get("planned"):
        return None
    seconds, planned = clock.get("seconds") or 0.0, clock["planned"]
    if seconds <= factor * planned or seconds - planned <= slack:
        return None
    ratio = seconds / planned
    return f"{clock['phase']}: {fmt(seconds)}, {ratio:.0f}× the plan" if ratio >= 10 else \
        f"{clock['phase']}: {fmt(seconds)}, {ratio:.1f}× the plan"


# --- runs side by side --------------------------------------------------------------------------------------
def setting_label(name: str) -> str:
    f = next((f for f in dataclasses.fields(PruneConfig) if f.name == name), None)
    return (f.metadata.get("label") if f is not None else None) or name.replace("_", " ")


# settings that do not change what a run computes (or that Compare sets apart on purpose)
_NOT_COMPARED = ("scope", "checkpoint_every", "checkpoint_minutes", "device")


def config_differences(a: dict, b: dict, ignore: tuple[str, ...] = _NOT_COMPARED) -> list[tuple[str, object, object]]:
    """(label, A's value, B's value) of every setting the two run configs differ in, but `ignore`'s. Configs of
    earlier versions are read as today's (PruneConfig.from_dict), so a field one of them lacks is its old value."""
    def norm(c):
        try:
            return PruneConfig.from_dict(dict(c)).to_dict()
        except UserError:
            return dict(c)

    x, y = norm(a), norm(b)
    out = []
    for name in [f.name for f in dataclasses.fields(PruneConfig)]:
        if name in ignore:
            continue
        va, vb = x.get(name), y.get(name)
        if isinstance(va, float) and isinstance(vb, float) and math.isclose(va, vb, rel_tol=1e-9):
            continue
        if va != vb:
            out.append((setting_label(name), va, vb))
    return out


def same_plan(a: dict, b: dict) -> bool:
    """Two runs that make a fair pair: same model, units, budget, rate and steps (the scope may differ)."""
    keys = ("model", "units", "budget", "steps", "method")
    if any(a.get(k) != b.get(k) for k in keys):
        return False
    return abs(float(a.get("prune_ratio", 0)) - float(b.get("prune_ratio", 0))) < 1e-9


# --- a run's masks per layer --------------------------------------------------------------------------------
def layer_rows(kept_fraction: dict[str, list[float]], sizes: dict[str, list[int]] | None = None) -> list[dict]:
    """One row per layer: whether the layer is kept, and the units of each type inside layers it keeps ("k/n"
    with `sizes`, the units per layer; else a percentage). A removed layer keeps none of its units.
    kept_fraction: unit type -> fraction kept per layer (a StepReport's kept_fraction; whole layers 0 or 1)."""
    from ..model.unit_types import UNIT_TYPES

    whole = [u for u in kept_fraction if u in UNIT_TYPES and UNIT_TYPES[u].whole_layer]
    n = max((len(v) for v in kept_fraction.values()), default=0)
    layer_kept = [x > 0.5 for x in kept_fraction[whole[0]]] if whole else [True] * n
    rows = []
    for i in range(n):
        row = {"layer": i, "layer kept": "kept" if layer_kept[i] else "removed"}
        for u, fractions in kept_fraction.items():
            if u in whole:
                continue
            title = UNIT_TYPES[u].title if u in UNIT_TYPES else u
            f = fractions[i] if layer_kept[i] else 0.0
            if sizes and u in sizes:
                row[title] = f"{int(round(f * sizes[u][i]))}/{sizes[u][i]}"
            else:
                row[title] = f"{f:.0%}"
        rows.append(row)
    return rows


def removed_layers(kept_fraction: dict[str, list[float]] | None) -> list[int]:
    """The layers a hard mask removes whole (none without whole-layer units)."""
    from ..model.unit_types import UNIT_TYPES

    for u, v in (kept_fraction or {}).items():
        if u in UNIT_TYPES and UNIT_TYPES[u].whole_layer:
            return [i for i, x in enumerate(v) if x <= 0.5]
    return []


def rows_csv(rows: list[dict]) -> str:
    """A list of dicts (same keys) as CSV text."""
    import csv
    import io

    if not rows:
        return ""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


# (the joint mix splits the budget between whole layers and widths: without layers there is no mix)
LAYER_SETTINGS = ("layer_init", "layer_init_batches", "layer_prob_map", "layer_score_const", "sleb_finalists",
                  "mix_batches", "mix_reward", "mix_refit", "mix_search", "mix_refine_batches")


def settings_table(config: dict) -> list[dict]:
    """A run's config as rows (setting label, value) for a table; method options as 'option of METHOD'. The
    settings of whole-layer pruning are left out of a run that prunes no whole layer (they did nothing there)."""
    from ..model.unit_types import UNIT_TYPES

    units = config.get("units") or []
    layers = any(UNIT_TYPES[u].whole_layer for u in units if u in UNIT_TYPES)
    rows = []
    for k, v in config.items():
        if k in LAYER_SETTINGS and not layers:
            continue
        if k == "method_options" and isinstance(v, dict):
            rows += [{"setting": f"{name} (option of {config.get('method')})", "value": _cell(x)} for name, x in v.items()]
        else:
            rows.append({"setting": setting_label(k), "value": _cell(v)})
    return rows


def _cell(v) -> str:
    if isinstance(v, (list, tuple)):
        return ", ".join(map(str, v))
    if isinstance(v, dict):
        return ", ".join(f"{k}={x}" for k, x in v.items()) or "—"
    return "—" if v is None else str(v)


# results.json's keys as the Results tab names them: (label, kind); a key not listed shows under its own name. A
# figure whose kind depends on the run's reward is named by it ("held-out", below): under --reward kl best-val's
# value is a mean KL in nats, never a perplexity.
RESULT_LABELS = {
    "ppl_dense": ("perplexity of the dense model (evaluation text)", "ppl"),
    "ppl_init": ("perplexity of the init mask", "ppl"),
    "ppl_pruned": ("perplexity of the pruned model", "ppl"),
    "best_val": ("best-val's held-out figure", "held-out"),
    "val_ppl_init": ("held-out perplexity of the init mask (calibration text)", "ppl"),
    "params_dense": ("parameters, dense", "count"),
    "params_pruned": ("parameters, pruned (the export)", "count"),
    "params_removed": ("parameters removed (the budget's count)", "count"),
    "peak_rss_mb": ("peak memory (resident)", "mb"),
    "seconds_per_step": ("seconds per step", "seconds"),
    "seconds_in_steps": ("seconds in the steps", "seconds"),
    "seconds_by_phase": ("wall seconds by phase", "phases"),
    "plan_seconds_by_phase": ("planned seconds by phase", "phases"),
    "time_budget": ("time budget", "minutes"),
    "mask_step": ("the step whose mask was exported (0: the init mask)", "int"),
}


def held_out_kind(metric: str | None) -> tuple[str, str]:
    """(what best-val's held-out figure is, its unit) by results.json's best_val metric: a perplexity ("perplexity",
    a ce run's), else the reward's mean on the held-out batches (kl: the mean KL from the dense model, nats a token)."""
    reward = metric
    if reward in (None, "ce", "perplexity"):
        return "held-out perplexity", ""
    return f"held-out mean {reward.upper()} from the dense model", " nats a token"


def fmt_result(kind: str, v, reward: str | None = None) -> str:
    """One results.json value as the Results tab shows it: rounded, with its unit; — for a missing one."""
    if v is None:
        return "—"
    if kind == "phases" and isinstance(v, dict):
        shown = [f"{k} {x:,.0f} s" for k, x in v.items() if k not in ("total", "other") and isinstance(x, (int, float))]
        total = v.get("total")
        return ", ".join(shown) + (f" (total {total:,.0f} s)" if isinstance(total, (int, float)) else "") or "—"
    if kind == "held-out" and isinstance(v, dict):  # results.json's best_val: {metric, value}
        reward, v = v.get("metric"), v.get("value")
        if v is None:
            return "—"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return _cell(v)
    if not math.isfinite(v):  # (a results.json edited by hand: shown as it is, never a crash)
        return str(v)
    if kind == "ppl":
        return f"{v:,.2f}"
    if kind == "held-out":
        return f"{v:,.4f}{held_out_kind(reward)[1]}" if reward not in (None, "ce", "perplexity") else f"{v:,.2f}"
    if kind == "count":
        return f"{int(v):,}"
    if kind == "mb":
        return f"{v / 1024:,.2f} GB" if v >= 1024 else f"{v:,.0f} MB"
    if kind == "seconds":
        return f"{v:,.1f} s"
    if kind == "minutes":
        return f"{v:g} min"
    if kind == "int":
        return f"{int(v)}"
    return f"{v:,.4g}"


def compensation_biases(results: dict) -> int | None:
    """The parameters the export adds back: removed (the budget's count) less dense − pruned. They are the output
    biases that FLAP's bias compensation writes into each kept layer's attention and MLP output projections (removed
    units' mean contribution); None when results.json lacks a count."""
    try:
        extra = int(results["params_removed"]) - (int(results["params_dense"]) - int(results["params_pruned"]))
    except (KeyError, TypeError, ValueError):
        return None
    return extra


def results_table(results: dict) -> list[dict]:
    """A run's results.json as rows (what, value) for a table: each figure named by its kind and unit (a KL is never
    labelled a perplexity), numbers rounded, the per-layer lists left to the masks table; after the counts, the
    compensation's biases that reconcile the removed count with dense − pruned."""
    reward = results.get("reward") if isinstance(results.get("reward"), str) else None
    rows = []
    for k, v in results.items():
        if k in ("kept_per_layer", "units_per_layer", "init_mix"):
            continue
        label, kind = RESULT_LABELS.get(k, (k.replace("_", " "), ""))
        if kind == "held-out":
            label = f"best-val's {held_out_kind(v.get('metric') if isinstance(v, dict) else reward)[0]}"
        elif kind == "" and isinstance(v, float):
            v = f"{v:.1%}" if k.startswith("removed_of") or k.startswith("width_removed") else f"{v:,.4g}"
        elif kind == "" and isinstance(v, int) and not isinstance(v, bool):
            v = f"{v:,}"
        rows.append({"result": label, "value": fmt_result(kind, v, reward) if kind else _cell(v)})
        if k == "params_removed" and (extra := compensation_biases(results)):
            rows.append({"result": "output biases the bias compensation adds (removed less these = dense − pruned)",
                         "value": f"{extra:,} (dense − pruned: "
                                  f"{int(results['params_dense']) - int(results['params_pruned']):,})"})
    return rows


def estimated_speedup(config: dict, results: dict | None) -> float | None:
    """A finished run's expected speed-up per token (engine/plan/forecast.py's speedup: dense over kept matrix parameters
    a token multiplies), from its model's config and the parameters it removed; None before it finished or when
    the model's config cannot be read."""
    from ..errors import UserError
    from ..plan.forecast import model_skeleton, speedup

    if not results or "params_removed" not in results or not config.get("model"):
        return None
    try:
        return speedup(model_skeleton(str(config["model"])), int(results["params_removed"]))
    except (UserError, OSError, ValueError, KeyError, ImportError):  # (ImportError: transformers' lazy import
        return None                                                   # raced by another thread; the cell shows —)


# --- the Runs table --------------------------------------------------------------------------------------------
MISSING = "—"  # the one mark of a value a run does not have (yet)


def fmt_params(n: int | None) -> str:
    if n is None:
        return MISSING
    return f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.0f} k"


def removed_short(results: dict | None) -> str:
    """What a run removed, for a table cell: "30.0 % of decoder" (— before it finished, or for a run from before the
    report)."""
    if not results or not isinstance(results.get("removed_of_decoder"), (int, float)):
        return MISSING
    return f"{results['removed_of_decoder']:.1%} of decoder"


def fmt_ppl(v) -> str:
    """A perplexity for a table cell: two decimals, — where there is none."""
    return f"{v:,.2f}" if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else MISSING


def runs_row(name: str, status: str, config: dict, results: dict | None, steps_done: int, modified: str,
             speedup: str) -> dict:
    """One run's row of the Runs table: its name first (two runs of the same settings read apart at any width),
    then what tells runs apart (status, rate, perplexity, parameters), then the rest; figures rounded, one mark for
    a missing value."""
    res = results or {}
    model = Path(str(config.get("model", ""))).name or MISSING
    return {
        "run": name, "status": status, "scope": config.get("scope") or MISSING, "rate": f"{config.get('prune_ratio', 0):.0%}",
        "ppl pruned": fmt_ppl(res.get("ppl_pruned")), "params": fmt_params(res.get("params_pruned")),
        "removed": removed_short(res), "speed-up": speedup, "steps": f"{steps_done}/{config.get('steps', MISSING)}", "model": model,
        "units": ",".join(config.get("units", [])) or MISSING, "budget": config.get("budget", "units"),
        "ppl dense": fmt_ppl(res.get("ppl_dense")), "modified": modified,
    }
