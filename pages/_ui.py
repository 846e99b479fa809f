"""Streamlit glue shared by the pages: the job manager, the runs folder, cached chat models, run views.

Not a page itself (app.py lists the pages with st.navigation, so pages/ is not scanned).
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st  # noqa: E402
# transformers' lazy attributes, resolved once here, when the first page imports this module: resolved for the first
# time from two script threads at once, they can fail ("cannot import name 'AutoConfig'")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402, F401

from engine.run.phases import phase_line  # noqa: E402
from engine.ui import figures  # noqa: E402
from engine.ui import masks as M  # noqa: E402
from engine.ui.jobs import JobManager, RunInfo, default_runs_dir, list_runs, read_metrics  # noqa: E402
from engine.ui.paths import URL_RUN_KEY, run_from_url  # noqa: E402

RUN_KEY = "selected_run"
PLOT_CONFIG = {"displayModeBar": False}  # session state: the run folder loaded into the pages


@st.cache_resource
def job_manager() -> JobManager:
    """One job manager per server process: it survives reruns and browser reloads."""
    return JobManager()


def warm_up(chat):
    from engine.tools.chat import warm_up as warm

    return warm(chat)


@st.cache_resource
def recover_jobs():
    """One recovery thread per server process (engine/ui/recover_job.py), beside the pruning job."""
    from engine.ui.recover_job import RecoverJobs

    return RecoverJobs()


def runs_dir() -> Path:
    return default_runs_dir()


def runs() -> list[RunInfo]:
    return list_runs(runs_dir())


def damaged_runs_notice() -> None:
    """One warning naming the runs whose files the pages cannot read, with the reason (none: nothing shown)."""
    bad = [r for r in runs() if r.damaged]
    if bad:
        st.warning(f"{len(bad)} damaged run{'s' if len(bad) > 1 else ''} in the runs folder (listed on **Runs**, shown "
                   "nowhere else): " + "; ".join(f"**{r.name}**: {r.damaged}" for r in bad), icon=":material/report:")


def selected_run() -> str | None:
    """The run the pages show: the session's, else (a reload, a shared link) the URL's ?run=NAME; kept in the URL."""
    path = st.session_state.get(RUN_KEY)
    if not path and RUN_KEY not in st.session_state:  # (a run unloaded in this session stays unloaded)
        found = run_from_url(st.query_params.get(URL_RUN_KEY), runs_dir())
        path = st.session_state[RUN_KEY] = str(found) if found else None
    if path and Path(path).is_dir():
        keep_run_in_url(path)
        return path
    return None


def select_run(path: str | Path | None) -> None:
    st.session_state[RUN_KEY] = str(path) if path else None
    keep_run_in_url(path)


def keep_run_in_url(path: str | Path | None) -> None:
    name = Path(path).name if path and Path(path).parent == runs_dir() else None
    if name is None:
        if URL_RUN_KEY in st.query_params:
            del st.query_params[URL_RUN_KEY]
    elif st.query_params.get(URL_RUN_KEY) != name:
        st.query_params[URL_RUN_KEY] = name


def run_label(r: RunInfo) -> str:
    c = r.config
    if r.damaged:
        return f"{r.name}  [damaged: {r.damaged}]"
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


def fmt_duration(s: float) -> str:
    """A duration for a metric card (a narrow column): seconds under a minute, then whole minutes, then hours."""
    s = int(round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600 - 30:
        return f"{round(s / 60)} min"
    m = round(s / 60)
    return f"{m // 60} h {m % 60:02d}"


from engine.ui.settings import fmt_params, removed_short  # noqa: E402,F401  (the pages' names)


def speedup_short(config: dict, results: dict | None) -> str:
    """A run's estimated speed-up per token, for a table cell: "1.40× est." (— before it finished)."""
    from engine.ui.settings import estimated_speedup

    x = estimated_speedup(config, results)
    return "—" if x is None else f"{x:.2f}× est."


