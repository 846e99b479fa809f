"""Streamlit glue shared by the pages: the job manager, the runs folder, cached chat models, run views.

Not a page itself (app.py lists the pages with st.navigation, so pages/ is not scanned).
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import streamlit as st  # noqa: E402

from engine.ui import figures  # noqa: E402
from engine.ui.jobs import (JobManager, RunInfo, default_runs_dir, head_mask_from_scores, list_runs,  # noqa: E402
                         read_metrics, run_head_mask)

RUN_KEY = "selected_run"
PLOT_CONFIG = {"displayModeBar": False}  # session state: the run folder loaded into the pages


@st.cache_resource
def job_manager() -> JobManager:
    """One job manager per server process: it survives reruns and browser reloads."""
    return JobManager()


def runs_dir() -> Path:
    return default_runs_dir()


def runs() -> list[RunInfo]:
    return list_runs(runs_dir())


def selected_run() -> str | None:
    path = st.session_state.get(RUN_KEY)
    if path and Path(path).is_dir():
        return path
    return None


def select_run(path: str | Path | None) -> None:
    st.session_state[RUN_KEY] = str(path) if path else None


def run_label(r: RunInfo) -> str:
    c = r.config
    ppl = f", ppl {r.results['ppl_pruned']:.1f}" if r.results else ""
    return f"{r.name}  [{c.get('scope')}, {c.get('prune_ratio', 0):.0%}, {r.status}{ppl}]"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "—"
    s = int(round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"


def fmt_params(n: int | None) -> str:
    if n is None:
        return "—"
    return f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.0f} k"


def removed_short(results: dict | None) -> str:
    """What a run removed, for a table cell: "30.0 % of decoder" (— before it finished, or for a run from
    before the report)."""
    if not results or "removed_of_decoder" not in results:
        return "—"
    return f"{results['removed_of_decoder']:.1%} of decoder"


def removal_text(results: dict | None) -> str | None:
    """What a finished run removed, in words: parameters, shares of the decoder and of the model, each unit
    type's part, and for runs that prune whole layers the mix (layers out, width cut in the layers kept)."""
    if not results or "params_removed" not in results:
        return None
    parts = ", ".join(f"{u} {fmt_params(n)}" for u, n in results.get("params_removed_by_unit_type", {}).items())
    text = (f"Removed {results['params_removed']:,} parameters: {results['removed_of_decoder']:.1%} of the decoder "
            f"layers, {results['removed_of_model']:.1%} of the whole model (embeddings and LM head are never pruned). "
            f"By unit type: {parts}.")
    if "layers" in results.get("params_removed_by_unit_type", {}) and len(results["params_removed_by_unit_type"]) > 1:
        text += (f" The mix: {results.get('layers_removed', 0)} whole layers removed, and "
                 f"{results.get('width_removed_of_kept_layers', 0):.1%} of the width of the layers kept.")
    return text


# --- a run's charts -----------------------------------------------------------------------------
def render_run(history: list[dict], config: dict, head_mask: list[list[int]] | None, results: dict | None,
               key: str) -> None:
    """Heatmap of KV groups, MLP channels and whole layers per layer, loss curves, and final results."""
    last = history[-1] if history else None
    if results and results.get("status") == "done":
        c1, c2, c3, c4 = st.columns(4)
        c1.metric("Dense perplexity", f"{results['ppl_dense']:.2f}")
        c2.metric(f"Init ({config.get('init')})", f"{results['ppl_init']:.2f}")
        c3.metric("Pruned perplexity", f"{results['ppl_pruned']:.2f}",
                  delta=f"{results['ppl_pruned'] - results['ppl_init']:+.2f} vs init", delta_color="inverse")
        c4.metric("Parameters", fmt_params(results["params_pruned"]),
                  delta=f"{results['params_pruned'] / results['params_dense'] - 1:+.1%}", delta_color="off")
        if removal_text(results):
            st.caption(removal_text(results))
    if last is None:
        st.info("No optimisation step yet: charts appear after the first step.")
        return
    heads, chans = last.get("head_scores"), last["mean_score"].get("channels")
    cols = st.columns(2) if heads and chans else [st.container()]
    if heads:
        if head_mask is None:
            head_mask = head_mask_from_scores(heads, config.get("scope", "global"), 1 - config.get("prune_ratio", 0.3))
        with cols[0]:
            st.plotly_chart(figures.heads_heatmap(heads, head_mask), key=f"{key}-heads", width="stretch", config=PLOT_CONFIG)
    if chans:
        with cols[-1]:
            st.plotly_chart(figures.channels_figure(chans, last["kept_fraction"].get("channels")),
                            key=f"{key}-channels", width="stretch", config=PLOT_CONFIG)
    layers = last["mean_score"].get("layers")
    if layers:
        st.plotly_chart(figures.layers_figure(layers, last["kept_fraction"].get("layers")), key=f"{key}-layers",
                        width="stretch", config=PLOT_CONFIG)
    st.plotly_chart(figures.loss_figure(history), key=f"{key}-loss", width="stretch", config=PLOT_CONFIG)


