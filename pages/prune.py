"""Prune: choose a model and a pruning rate, start a run, watch the masks being learned."""

import sys
import time
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # for _ui, beside this page
import _ui  # noqa: E402  (also puts the repository root on sys.path)
import streamlit as st  # noqa: E402

from engine.config import PruneConfig
from engine.methods import METHODS
from engine.unit_types import UNIT_TYPES
from engine.errors import UserError
from engine.ui.jobs import DONE, FAILED, IDLE, STOPPED, new_run_name
from engine.loading import DEFAULT_MODEL

D = PruneConfig()
# the run settings under "Hyperparameters": widgets made from their declarations in PruneConfig
HYPERPARAMETERS = ("lr", "lr_schedule", "num_mask_samples", "batch_size", "seqlen", "prob_map", "eval_seqlen",
                   "init_batches", "seed", "val_every", "checkpoint_every")
jobs = _ui.job_manager()

st.title(":material/content_cut: Prune")
st.markdown(
    "Learn which **KV groups** (attention heads sharing a key/value head), **MLP channels** and **whole layers** to remove, "
    "with forward passes only: every unit has a keep probability *s*; each step samples masks from *s*, "
    "measures the calibration loss of each masked model, and moves *s* by a policy gradient. "
    "The pruned model keeps the units with the highest *s*."
)

MODEL_CHOICES = {"default": "SmolLM2-135M-Instruct (packaged, 30 layers)", "local": "A local model folder or .gguf file"}

_snap = jobs.snapshot()
_has_view = _snap.status != IDLE or _ui.selected_run() is not None
with st.expander("**Run settings**: model, units, pruning rate, scope, steps", expanded=not _has_view,
                 icon=":material/tune:"), st.form("prune-form", border=False):
    choice = st.radio("Model", list(MODEL_CHOICES), format_func=MODEL_CHOICES.get, horizontal=True,
                      help="The default ships with the project (a 4-bit GGUF, loaded as float32). "
                           "A local model is a transformers folder (with config.json) or a .gguf file.", key="model_choice")
    local_path = st.text_input("Local model path (used when 'A local model folder or .gguf file' is chosen)",
                               placeholder="/path/to/model-folder or /path/to/model.gguf", key="model_path")
    units = st.multiselect(_ui.label_of(PruneConfig, "units"), list(UNIT_TYPES), default=D.units,
                           format_func=lambda u: UNIT_TYPES[u].title, help=_ui.help_of(PruneConfig, "units"), key="units")
    rate = st.slider(_ui.label_of(PruneConfig, "prune_ratio"), 0.0, 1.0, D.prune_ratio, 0.05, format="%.2f",
                     help=_ui.help_of(PruneConfig, "prune_ratio"), key="rate")
    c1, c2, c3 = st.columns(3)
    scope = c1.radio(_ui.label_of(PruneConfig, "scope"), list(_ui.choices(PruneConfig, "scope")), horizontal=True,
                     help=_ui.help_of(PruneConfig, "scope"), key="scope")
    inits = list(_ui.choices(PruneConfig, "init"))
    init = c2.selectbox(_ui.label_of(PruneConfig, "init"), inits, index=inits.index(D.init),
                        help=_ui.help_of(PruneConfig, "init"), key="init")
    steps = c3.number_input(_ui.label_of(PruneConfig, "steps"), 1, 100_000, D.steps,
                            help=_ui.help_of(PruneConfig, "steps"), key="steps")
    time_budget = c3.number_input(_ui.label_of(PruneConfig, "time_budget"), min_value=0.0, max_value=10_000.0, value=None,
                                  step=1.0, placeholder="off: run the steps", help=_ui.help_of(PruneConfig, "time_budget"),
                                  key="time_budget")
    c4, c5 = st.columns(2)
    methods = list(_ui.choices(PruneConfig, "method"))
    method = c4.selectbox(_ui.label_of(PruneConfig, "method"), methods, index=methods.index(D.method),
                          format_func=lambda m: {"pg": "policy gradient (forward passes only)",
                                                 "gumbel": "Gumbel-softmax (back-propagation, for comparison)",
                                                 "metric": "no optimisation: the init metric's top units",
                                                 "flap": "FLAP one-shot (fluctuation metric, compensation)",
                                                 "bonsai": "Bonsai (forward passes only: sampled sub-models, regression)"}.get(m, m),
                          help=_ui.help_of(PruneConfig, "method"), key="method")
    layer_inits = list(_ui.choices(PruneConfig, "layer_init"))
    layer_init = c5.selectbox(_ui.label_of(PruneConfig, "layer_init"), layer_inits, index=layer_inits.index(D.layer_init),
                              help=_ui.help_of(PruneConfig, "layer_init"), key="layer_init")
    with st.expander("Hyperparameters (the fast preset; the paper's are `--preset paper`: lr 0.002, N_s 2, moving average)"):
        hyper = _ui.option_widgets(PruneConfig, key=None, names=HYPERPARAMETERS)
        h1, h2, h3 = st.columns(3)
        max_windows = h1.number_input("Evaluation windows (0 = all)", 0, 10_000, 64,
                                      help="WikiText-2 windows used for the dense, init and pruned perplexities. "
                                           "All 2,370 windows take about 15 min per evaluation for SmolLM2 on this CPU.", key="max_windows")
        channel_multiple = h1.number_input("MLP channels per layer: a multiple of", 1, 256, 1,
                                           help="Final mask: every layer keeps a multiple of this many MLP channels "
                                                "(never over the budget). 32 gives llama.cpp whole Q8_0 blocks and "
                                                "GEMM tiles; 1 = off.", key="channel_multiple")
    # each method's own settings, made from its Options declarations (a method registered by a script shows too)
    method_values = {}
    for name, cls in METHODS.items():
        if cls.Options is not None:
            with st.expander(f"Options of method {name}" + (" (used when it is the method)" if name != D.method else "")):
                method_values[name] = _ui.option_widgets(cls.Options, key=f"opt-{name}")
    label = st.text_input("Run name (optional)", help=f"The run is saved under {_ui.runs_dir()}/<date>-<model>-<scope>-<rate>-<name>.", key="run_name")
    submitted = st.form_submit_button("Start pruning", type="primary", icon=":material/play_arrow:")