def removal_text(results: dict | None) -> str | None:
    """What a finished run removed, in words: parameters, shares of the decoder and of the model, each unit
    type's part, and for runs that prune whole layers the mix (layers out, width cut in the layers kept)."""
    if not results or "params_removed" not in results:
        return None
    parts = ", ".join(f"{u} {fmt_params(n)}" for u, n in results.get("params_removed_by_unit_type", {}).items())
    text = (f"Removed {results['params_removed']:,} parameters: {results['removed_of_decoder']:.1%} of the decoder "
            f"layers, {results['removed_of_model']:.1%} of the whole model (embeddings and LM head are never pruned). "
            f"By unit type: {parts}.")
    from engine.ui.settings import compensation_biases

    if extra := compensation_biases(results):  # (removed ≠ dense − pruned: say why)
        text += (f" The export adds back {extra:,} output biases (the bias compensation), so the model is "
                 f"{int(results['params_dense']) - int(results['params_pruned']):,} parameters smaller than the dense one.")
    if "layers" in results.get("params_removed_by_unit_type", {}) and len(results["params_removed_by_unit_type"]) > 1:
        text += (f" The mix: {results.get('layers_removed', 0)} whole layers removed, and "
                 f"{results.get('width_removed_of_kept_layers', 0):.1%} of the width of the layers kept.")
    return text


# --- a run's time: its plan against what it measured -------------------------------------------------
def plan_table(plan: dict, actual: dict, key: str) -> None:
    """The plan the run started with beside the seconds it measured, per phase (both computed by the engine:
    engine/run/plan.py's plan_rows), in an expander."""
    from engine.run.plan import plan_rows

    rows = [{"phase": k, "planned": fmt_seconds(p), "measured": fmt_seconds(a),
             "measured / planned": f"{a / p:.2f}" if p and p >= 1 else "—"} for k, p, a in plan_rows(plan, actual)]
    with st.expander(f"Time: planned {fmt_seconds(plan.get('total'))}, measured {fmt_seconds(actual.get('total'))}"):
        st.dataframe(rows, hide_index=True, width="stretch", key=f"plan-{key}")
        st.caption("The plan is the engine's cost model at Start (docs/app.md, “Plan against actual”): forward "
                   "tokens per phase times this machine's measured seconds per token, plus loading and the export.")


def preparing_text(snap) -> str:
    """A job before its first step: the phase open now by the run's own clock, its time so far, and by the plan
    the run started with its time left and the run's; then the last message the run logged."""
    import time

    c = snap.clock
    if not c:  # (the model is being loaded: the run and its plan do not exist yet)
        return f"preparing · {fmt_seconds(time.time() - (snap.started_at or time.time()))} · {snap.phase}"
    from engine.ui.settings import overrun_text

    parts = [f"{c['phase']} for {fmt_seconds(c['seconds'])}"]
    if over := overrun_text(c, fmt_seconds):  # (a phase over its plan says so, and by how much)
        parts.append(f"over the plan ({over.split(', ', 1)[1]}; planned {fmt_seconds(c['planned'])})")
    elif c.get("planned") is not None:
        parts.append(f"planned {fmt_seconds(c['planned'])}, about {fmt_seconds(c['phase_left'])} left")
    if c.get("run_left") is not None:
        parts.append(f"ETA of the run {fmt_seconds(c['run_left'])} by the plan")
    return "preparing · " + " · ".join(parts) + f" · {snap.phase}"


def planned_fraction(snap) -> float:
    """A job's share done by the plan it started with (0 until the run has one)."""
    c, plan = snap.clock, snap.plan or {}
    if not c or c.get("run_left") is None or not plan.get("total"):
        return 0.0
    return min(max(1.0 - c["run_left"] / plan["total"], 0.0), 1.0)


def too_few_steps_text(config, times) -> str | None:
    """Under a time budget whose plan fits fewer steps than pay (engine/hooks/time_budget.py's MIN_STEPS): what
    the run will do instead, said before Start; None otherwise."""
    from engine.hooks.time_budget import MIN_STEPS, too_few_line
    from engine.algo.methods import METHODS

    fit = times.steps_fit
    optimises = METHODS[config.method].optimises if config.method in METHODS else True
    if not config.time_budget or fit is None or not optimises or fit >= min(MIN_STEPS, config.steps):
        return None
    line = too_few_line(fit, 60.0 * config.time_budget)
    return line[0].upper() + line[1:] + "."


def memory_text(results: dict) -> str | None:
    """The run's measured peak memory beside the plan's estimate (results.json), or None without the peak."""
    peak, plan = results.get("peak_rss_mb"), results.get("plan_memory_mb")
    if not isinstance(peak, (int, float)) or peak <= 0:
        return None
    text = f"Memory: peak {peak * 2**20 / 1e9:.2f} GB resident (the process's maximum RSS)"
    if isinstance(plan, (int, float)) and plan > 0:
        text += (f"; the plan estimated {plan * 2**20 / 1e9:.2f} GB ({peak / plan:.2f}× the plan: the plan counts the weights, "
                 "the largest forward's activations, the refit's moments and the KL targets, not the allocator's slack)")
    return text