def render_disk_run(run_dir: str | Path, key: str) -> None:
    from engine.ui.jobs import read_run

    info = read_run(run_dir)
    if info is None:
        st.warning(f"{run_dir} holds no run")
        return
    st.caption(f"Run **{info.name}** — {info.status}, {info.steps_done}/{info.config.get('steps')} steps, "
               f"model `{info.config.get('model')}`")
    render_run(read_metrics(run_dir), info.config, run_head_mask(run_dir) if info.has_masks else None,
               info.results, key)


# --- chat models (loaded in the page's script run, never in a fragment tick) ----------------------
@st.cache_resource(max_entries=1, show_spinner="Loading the base model (SmolLM2 takes about 25 s)…")
def base_model(model_name: str, dtype: str):
    from engine.tools.chat import load_base

    return load_base(model_name, dtype)


@st.cache_resource(max_entries=2, show_spinner="Loading the sliced export…")
def sliced_model(run_dir: str, mtime: float):
    from engine.tools.chat import load_sliced

    return load_sliced(run_dir)


@st.cache_resource(max_entries=2, show_spinner="Loading the run's GGUF in llama.cpp (exporting it first if needed)…")
def gguf_model(run_dir: str, mtime: float):
    from engine.tools.chat import load_gguf

    return load_gguf(run_dir)


def run_figures_for_compare(info: RunInfo) -> dict[str, list[float]]:
    if info.results:
        return figures.kept_fractions_from_results(info.results)
    m = read_metrics(info.path)
    return m[-1]["kept_fraction"] if m else {}


def option_widgets(options_cls, defaults: dict | None = None, key: str | None = "opt", columns: int = 3,
                   names: tuple[str, ...] | None = None) -> dict:
    """One widget per field of a settings dataclass (a method's Options, or the run's PruneConfig: all fields, or
    `names`), made from the field's declaration: its label, help, choices and bounds (engine.fields.setting).
    Widget keys are KEY-FIELD (FIELD without a key). Returns {field: value}."""
    import dataclasses
    import typing

    from engine.fields import choices_of

    defaults, values = defaults or {}, {}
    hints = typing.get_type_hints(options_cls)
    cols = st.columns(columns)
    fields = [f for f in dataclasses.fields(options_cls) if names is None or f.name in names]
    for i, f in enumerate(fields):
        col, meta = cols[i % columns], f.metadata
        label = meta.get("label") or f.name.replace("_", " ").capitalize()
        default, choices, k = defaults.get(f.name, f.default), choices_of(f), f"{key}-{f.name}" if key else f.name
        kw = dict(help=meta.get("help") or None, key=k)
        if choices:
            values[f.name] = col.selectbox(label, list(choices), index=list(choices).index(default), **kw)
        elif hints[f.name] is bool:
            values[f.name] = col.checkbox(label, bool(default), **kw)
        elif hints[f.name] is int:
            values[f.name] = int(col.number_input(label, value=int(default), step=1, min_value=meta.get("minimum"),
                                                  max_value=meta.get("maximum"), **kw))
        elif hints[f.name] is float:
            values[f.name] = float(col.number_input(label, value=float(default), format="%.4g", **kw))
        else:
            values[f.name] = col.text_input(label, str(default), **kw)
    return values


def _field(cls, name: str):
    import dataclasses

    return next(f for f in dataclasses.fields(cls) if f.name == name)


def label_of(cls, name: str) -> str:
    """A setting's label, from its declaration."""
    return _field(cls, name).metadata.get("label") or name.replace("_", " ").capitalize()


def help_of(cls, name: str) -> str | None:
    """A setting's help, from its declaration (the CLI's --help says the same)."""
    return _field(cls, name).metadata.get("help") or None


def choices(cls, name: str) -> tuple:
    """A setting's choices, from its declaration (a registry's names as they are now)."""
    from engine.fields import choices_of

    return choices_of(_field(cls, name))
