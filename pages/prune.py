"""Prune: choose a model and a pruning rate, start a run, watch the masks being learned."""

import sys
import time
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # for _ui, beside this page
import _ui  # noqa: E402  (also puts the repository root on sys.path)
import streamlit as st  # noqa: E402

from engine.settings.config import PruneConfig, preset_text
from engine.algo.methods import METHODS
from engine.plan.forecast import LONG_RUN_SECONDS
from engine.ui import settings as S
from engine.model.unit_types import UNIT_TYPES
from engine.errors import UserError
from engine.ui import checks
from engine.ui import masks as M
from engine.ui.jobs import DONE, FAILED, IDLE, STOPPED, new_run_name

HYPERPARAMETERS = S.HYPERPARAMETERS  # the run settings under "Hyperparameters" (engine/ui/settings.py)
jobs = _ui.job_manager()

st.title(":material/content_cut: Prune")
st.markdown(
    "Learn which **KV groups** (attention heads sharing a key/value head), **MLP channels** and **whole layers** to remove, "
    "with forward passes only: every unit has a keep probability *s*; each step samples masks from *s*, "
    "measures the calibration loss of each masked model, and moves *s* by a policy gradient. "
    "The pruned model keeps the units with the highest *s*."
)

# The runs folder, checked once per page load: what is wrong with it, in one line (Start waits until it is fixed),
# and the runs in it that cannot be shown.
runs_problem = checks.runs_dir_problem(_ui.runs_dir())
if runs_problem:
    st.error(f"error: {runs_problem}", icon=":material/folder_off:")
_ui.damaged_runs_notice()

MODEL_CHOICES = {"default": "SmolLM2-135M-Instruct (packaged, 30 layers)", "local": "A local model folder or .gguf file"}

# The form's values live in the session (a page switch or a run loaded on Runs keeps them) and beside the runs (a
# browser reload starts from the last ones): every widget is seeded from them before it is drawn.
_ui.restore_prune_settings()