def reduced_text(results: dict) -> str | None:
    """What the time budget cut from the run's settings (results.json's "reduced"), as the run's log says it."""
    from engine.run.results import reduced_line

    if not (isinstance(reduced := results.get("reduced"), dict) and reduced):
        return None
    try:
        line = reduced_line(reduced)
    except (TypeError, IndexError, KeyError):  # (a results.json edited by hand: said nothing, never a crash)
        return None
    return line[0].upper() + line[1:]


# --- a run's charts -----------------------------------------------------------------------------
def render_run(history: list[dict], config: dict, views: list[M.MaskView], results: dict | None,
               key: str, run_dir: str | Path | None = None) -> None:
    """Heatmap of KV groups, MLP channels and whole layers per layer, loss curves, and final results; layers
    removed whole are grey in every chart. `views`: the masks the run computed or saved (engine/ui/masks.py; none
    is derived here), one shown at a time. Below: the shown masks per layer as a table, and their downloads."""
    from engine.ui.settings import layer_rows, removed_layers

    last = history[-1] if history else None
    if results and results.get("status") == "done":
        c1, c2, c3, c4 = st.columns(4)
        c1.metric("Dense perplexity", f"{results['ppl_dense']:.2f}")
        init = results.get("ppl_init")  # (None: not evaluated, --time-budget without --eval-init)
        c2.metric(f"Init ({config.get('init')})", f"{init:.2f}" if init is not None else "not evaluated")
        c3.metric("Pruned perplexity", f"{results['ppl_pruned']:.2f}", delta_color="inverse",
                  delta=f"{results['ppl_pruned'] - init:+.2f} vs init" if init is not None else None)
        c4.metric("Parameters", fmt_params(results["params_pruned"]),
                  delta=f"{results['params_pruned'] / results['params_dense'] - 1:+.1%}", delta_color="off")
        if removal_text(results):
            st.caption(removal_text(results))
        if (refit := results.get("reconstruction") or {}).get("skipped"):
            st.caption(f"Least-squares reconstruction skipped: {refit['skipped']}")
        elif refit:
            before = f"{refit['ppl_before']:.2f} with the mask alone, " if "ppl_before" in refit else ""
            st.caption(f"Least-squares reconstruction: {before}{results['ppl_pruned']:.2f} with the kept columns refit "
                       f"({refit['batches']} batches)")
        if phases := results.get("seconds_by_phase"):  # (runs made before it have none)
            st.caption("W" + phase_line(phases)[1:])  # "Wall time 533 s: load 11, ..."
            if plan := results.get("plan_seconds_by_phase"):  # (the plan the run started with, beside it)
                plan_table(plan, phases, key)
        if line := reduced_text(results):
            st.caption(line)
        if line := memory_text(results):
            st.caption(line)
        if run_dir is not None:
            deploy_panel(run_dir, key)
            recover_panel(run_dir, key)
    if last is None and not views:
        st.info("No optimisation step yet: charts appear after the first step.")
        return
    view = None
    if views:
        by_name = {v.name: v for v in views}
        if len(views) > 1:  # (a key per run and set of masks: a new run, or a run that finished, opens on the first)
            which = f"{Path(run_dir).name if run_dir else ''}-{'-'.join(by_name)}"
            chosen = st.radio("Mask shown", list(by_name), format_func=lambda n: by_name[n].label, horizontal=True,
                              key=f"{key}-mask-view-{which}",
                              help="final: the mask the run saved (masks.safetensors), with the scores it was taken "
                                   "from; current: the hard mask the last step computed under the run's budget; "
                                   "init: the mask the init perplexity measured.")
            view = by_name.get(chosen, views[0])
        else:
            view = views[0]
            st.caption(f"Mask shown: {view.label}")
    if results and (source := M.mask_source(results)):
        st.caption(source)
    if view is not None:
        kept = figures.effective_kept(M.kept_fractions(view.masks))
        heads, head_mask, means = view.head_scores, view.head_masks, view.mean_score
    else:  # a run whose step reports predate their masks: the scores, without a mask
        kept, heads, head_mask, means = figures.effective_kept(last["kept_fraction"]), last.get("head_scores"), None, \
            last["mean_score"]
        st.caption("This run's step reports carry no masks (written before they did): the heatmap shows the scores "
                   "only.")
    removed = removed_layers(kept)
    chans = means.get("channels")
    cols = st.columns(2) if heads and chans else [st.container()]
    which = view.label.split(" (")[0] if view is not None else ""
    if heads:
        with cols[0]:
            st.plotly_chart(figures.heads_heatmap(heads, head_mask, removed=removed, which=which), key=f"{key}-heads",
                            width="stretch", config=PLOT_CONFIG)
    if chans:
        with cols[-1]:
            st.plotly_chart(figures.channels_figure(chans, kept.get("channels"), removed=removed),
                            key=f"{key}-channels", width="stretch", config=PLOT_CONFIG)
    if layers := means.get("layers"):
        st.plotly_chart(figures.layers_figure(layers, kept.get("layers")), key=f"{key}-layers",
                        width="stretch", config=PLOT_CONFIG)
    if history:
        st.plotly_chart(figures.loss_figure(history, reward=config.get("reward", "ce")), key=f"{key}-loss",
                        width="stretch", config=PLOT_CONFIG)
    sizes = {u: [len(r) for r in rows] for u, rows in view.masks.items()} if view is not None else None
    rows = layer_rows(kept, sizes)
    title = f"Masks per layer ({view.label})" if view is not None else "Kept per layer"
    with st.expander(title + ": kept KV groups, channels, layers"):
        st.dataframe(rows, hide_index=True, width="stretch", key=f"{key}-layer-table")
        download_masks(rows, view, run_dir, key)