if submitted:
    try:
        if choice == "local" and not local_path.strip():
            raise UserError("give the path of a local model folder or .gguf file")
        config = PruneConfig(
            model=DEFAULT_MODEL if choice == "default" else local_path.strip(), units=list(units), prune_ratio=float(rate),
            scope=scope, method=method, init=init, layer_init=layer_init, steps=int(steps), **hyper,
            time_budget=float(time_budget) if time_budget else None,
            method_options=method_values.get(method, {}), max_windows=int(max_windows) or None,
            unit_multiple={"channels": int(channel_multiple)} if channel_multiple > 1 and "channels" in units else {},
        )
        out = _ui.runs_dir() / new_run_name(config, label)
        jobs.start(config, out)
        _ui.select_run(out)
        st.toast(f"Started {out.name}")
        st.rerun()  # redraw with the settings folded away
    except UserError as e:
        st.error(f"Cannot start: {e}")

st.divider()


@st.fragment(run_every=1.5)
def live() -> None:
    snap = jobs.snapshot()
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
    head = st.columns([3, 1])
    badge = {"loading": ":material/hourglass_top:", "running": ":material/play_circle:", "stopping": ":material/pending:",
             "stopped": ":material/pause_circle:", "done": ":material/check_circle:", "failed": ":material/error:"}
    head[0].subheader(f"{badge.get(snap.status, '')} {snap.status.capitalize()}: {Path(cfg.get('model', '')).name}")
    head[0].caption(f"{snap.phase} · run folder `{snap.out_dir}`")
    if snap.active:
        if head[1].button("Stop", icon=":material/stop:", key="stop", disabled=snap.status == "stopping",
                          help="Stop after the current step; the state is saved and the run can be resumed."):
            jobs.stop()
            st.rerun(scope="fragment")
    elif snap.status == STOPPED:
        if head[1].button("Resume", icon=":material/play_arrow:", key="resume", help="Continue from the saved state."):
            try:
                jobs.start(None, snap.out_dir, resume=True)
                st.rerun(scope="fragment")
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
    else:
        eta = last["eta_seconds"] if last else None
        elapsed = time.time() - (snap.started_at or time.time())
        st.progress(min(done_steps / total, 1.0),
                    text=f"{done_steps}/{total} steps · {last['seconds']:.2f} s/step · ETA {_ui.fmt_seconds(eta)} · "
                         f"running for {_ui.fmt_seconds(elapsed)}" if last else f"preparing · {snap.phase}")
    if last and cfg.get("method") in METHODS and (line := METHODS[cfg["method"]].progress(cfg, done_steps)):
        st.caption(f"{cfg['method']}: {line} · current loss {sum(last['losses']) / len(last['losses']):.3f}")
    _ui.render_run(snap.history, cfg, snap.head_mask, snap.result, key="job")
    if snap.status == DONE:
        st.success("Done. Compare it with the other scope on **Compare**, or talk to it on **Chat**.")


live()