_snap = jobs.snapshot()
_has_view = _snap.status != IDLE or _ui.selected_run() is not None
with st.expander("**Run settings**: model, units, pruning rate, scope, steps", expanded=not _has_view,
                 icon=":material/tune:"):
    base = st.session_state.get(_ui.FORM_BASE)
    if base:
        b1, b2 = st.columns([4, 1])
        b1.caption(f"Settings from run **{st.session_state.get(_ui.FORM_FROM) or 'loaded'}**: the settings this form "
                   "does not show are that run's too.")
        b2.button("Reset to defaults", key="reset-settings", on_click=_ui.reset_prune_settings, icon=":material/restart_alt:")
    choice = st.radio("Model", list(MODEL_CHOICES), format_func=MODEL_CHOICES.get, horizontal=True,
                      help="The default ships with the project (a 4-bit GGUF, loaded as float32). "
                           "A local model is a transformers folder (with config.json) or a .gguf file.", key="model_choice")
    local_path = st.text_input("Local model path (used when 'A local model folder or .gguf file' is chosen)",
                               placeholder="/path/to/model-folder or /path/to/model.gguf", key="model_path")
    units = st.multiselect(_ui.label_of(PruneConfig, "units"), list(UNIT_TYPES),
                           format_func=lambda u: UNIT_TYPES[u].title, help=_ui.help_of(PruneConfig, "units"), key="units")
    rate_min, rate_max, st.session_state["rate"] = checks.rate_bounds(st.session_state.get("rate"))  # never 0 or 1
    rate = st.slider(_ui.label_of(PruneConfig, "prune_ratio"), rate_min, rate_max, step=0.05, format="%.2f",
                     help=_ui.help_of(PruneConfig, "prune_ratio"), key="rate")
    c1, c2, c3 = st.columns(3)
    scope = c1.radio(_ui.label_of(PruneConfig, "scope"), list(_ui.choices(PruneConfig, "scope")), horizontal=True,
                     help=_ui.help_of(PruneConfig, "scope"), key="scope")
    budget = c1.radio(_ui.label_of(PruneConfig, "budget"), list(_ui.choices(PruneConfig, "budget")), horizontal=True,
                      help=_ui.help_of(PruneConfig, "budget"), key="budget")
    init = c2.selectbox(_ui.label_of(PruneConfig, "init"), list(_ui.choices(PruneConfig, "init")),
                        help=_ui.help_of(PruneConfig, "init"), key="init")
    steps = c3.number_input(_ui.label_of(PruneConfig, "steps"), step=1, help=_ui.help_of(PruneConfig, "steps"), key="steps")
    time_budget = c3.number_input(_ui.label_of(PruneConfig, "time_budget"), step=1.0, placeholder="off: run the steps",
                                  help=_ui.help_of(PruneConfig, "time_budget"), key="time_budget")
    c4, c5 = st.columns(2)
    method = c4.selectbox(_ui.label_of(PruneConfig, "method"), list(_ui.choices(PruneConfig, "method")),
                          format_func=lambda m: {"pg": "policy gradient (forward passes only)",
                                                 "gumbel": "Gumbel-softmax (back-propagation, for comparison)",
                                                 "metric": "no optimisation: the init metric's top units",
                                                 "flap": "FLAP one-shot (fluctuation metric, compensation)",
                                                 "bonsai": "Bonsai (forward passes only: sampled sub-models, regression)"}.get(m, m),
                          help=_ui.help_of(PruneConfig, "method"), key="method")
    if "layers" in units:  # (whole layers only: the layer metric does not apply otherwise)
        c5.selectbox(_ui.label_of(PruneConfig, "layer_init"), list(_ui.choices(PruneConfig, "layer_init")),
                     help=_ui.help_of(PruneConfig, "layer_init"), key="layer_init")
        c5.checkbox("Fixed layers (the steps learn the kept layers' widths)", key="fixed_layers",
                    help="--layer-score-const 1: the layers the init removes stay removed; "
                         + _ui.help_of(PruneConfig, "layer_score_const"))
    c4.button("The joint preset with its steps: layers and widths, then PG over each kept layer's width",
              key="preset-joint", on_click=_ui.apply_preset, args=("joint",), icon=":material/layers:",
              help="engine/settings/config.py's preset 'joint', as `--preset joint` on the command line: "
                   f"{preset_text('joint')}. The default run (this form's defaults, as the command line's) is "
                   "its one-shot init alone (method flap): on the confirmation set 24 steps gained 12.7 % on "
                   "WikiText validation but 4.6 % on held-out C4, short of the default's rule (docs/results.md)")
    with st.expander("Hyperparameters: the steps' are the fast preset's (lr 0.02, N_s 8, leave-one-out); the paper's "
                     "are one click away"):
        p1, p2, _ = st.columns([1, 1, 3])
        p1.button("The paper's (lr 0.002, N_s 2, moving average)", key="preset-paper", on_click=_ui.apply_preset,
                  args=("paper",), help="engine/settings/config.py's preset 'paper', as `--preset paper` on the command line: "
                                        f"{preset_text('paper')}")
        p2.button("The fast preset (the settings' own)", key="preset-fast", on_click=_ui.apply_preset, args=("fast",),
                  help=f"{preset_text('fast')}")
        hyper = _ui.option_widgets(PruneConfig, key=None, names=HYPERPARAMETERS)
        h1, h2, h3 = st.columns(3)
        h1.number_input("Evaluation windows (0 = all)", step=1,
                        help="WikiText-2 windows used for the dense, init and pruned perplexities. "
                             "The command line's default is 256 (the results tables' protocol); all of them "
                             "(about 2,400 of 128 tokens) take 9x as long: 15-40 min per evaluation for SmolLM2 on 2 "
                             "cores.", key="max_windows")
        h1.number_input("MLP channels per layer: a multiple of", step=1,
                        help="Final mask: every layer keeps a multiple of this many MLP channels "
                             "(never over the budget). 32 gives llama.cpp whole Q8_0 blocks and GEMM tiles; 1 = off.",
                        key="channel_multiple")
    # each method's own settings, made from its Options declarations (a method registered by a script shows too)
    for name, cls in METHODS.items():
        if cls.Options is not None:
            with st.expander(f"Options of method {name}" + (" (used when it is the method)" if name != method else "")):
                _ui.option_widgets(cls.Options, key=f"opt-{name}", hidden=_ui.hidden_options(name))
    st.text_input("Run name (optional)", help=f"The run is saved under {_ui.runs_dir()}/<date>-<model>-<scope>-<rate>-<name>.",
                  key="run_name")
    values = _ui.save_prune_settings()
    config, problem = None, None
    try:
        config = S.form_config(values, base).validate()
    except UserError as e:
        problem = str(e)
    estimate = _ui.plan_panel(config, problem)
    blocked = problem is not None or runs_problem is not None  # (the plan, or the line on top, says why: once)
    submitted = st.button("Start pruning", type="primary", icon=":material/play_arrow:", key="start", disabled=blocked,
                          help="Fix the settings first: the plan says what is wrong." if problem else
                          "The runs folder cannot be used: the line at the top says why." if runs_problem else None)
    submitted = submitted and not blocked


def start(config: PruneConfig) -> None:
    out = _ui.runs_dir() / new_run_name(config, st.session_state.get("run_name", ""))
    jobs.start(config, out)
    _ui.select_run(out)
    st.session_state.pop("confirm-long", None)
    st.toast(f"Started {out.name}")
    st.rerun()  # redraw with the settings folded away


pending = st.session_state.get("confirm-long")
if submitted:
    try:
        if estimate is not None and estimate > LONG_RUN_SECONDS and pending != config.to_dict():
            st.session_state["confirm-long"] = config.to_dict()
            st.rerun()
        start(config)
    except UserError as e:
        st.error(f"Cannot start: {e}")