def recover_panel(run_dir: str | Path, key: str) -> None:
    """Recover a finished run: its export trained for some minutes into RUN/recover, with recover's defaults (as
    `prune --recover MINUTES` does), the loss drawn live while it runs; Chat then talks to all three models."""
    from engine.errors import UserError
    from engine.tools.chat import recovered_folder
    from engine.tools.recover import recovery_words

    run_dir = Path(run_dir)
    if not (run_dir / "model" / "config.json").is_file():
        return
    jobs = recover_jobs()
    box = st.container(border=True)
    box.markdown(f"**Recover** · the pruned model {recovery_words()}, merged")
    snap = jobs.snapshot()
    mine = snap.run_dir == str(run_dir)
    c1, c2 = box.columns([1, 2])
    minutes = c1.number_input("Minutes", min_value=0.1, max_value=600.0, value=5.0, step=1.0, key=f"{key}-recover-min",
                              help="Wall minutes of training (recover --time-budget); the evaluation before and after "
                                   "comes on top.")
    if snap.active and mine:
        if c2.button("Stop the recovery", icon=":material/stop:", key=f"{key}-recover-stop"):
            jobs.stop()
            st.rerun()
    elif c2.button("Recover", icon=":material/healing:", key=f"{key}-recover-start", disabled=snap.active,
                   help="Writes RUN/recover (an earlier recovery there is replaced)."
                   + (" A recovery of another run is running." if snap.active else "")):
        try:
            jobs.start(run_dir, float(minutes))
            st.rerun()
        except UserError as e:
            box.error(f"Cannot recover: {e}")

    @st.fragment(run_every=1.5 if snap.active and mine else None)
    def live() -> None:
        now = jobs.snapshot()
        if now.run_dir != str(run_dir):
            if (done := recovered_folder(run_dir)) is not None:
                st.caption(f"Recovered model: `{done}` (Chat shows it beside the dense and the pruned model).")
            return
        if now.active != snap.active:
            st.rerun()
        st.caption(f"{now.status.capitalize()}: {now.phase}")
        if now.records:
            st.plotly_chart(figures.recovery_figure(now.records), config=PLOT_CONFIG, key=f"{key}-recover-loss")
        if now.error:
            st.error(f"Recovery failed: {now.error}")
        elif now.result:
            res = now.result
            after = (f"perplexity {res['ppl_before']:.2f} → {res['ppl_after']:.2f}; " if "ppl_after" in res else "")
            st.success(f"{after}{res['steps']} steps, ended by {res['ended_by']}; the recovered model is in "
                       f"`{now.out_dir}/model` (Chat shows it beside the dense and the pruned model).")

    with box:
        live()


