"""Compare: a global and a uniform run on the same model and rate, side by side."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # for _ui, beside this page
import _ui  # noqa: E402
import streamlit as st  # noqa: E402

from engine.ui import figures  # noqa: E402
from engine.config import PruneConfig  # noqa: E402
from engine.errors import UserError  # noqa: E402
from engine.unit_types import UNIT_TYPES  # noqa: E402
from engine.ui.jobs import new_run_name  # noqa: E402
from engine.ui.settings import config_differences, same_plan  # noqa: E402

st.title(":material/compare_arrows: Compare: global vs uniform")
st.markdown("**Global** scope shares one budget across all layers, so the method decides how much to cut in each "
            "layer; **uniform** cuts the same fraction everywhere. Same model, rate and step budget: which "
            "profile does the method learn, and what does it cost in perplexity?")

all_runs = _ui.runs()
if not all_runs:
    st.info("No runs yet: start one on **Prune**.")
    st.stop()


def pick_default(scope: str, like=None):
    """The newest run of this scope; with `like`, one that makes a fair pair with it (same model, units, budget,
    rate, steps and method)."""
    for r in all_runs:
        if r.config.get("scope") == scope and (like is None or same_plan(r.config, like.config)):
            return r
    return None


a_default = pick_default("global") or all_runs[0]
b_default = pick_default("uniform", like=a_default) or pick_default("uniform") or \
    next((r for r in all_runs if r.path != a_default.path), None)
jobs = _ui.job_manager()
c1, c2 = st.columns(2)
a = c1.selectbox("Run A", all_runs, index=all_runs.index(a_default), format_func=_ui.run_label, key="cmp_a")
b_options = [r for r in all_runs if r.path != a.path]
b = None
if b_options:
    b_index = b_options.index(b_default) if b_default in b_options else 0
    b = c2.selectbox("Run B", b_options, index=b_index, format_func=_ui.run_label, key="cmp_b")
else:
    c2.info("Only one run on disk.")

chosen = [r for r in (a, b) if r is not None]

# One summary row per run.
rows = []
for ab, r in zip("AB", chosen):
    c, res = r.config, r.results or {}
    rows.append({  # the key columns first, so that they fit a 1400 px window
        "id": ab, "scope": c.get("scope"), "rate": f"{c.get('prune_ratio', 0):.0%}", "removed": _ui.removed_short(res),
        "ppl pruned": res.get("ppl_pruned"), "speed-up": _ui.speedup_short(c, res),
        "params": _ui.fmt_params(res.get("params_pruned")) if res else "—", "steps": f"{r.steps_done}/{c.get('steps')}",
        "status": "running" if jobs.busy_with(r.path) else r.status, "ppl init": res.get("ppl_init"),
        "budget": c.get("budget", "units"), "units": ",".join(c.get("units", [])), "ppl dense": res.get("ppl_dense"),
        "run": r.name,
    })
st.dataframe(rows, hide_index=True, width="stretch", column_config=_ui.COMPACT_COLUMNS)

differs = config_differences(a.config, b.config) if b is not None else []
if differs:
    st.warning("These two runs differ in more than their scope, so the comparison is not like for like: "
               + "; ".join(f"**{label}**: A {_ui.short(va)}, B {_ui.short(vb)}" for label, va, vb in differs) + ".")
removed = [r.results["params_dense"] - r.results["params_pruned"] for r in chosen
           if r.results and "params_dense" in r.results and "params_pruned" in r.results]
if len(removed) == 2:
    dense = chosen[0].results["params_dense"]
    if abs(removed[0] - removed[1]) > 0.005 * dense:
        st.warning(f"These two runs removed different numbers of parameters: A {removed[0]:,}, B {removed[1]:,} "
                   f"({(removed[0] - removed[1]) / dense:+.1%} of the model). Their perplexities are not like for "
                   "like. Under `--budget units` a rate is a fraction of each unit pool's count, and a uniform run "
                   "rounds per layer; `--budget params` (the default) removes the same share of parameters in "
                   "both scopes.")
    else:
        st.success(f"Both runs removed the same parameters, within 0.5 % of the model: A {removed[0]:,}, "
                   f"B {removed[1]:,}.")
elif b is not None:
    st.info("Whether the two runs removed the same parameters shows once both have finished.")

order = list(UNIT_TYPES)  # the registry's order; a unit type it no longer has goes last
units = sorted({u for r in chosen for u in r.config.get("units", [])}, key=lambda u: order.index(u) if u in order else len(order))
labels = {str(r.path): f"{ab} · {r.config.get('scope')}" for ab, r in zip("AB", chosen)}
profiles = [(labels[str(r.path)], _ui.run_figures_for_compare(r)) for r in chosen]
st.plotly_chart(figures.sparsity_profiles(profiles, units), key="cmp-profiles", width="stretch", config=_ui.PLOT_CONFIG)
finished = [(labels[str(r.path)], r.results) for r in chosen if r.results]
if finished:
    st.plotly_chart(figures.perplexity_bars(finished), key="cmp-ppl", width="stretch", config=_ui.PLOT_CONFIG)
else:
    st.info("Perplexities appear once a run has finished.")

# Offer the missing counterpart of run A.
def matching_config(config: dict, results: dict | None, scope: str) -> dict:
    """Run A's settings in the other scope, on the same parameter budget."""
    if config.get("budget", "units") == "params":
        return {**config, "scope": scope}
    if not results or "removed_of_decoder" not in results:
        raise UserError("run A counted units (--budget units) and has not finished: its parameter budget is not "
                        "known yet; wait for it, or start the other scope on Prune with --budget params")
    return {**config, "scope": scope, "budget": "params", "prune_ratio": round(results["removed_of_decoder"], 6)}


other = "uniform" if a.config.get("scope") == "global" else "global"
snap = jobs.snapshot()
if snap.active:
    # a run is going (this page's Start, or Prune's): its progress, redrawn until it ends
    @st.fragment(run_every=1.5)
    def progress() -> None:
        s = jobs.snapshot()
        if not s.active:
            st.rerun()  # the whole page: the finished run joins the table
        last = s.last
        total = (last or {}).get("total_steps") or (s.config or {}).get("steps", 1)
        done = last["step"] if last else 0
        st.progress(min(done / total, 1.0), text=f"Running `{Path(s.out_dir).name}` ({(s.config or {}).get('scope')}): "
                                                   f"{done}/{total} steps · {s.phase}")

    progress()
elif b is None or b.config.get("scope") == a.config.get("scope") or not same_plan(a.config, b.config):
    st.markdown(f"No **{other}** run with run A's model, units, budget, rate and steps yet.")
    if st.button(icon=":material/play_arrow:", label=f"Start the matching {other} run (same model, settings and parameter budget)",
                 help="Removes the same share of the decoder's parameters as run A (under --budget params; a run A "
                      "made under --budget units is matched by the share it actually removed)."):
        try:
            config = PruneConfig.from_dict(matching_config(a.config, a.results, other)).validate()  # (a joint run has no uniform match)
            out = _ui.runs_dir() / new_run_name(config)
            jobs.start(config, out)
            _ui.select_run(out)
            st.session_state["cmp-started"] = out.name
            st.rerun()
        except UserError as e:
            st.error(f"Cannot start: {e}")
if (started := st.session_state.pop("cmp-started", None)):
    st.success(f"Started {started}: its progress is above, and on **Prune**.")
