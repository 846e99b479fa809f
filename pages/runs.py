"""Runs: the run folders on disk; load one into the pages, resume, export, delete."""

import json
import sys
from datetime import datetime
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # for _ui, beside this page
import _ui  # noqa: E402
import streamlit as st  # noqa: E402

from engine.errors import UserError  # noqa: E402
from engine.ui.checks import runs_dir_problem  # noqa: E402
from engine.run.files import MASKS_FILE  # noqa: E402
from engine.ui.jobs import STOPPED, delete_run, export_run_model  # noqa: E402
from engine.ui.settings import results_table, runs_row, settings_table  # noqa: E402

st.title(":material/folder_open: Runs")
st.caption(f"Runs folder: `{_ui.runs_dir()}` (set $PG_PRUNE_RUNS_DIR to use another). "
           "Each run folder holds config.json, metrics.jsonl, checkpoint.pt, and once finished masks, "
           "the sliced model (model/) and results.json.")

jobs = _ui.job_manager()
if (deleted := st.session_state.pop("deleted-run", None)):
    st.success(f"Deleted {deleted}.", icon=":material/delete:")
if (problem := runs_dir_problem(_ui.runs_dir())) is not None:
    st.error(f"error: {problem}", icon=":material/folder_off:")
all_runs = _ui.runs()
if not all_runs:
    if problem is None:
        st.info("No runs yet: start one on **Prune**.")
    st.stop()
_ui.damaged_runs_notice()

damaged = any(x.damaged for x in all_runs)
rows = [{**runs_row(r.name, "running" if jobs.busy_with(r.path) else r.status, r.config, r.results, r.steps_done,
                    datetime.fromtimestamp(r.modified).strftime("%Y-%m-%d %H:%M"), _ui.speedup_short(r.config, r.results)),
         **({"damaged": r.damaged or ""} if damaged else {})} for r in all_runs]
st.dataframe(rows, hide_index=True, width="stretch", column_config=_ui.COMPACT_COLUMNS)

paths = [str(r.path) for r in all_runs]
current = _ui.selected_run()
run = st.selectbox("Run", all_runs, index=paths.index(current) if current in paths else 0, format_func=_ui.run_label)
busy = jobs.busy_with(run.path)
if run.damaged:
    st.error(f"{run.name} is damaged: {run.damaged}. Its files are listed below; delete it, or repair the file.",
             icon=":material/report:")

b1, b2, b3 = st.columns(3)
if b1.button("Load into the pages", icon=":material/upload:", type="primary",
             help="Prune shows its charts and its settings fill the form, Chat talks to it, Compare starts from it."):
    _ui.select_run(run.path)
    _ui.load_into_form(run.config, run.name)
    st.success(f"Loaded {run.name}: its charts and its settings are on **Prune**.")
if b2.button("Re-run", icon=":material/replay:",
             help="Fill the Prune form with this run's settings (every one of them, also those the form does not "
                  "show) and open Prune: check the plan and press Start."):
    _ui.load_into_form(run.config, run.name)
    st.switch_page("pages/prune.py")
if run.status == STOPPED and not busy:
    if b3.button("Resume this run", icon=":material/play_arrow:", help="Continue from its last checkpoint (watch it on Prune)."):
        try:
            jobs.start(None, run.path, resume=True)
            _ui.select_run(run.path)
            st.success("Resumed: watch it on **Prune**.")
        except UserError as e:
            st.error(f"Cannot resume: {e}")

t1, t2, t3 = st.tabs(["Config", "Results", "Files"])
with t1:
    st.dataframe(settings_table(run.config), hide_index=True, width="stretch")
    st.download_button("config.json", json.dumps(run.config, indent=2), file_name=f"{run.name}-config.json",
                       icon=":material/download:")
with t2:
    if run.results:
        st.markdown(_ui.removal_text(run.results) or "")
        if line := _ui.reduced_text(run.results):
            st.caption(line)
        st.dataframe(results_table(run.results), hide_index=True, width="stretch")
    elif run.damaged:
        st.info(f"No results to show: {run.damaged}.")
    else:
        st.info("No results yet: the run has not finished.")
with t3:
    files = sorted(p for p in run.path.rglob("*") if p.is_file())
    st.dataframe([{"file": str(p.relative_to(run.path)), "size (kB)": round(p.stat().st_size / 1024, 1)} for p in files],
                 hide_index=True, width="stretch")

st.subheader("Export")
if run.has_model:
    _ui.deploy_panel(run.path, key="runs-deploy")
    dest = st.text_input("Copy the sliced model to a new folder", placeholder=f"{_ui.runs_dir()}/exports/NAME",
                         help="A normal transformers folder: load it with AutoModelForCausalLM.from_pretrained(folder, "
                              "trust_remote_code=True). It must lie in the runs folder or in a folder of "
                              "$PG_PRUNE_APP_FOLDERS (set before starting the app).")
    if st.button("Export model"):
        try:
            out = export_run_model(run.path, dest.strip()) if dest.strip() else None
            if out is None:
                st.error("Give a destination folder.")
            else:
                st.success(f"Exported to {out}")
        except (UserError, OSError) as e:
            st.error(f"Cannot export: {e}")
    if run.has_masks:
        st.download_button("Download the masks (safetensors)", icon=":material/download:",
                           data=(run.path / MASKS_FILE).read_bytes(),
                           file_name=f"{run.name}-masks.safetensors")
else:
    st.info("The sliced model is exported when a run finishes.")

st.subheader("Delete")
confirm = st.checkbox(f"Yes, delete {run.name} and all its files", key=f"confirm-{run.name}", disabled=busy)
if st.button("Delete run", icon=":material/delete:", disabled=not confirm or busy, help="Stop its job first if it is running."):
    try:
        delete_run(run.path, jobs)
        if _ui.selected_run() == str(run.path):
            _ui.select_run(None)
        st.session_state["deleted-run"] = run.name  # shown once, after the page is redrawn without it
        st.rerun()
    except UserError as e:
        st.error(str(e))