def deploy_panel(run_dir: str | Path, key: str) -> None:
    """Downloads of a finished run: the sliced model as a zip (loads with from_pretrained(..., trust_remote_code=True)
    once unzipped), and its GGUF for llama.cpp (f16 or q8_0; exported on demand, under a spinner, with the
    project's exporter, and kept in the run folder). The files are read only when a button is clicked."""
    from engine.errors import UserError
    from engine.ui import deploy

    run_dir = Path(run_dir)
    if not (run_dir / "model" / "config.json").is_file():
        return
    box = st.container(border=True)
    box.markdown("**Deploy** · download the pruned model")
    c1, c2, c3 = box.columns([2, 1, 2])
    c1.download_button("Sliced model (zip)", data=lambda: deploy.model_zip_bytes(run_dir),
                       file_name=deploy.model_zip_name(run_dir), mime="application/zip", icon=":material/download:",
                       key=f"{key}-zip", on_click="ignore",
                       help="The run's model/ folder: unzip it and load it with AutoModelForCausalLM.from_pretrained("
                            "folder, trust_remote_code=True).")
    outtype = c2.selectbox("GGUF type", deploy.GGUF_OUTTYPES, key=f"{key}-gguf-type", label_visibility="collapsed",
                           help="f16: half-precision weights; q8_0: 8-bit blocks, about half the size.")
    try:
        path = deploy.cached_run_gguf(run_dir, outtype)
        if path is None and c3.button(f"Make the GGUF ({outtype})", icon=":material/build:", key=f"{key}-make-gguf",
                                      help="Export the run for llama.cpp with the project's GGUF exporter (as "
                                           f"`python -m engine export RUN --format gguf --outtype {outtype}`); kept "
                                           "in the run folder."):
            with st.spinner(f"Exporting the GGUF ({outtype}) for llama.cpp…"):
                path = deploy.ensure_run_gguf(run_dir, outtype)
    except UserError as e:
        box.error(f"error: {e}")
        return
    if path is not None:
        c3.download_button(f"GGUF {outtype} ({deploy.file_size(path)})", data=lambda: path.read_bytes(),
                           file_name=deploy.gguf_download_name(run_dir, outtype), mime="application/octet-stream",
                           icon=":material/download:", key=f"{key}-gguf-{outtype}", on_click="ignore",
                           help=f"{path.name} in the run folder: one file llama.cpp (or Ollama) loads.")


def download_masks(rows: list[dict], view: M.MaskView | None, run_dir: str | Path | None, key: str) -> None:
    """Download buttons: the per-layer table as CSV, and the shown mask's kept units as JSON (per unit type, per
    layer, the indices of the units it keeps)."""
    from engine.ui.settings import rows_csv

    name = Path(run_dir).name if run_dir else "run"
    c1, c2 = st.columns(2)
    c1.download_button("Masks per layer (CSV)", rows_csv(rows), file_name=f"{name}-masks-per-layer.csv",
                       mime="text/csv", icon=":material/download:", key=f"{key}-csv")
    if view is not None:
        c2.download_button("Masks (JSON)", M.masks_json(view, name), file_name=f"{name}-{view.name}-mask.json",
                           mime="application/json", icon=":material/download:", key=f"{key}-json",
                           help=f"The {view.label} mask: per unit type and layer, the indices of the units it keeps.")


def render_disk_run(run_dir: str | Path, key: str) -> None:
    from engine.ui.jobs import read_run

    info = read_run(run_dir)
    if info is None:
        st.warning(f"{run_dir} holds no run")
        return
    if info.damaged:
        st.error(f"Run **{info.name}** is damaged: {info.damaged}", icon=":material/report:")
        return
    st.caption(f"Run **{info.name}** — {info.status}, {info.steps_done}/{info.config.get('steps')} steps, "
               f"model `{info.config.get('model')}`")
    history = read_metrics(run_dir)
    views = (M.saved_views(run_dir, info.results) if info.results else []) + [M.current_view(history[-1] if history else None)]
    render_run(history, info.config, M.ordered(views), info.results, key, run_dir=run_dir)


# --- chat models (loaded in the page's script run, never in a fragment tick) ----------------------
@st.cache_resource(max_entries=1, show_spinner="Loading the base model (SmolLM2 takes about 25 s)…")
def base_model(model_name: str, dtype: str):
    from engine.tools.chat import load_base

    return warm_up(load_base(model_name, dtype))


@st.cache_resource(max_entries=2, show_spinner="Loading the sliced export…")
def sliced_model(run_dir: str, mtime: float):
    from engine.tools.chat import load_sliced

    return warm_up(load_sliced(run_dir))


@st.cache_resource(max_entries=2, show_spinner="Loading the run's recovered model…")
def recovered_model(run_dir: str, mtime: float):
    from engine.tools.chat import load_recovered

    return warm_up(load_recovered(run_dir))


@st.cache_resource(max_entries=2, show_spinner="Loading the run's GGUF in llama.cpp (exporting it first if needed)…")
def gguf_model(run_dir: str, mtime: float):
    from engine.tools.chat import load_gguf

    return warm_up(load_gguf(run_dir))


@st.cache_resource(max_entries=2, show_spinner="Converting the dense model to GGUF for llama.cpp (once; kept beside "
                                                  "the runs)…")