elif pending is not None and config is not None and pending == config.to_dict():
    st.warning(f"This run is estimated at **{_ui.fmt_seconds(estimate)}** (over {LONG_RUN_SECONDS / 60:.0f} min). "
               "Start it anyway?", icon=":material/schedule:")
    y, n, _ = st.columns([1, 1, 4])
    if y.button("Yes, start it", type="primary", key="confirm-start"):
        try:
            start(config)
        except UserError as e:
            st.error(f"Cannot start: {e}")
    if n.button("No", key="cancel-start"):
        st.session_state.pop("confirm-long", None)
        st.rerun()

st.divider()


LIVE_SECONDS = 1.5  # the run's panel redraws this often while a job runs, and not at all otherwise


@st.fragment(run_every=LIVE_SECONDS if _snap.active else None)
def live() -> None:
    snap = jobs.snapshot()
    if snap.active != _snap.active:  # a job started or ended since the page was drawn: redraw it all (and tick, or stop)
        st.rerun()
    shown = _ui.selected_run()
    if snap.status == IDLE and not shown:
        st.info("No run yet. Choose a model and a rate above and press **Start pruning**, "
                "or load a finished run on the **Runs** page.")
        return
    job_is_shown = snap.status != IDLE and (snap.active or shown is None or shown == snap.out_dir)
    if not job_is_shown:
        _ui.render_disk_run(shown, key="disk")
        return

    cfg = snap.config or {}
    last = snap.last
    head = st.columns([3, 1], vertical_alignment="center")  # (Stop and Resume level with the status)
    badge = {"loading": ":material/hourglass_top:", "running": ":material/play_circle:", "stopping": ":material/pending:",
             "stopped": ":material/pause_circle:", "done": ":material/check_circle:", "failed": ":material/error:"}
    head[0].subheader(f"{badge.get(snap.status, '')} {snap.status.capitalize()}: {Path(cfg.get('model', '')).name}")
    head[0].caption(f"{snap.phase} · run folder `{snap.out_dir}`")
    if snap.active:
        if head[1].button("Stop", icon=":material/stop:", key="stop", disabled=snap.status == "stopping",
                          help="Stop after the current step; the state is saved and the run can be resumed."):
            jobs.stop()
            st.rerun()
    elif snap.status == STOPPED:
        if head[1].button("Resume", icon=":material/play_arrow:", key="resume", help="Continue from the saved state."):
            try:
                jobs.start(None, snap.out_dir, resume=True)
                st.rerun()  # (the whole page: the panel ticks again while the job runs)
            except UserError as e:
                st.error(f"Cannot resume: {e}")
    if snap.status == FAILED:
        st.error(f"The run failed: {snap.error}")
        if snap.error_detail:
            with st.expander("Details"):
                st.code(snap.error_detail)
        return

    total = (last or {}).get("total_steps") or cfg.get("steps", 1)  # (a --time-budget run re-plans its count)
    done_steps = last["step"] if last else 0
    if snap.status == DONE:
        st.progress(1.0, text=f"{done_steps}/{total} steps · done")
    elif snap.status == STOPPED:
        st.progress(min(done_steps / total, 1.0), text=f"{done_steps}/{total} steps · stopped (resumable)")
    else:
        sps = S.wall_seconds_per_step(snap.history) or S.seconds_per_step(snap.history)
        eta = S.eta_seconds(snap.history, total, after=(snap.clock or {}).get("after_steps") or 0.0)
        elapsed = time.time() - (snap.started_at or time.time())
        now = [t for t in (S.running_phase_text(snap.clock, _ui.fmt_seconds),
                           S.overrun_text(snap.clock, _ui.fmt_seconds)) if t]
        st.progress(min(done_steps / total, 1.0) if last else _ui.planned_fraction(snap),
                    text=f"{done_steps}/{total} steps · {sps:.2f} s/step (the last {min(len(snap.history), 5)}, checks "
                         f"included) · ETA {_ui.fmt_seconds(eta)} · running for {_ui.fmt_seconds(elapsed)}"
                         + "".join(f" · {t}" for t in now)
                    if last else _ui.preparing_text(snap))
    if last and cfg.get("method") in METHODS and (line := METHODS[cfg["method"]].progress(cfg, done_steps)):
        st.caption(f"{cfg['method']}: {line} · current loss {sum(last['losses']) / len(last['losses']):.3f}")
    saved = M.saved_views(snap.out_dir, snap.result) if snap.status == DONE and snap.out_dir else []
    views = M.ordered(saved + [M.current_view(snap.last, snap.masks), snap.init_view])
    _ui.render_run(snap.history, cfg, views, snap.result, key="job", run_dir=snap.out_dir)
    if snap.status == DONE:
        st.success("Done. Compare it with the other scope on **Compare**, or talk to it on **Chat**.")


live()