def dense_gguf_model(run_dir: str, mtime: float):
    from engine.tools.chat import load_dense_gguf
    from engine.tools.gguf_cache import DENSE_GGUF_DIR

    return warm_up(load_dense_gguf(run_dir, runs_dir() / DENSE_GGUF_DIR))


def run_figures_for_compare(info: RunInfo) -> dict[str, list[float]]:
    if info.results:
        return figures.kept_fractions_from_results(info.results)
    m = read_metrics(info.path)
    return m[-1]["kept_fraction"] if m else {}


def option_widgets(options_cls, defaults: dict | None = None, key: str | None = "opt", columns: int = 3,
                   names: tuple[str, ...] | None = None, hidden: tuple[str, ...] = ()) -> dict:
    """One widget per field of a settings dataclass (a method's Options, or the run's PruneConfig: all fields, or
    `names`), made from the field's declaration: its label, help and choices (engine.settings.fields.setting). Widget keys
    are KEY-FIELD (FIELD without a key); a key already in the session state keeps its value (persisted settings).
    Bounds are not enforced by the widget: the run's validation names a value out of bounds in one message.
    `hidden` fields that do not apply get no widget; their value is kept. Returns {field: value}."""
    import dataclasses
    import typing

    from engine.settings.fields import choices_of

    defaults, values = defaults or {}, {}
    hints = typing.get_type_hints(options_cls)
    fields = [f for f in dataclasses.fields(options_cls) if (names is None or f.name in names)]
    cols, i = st.columns(columns), 0
    for f in fields:
        meta = f.metadata
        label = meta.get("label") or f.name.replace("_", " ").capitalize()
        default, choices, k = defaults.get(f.name, f.default), choices_of(f), f"{key}-{f.name}" if key else f.name
        if f.name in hidden:
            values[f.name] = st.session_state.get(k, default)
            continue
        col, i = cols[i % columns], i + 1
        seeded = k in st.session_state
        kw = dict(help=meta.get("help") or None, key=k)
        if choices:
            values[f.name] = col.selectbox(label, list(choices), **kw) if seeded else \
                col.selectbox(label, list(choices), index=list(choices).index(default), **kw)
        elif hints[f.name] is bool:
            values[f.name] = col.checkbox(label, **kw) if seeded else col.checkbox(label, bool(default), **kw)
        elif hints[f.name] is int:
            values[f.name] = int(col.number_input(label, step=1, **kw) if seeded else
                                 col.number_input(label, value=int(default), step=1, **kw))
        elif hints[f.name] is float:
            values[f.name] = float(col.number_input(label, format="%.4g", **kw) if seeded else
                                   col.number_input(label, value=float(default), format="%.4g", **kw))
        elif set(typing.get_args(hints[f.name])) == {float, type(None)}:  # (an optional number: empty is None)
            got = col.number_input(label, format="%.4g", **kw) if seeded else \
                col.number_input(label, value=None if default is None else float(default), format="%.4g", **kw)
            values[f.name] = None if got is None else float(got)
        else:
            values[f.name] = col.text_input(label, **kw) if seeded else col.text_input(label, str(default), **kw)
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
    from engine.settings.fields import choices_of

    return choices_of(_field(cls, name))


# --- the Prune form's settings: kept across pages and reloads ------------------------------------------------
FORM_VALUES, FORM_BASE, FORM_FROM = "prune_settings", "prune_settings_base", "prune_settings_from"


def form_keys() -> list[str]:
    """Every widget key of the Prune form (engine/ui/settings.py's default_values lists them)."""
    from engine.ui.settings import default_values

    return list(default_values())


def restore_prune_settings() -> None:
    """Seed the Prune form's widgets from the session's settings (read from beside the runs the first time), so
    that they keep their values across pages, reloads and hidden widgets."""
    from engine.ui.settings import default_values, load_settings

    ss = st.session_state
    if FORM_VALUES not in ss:
        ss[FORM_VALUES], ss[FORM_BASE], ss[FORM_FROM] = load_settings(runs_dir())
    seed = {**default_values(), **ss[FORM_VALUES]}
    for k, v in seed.items():
        if k not in ss:
            ss[k] = v


def save_prune_settings() -> dict:
    """The form's values now (a hidden widget's last value included), kept in the session and beside the runs."""
    from engine.ui.settings import save_settings

    ss = st.session_state
    old = ss.get(FORM_VALUES) or {}
    values = {k: ss[k] if k in ss else old.get(k) for k in form_keys() if k in ss or k in old}
    if values != old:
        ss[FORM_VALUES] = values
        try:
            save_settings(runs_dir(), values, ss.get(FORM_BASE), ss.get(FORM_FROM))
        except OSError:
            pass  # a read-only runs folder: the session still keeps them
    return values


def load_into_form(config: dict, source: str | None) -> None:
    """Fill the Prune form from a run's config: its form fields, and the rest as the base of the next run."""
    from engine.ui.settings import form_values, save_settings

    ss = st.session_state
    for k in form_keys():
        ss.pop(k, None)
    ss[FORM_VALUES], ss[FORM_BASE], ss[FORM_FROM] = {**form_values(config), "run_name": ""}, dict(config), source
    try:
        save_settings(runs_dir(), ss[FORM_VALUES], ss[FORM_BASE], source)
    except OSError:
        pass


def reset_prune_settings() -> None:
    """Back to the default run's settings (a button's callback: runs before the widgets are drawn)."""
    from engine.settings.config import default_run

    load_into_form(default_run().to_dict(), None)
    st.session_state[FORM_BASE] = None
    save_prune_settings()


def apply_preset(name: str) -> None:
    """Set the widgets a preset names (engine/settings/config.py's PRESETS; a button's callback)."""
    from engine.ui.settings import preset_values

    st.session_state.update(preset_values(name, "pg"))


def hidden_options(method: str) -> tuple[str, ...]:
    """A method's options that do not apply to the others chosen: pg's window T serves the moving average only."""
    if method == "pg" and st.session_state.get("opt-pg-baseline") != "moving-average":
        return ("baseline_window",)
    return ()


# --- the plan of a run, before it starts ------------------------------------------------------------------
@st.cache_resource(max_entries=64, show_spinner="Reading the model's config…")
def _removal(model: str, units: tuple, ratio: float, budget: str, scope: str, init: str):
    from engine.plan.forecast import model_skeleton, plan_removal

    return plan_removal(model_skeleton(model), list(units), ratio, budget, scope, init)


def _rate(config, skeleton) -> tuple[float, str, bool]:
    """(seconds per token, where it comes from, measured here?): earlier runs of the model, a probe of this
    machine, or a guess from the model's size."""
    from engine.plan.forecast import cached_probe, probe_key, rate_from_runs
    from engine.storage.ppl_cache import cache_dir

    found = rate_from_runs([(r.config, r.results) for r in runs()], config.model, config.dtype)
    if found:
        return found[0], f"the step time of {found[1]} earlier run{'s' if found[1] > 1 else ''} of this model", True
    probe = cached_probe(cache_dir(), probe_key(config.model, config.dtype, config.batch_size, config.seqlen))
    if probe:
        return probe, "a probe of this machine (one dense forward of a batch)", True
    guess = 2 * (skeleton.params_total) / 100e9  # about 100 GFLOP/s: 2 CPU cores measured on SmolLM2
    return guess, "a guess from the model's size (not measured on this machine yet)", False


def plan_panel(config, problem: str | None) -> float | None:
    """The plan above Start: parameters removed, time, peak memory, speed-up. Returns the estimated seconds."""
    from engine.data.calib_sources import config_text_cached
    from engine.errors import UserError
    from engine.plan.forecast import (budget_trades, cached_probe, model_skeleton, pass_dtype_of, plan_memory, plan_time,
                             probe_key, probe_seconds_per_token, speedup)
    from engine.storage.ppl_cache import cache_dir
    from engine.model.unit_types import UNIT_TYPES

    box = st.container(border=True)
    box.markdown("**Plan** · from the model's config (no weights loaded); times are estimates")
    if problem is not None:  # (a warning: Start, pressed, says it as the one error)
        box.warning(f"Cannot start as set — error: {problem}", icon=":material/error:")
        return None
    try:
        skeleton = model_skeleton(config.model)
        removal = _removal(config.model, tuple(config.units), float(config.prune_ratio), config.budget, config.scope,
                           config.init)
    except UserError as e:
        box.error(f"error: {e}")
        return None
    rate, source, measured = _rate(config, skeleton)
    passes = pass_dtype_of(config)  # (the one-shot passes in bfloat16: their own rate, once probed)
    if not measured and skeleton.params_total < 20e6:  # a small model: probing costs well under a second
        rate = probe_seconds_per_token(skeleton, config.dtype, config.batch_size, config.seqlen, cache=cache_dir())
        source, measured = "a probe of this machine (one dense forward of a batch)", True
    pass_rate = None
    if passes:
        pass_rate = cached_probe(cache_dir(), probe_key(config.model, config.dtype, config.batch_size, config.seqlen,
                                                        passes))
        if pass_rate is None and measured and skeleton.params_total < 20e6:
            pass_rate = probe_seconds_per_token(skeleton, config.dtype, config.batch_size, config.seqlen,
                                                cache=cache_dir(), passes=passes)
    times = plan_time(config, skeleton, rate, source, pass_seconds_per_token=pass_rate,
                      text_cached=config_text_cached(config))  # (--calib-source self: generated once, then cached)
    total = config.time_budget * 60 if config.time_budget else times.total
    memory = plan_memory(config, skeleton)
    peaks = [r.results["peak_rss_mb"] for r in runs() if r.results and r.results.get("peak_rss_mb")
             and r.config.get("model") == config.model]
    c1, c2, c3, c4 = box.columns(4)
    # (short labels and values: four cards share the form's width, and a longer one is cut off at 1400 px)
    c1.metric("Removes", fmt_params(removal.params_removed),
              help="Parameters the run's budget removes (engine/algo/budget.py's accounting), within one unit.")
    c2.metric("Time (est.)", ("≈ " if not config.time_budget else "") + fmt_duration(total),
              help=f"The whole run, {fmt_seconds(total)}: seconds per token from {source}; the phases are below.")
    c3.metric("Memory (est.)", f"{memory.total / 1e9:.1f} GB",
              help=", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in memory.parts.items()))
    c4.metric("Speed-up (est.)", f"{speedup(skeleton, removal.params_removed):.2f}×",
              help="Dense over pruned matrix parameters a token multiplies (decoder and LM head); attention over "
                   "the context left out. llama.cpp measured 1.40× for 30 % of SmolLM2 (docs/gguf.md).")
    split = ", ".join(f"{UNIT_TYPES[u].title if u in UNIT_TYPES else u} {n:,}" for u, n in removal.by_type.items())
    how = ("how much each unit type loses is decided by the init metric's ranking of all units together, once it "
           "has read the data (shown here: the same share of each)" if removal.split_from_metric
           else "the split between unit types is where the run starts: the method learns it" if removal.split_learned
           else "per unit type")
    box.markdown(f"Will remove **{removal.params_removed:,}** parameters"
                 f"{'' if removal.exact else ' (about)'}: {removal.removed_of_decoder:.1%} of the decoder layers, "
                 f"{removal.removed_of_model:.1%} of the whole model (embeddings and LM head are never pruned)"
                 + (f", up to {removal.tolerance:,} more (one unit)" if removal.tolerance else "")
                 + f". {how.capitalize()}: {split}"
                 + (f"; {removal.layers_removed} whole layer{'s' if removal.layers_removed != 1 else ''} out" if
                    removal.layers_removed else "") + ".")
    phases = " · ".join(f"{k} {fmt_seconds(v)}" for k, v in times.phases.items() if v >= 0.5)
    box.caption(f"Time: {phases}" + (f" (the time budget stops it at {config.time_budget:g} min)" if config.time_budget else "")
                + f". Rate: {rate * 1e3:.3f} ms per token, from {source}"
                + (f"; the one-shot passes in {passes}: {pass_rate * 1e3:.3f} ms per token" if pass_rate else
                   f"; the one-shot passes will run in {passes} (planned at this rate)" if passes else "") + "."
                + (f" Earlier runs of this model peaked at {max(peaks) / 1e3:.1f} GB." if peaks else ""))
    for trade in budget_trades(config, times):  # (what the time budget would trade for time: said before Start)
        box.warning(trade[0].upper() + trade[1:] + ".", icon=":material/timer:")
    if (line := too_few_steps_text(config, times)) is not None:  # (the run says it again when it starts)
        box.warning(line, icon=":material/timer_off:")
    if not measured and box.button("Measure this machine's speed", key="probe", icon=":material/speed:",
                                   help="One forward of a calibration batch through the model built with random "
                                        "weights (no file is read); remembered for this model and batch shape."):
        with st.spinner("Measuring one forward…"):
            for dtype in dict.fromkeys([None, passes]):
                probe_seconds_per_token(skeleton, config.dtype, config.batch_size, config.seqlen, cache=cache_dir(),
                                        passes=dtype)
        st.rerun()
    return total


# narrow columns for the run tables, so the key ones fit a 1400 px window
COMPACT_COLUMNS = {k: st.column_config.Column(width="small") for k in
                   ("status", "scope", "rate", "steps", "params", "budget", "id", "ppl pruned", "ppl dense", "ppl init",
                    "speed-up")}


def short(value) -> str:
    """A setting's value for a sentence: lists joined, long paths by their name."""
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) or "—"
    if isinstance(value, str) and "/" in value:
        return Path(value).name
    return "—" if value is None else str(value)
