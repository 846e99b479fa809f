"""Compare: runs side by side. Pick them in the table (kept in the URL); the first two, A and B, are compared setting
by setting and mask by mask; every picked run has one colour in every chart. The pieces are engine/ui/compare.py's."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # for _ui, beside this page
import _ui  # noqa: E402
import streamlit as st  # noqa: E402

from engine.settings.config import PruneConfig  # noqa: E402
from engine.errors import UserError  # noqa: E402
from engine.ui import compare as C  # noqa: E402
from engine.ui import figures  # noqa: E402
from engine.ui.jobs import new_run_name, read_metrics  # noqa: E402
from engine.ui.settings import estimated_speedup  # noqa: E402
from engine.model.unit_types import UNIT_TYPES  # noqa: E402

st.title(":material/compare_arrows: Compare runs")
st.markdown("Pick runs in the table (click a row's box; a header sorts). The first you pick is **A**, the next **B**: "
            "they are compared setting by setting and mask by mask, and every picked run keeps one colour in every "
            "chart. **Global** scope shares one budget across all layers, so the method decides how much to cut in "
            "each layer; **uniform** cuts the same fraction everywhere.")

runs = [r for r in _ui.runs() if not r.damaged]  # (a damaged run is listed on Runs, with the reason)
if not runs:
    st.info("No runs yet: start one on **Prune**.")
    st.stop()

jobs = _ui.job_manager()
ss = st.session_state
by_name = {r.name: r for r in runs}
if C.PICK_KEY not in ss:  # a new session (a reload, a shared link): the URL's pick, else the default
    ss[C.PICK_KEY] = [n for n in C.parse_names(st.query_params.get_all(C.URL_KEY)) if n in by_name] \
        or C.default_pick(runs)


def repick(names: list[str]) -> None:
    """Set the pick from a button: a new table (its key changes), seeded with it."""
    ss[C.PICK_KEY] = list(names)
    ss["cmp_generation"] = ss.get("cmp_generation", 0) + 1


# --- the picker -----------------------------------------------------------------------------------------------
pick = [n for n in ss[C.PICK_KEY] if n in by_name]
row_of = {r.name: i for i, r in enumerate(runs)}
key = f"{C.table_key(list(by_name))}-{ss.get('cmp_generation', 0)}"
columns = {
    "run": st.column_config.TextColumn("run", width=310, pinned=True, help="the run's folder"),
    "rate": st.column_config.NumberColumn("rate", format="percent", width="small"),
    "removed": st.column_config.NumberColumn("removed", format="localized", width=90,
                                             help="parameters removed (results.json's params_removed: the count the "
                                                  "run's budget removed, as on Prune)"),
    "of decoder": st.column_config.NumberColumn("of decoder", format="percent", width="small",
                                                help="share of the decoder layers' parameters removed"),
    **{c: st.column_config.NumberColumn(c, format="%.2f", width="small") for c in ("ppl dense", "ppl init", "ppl pruned")},
    "speed-up": st.column_config.NumberColumn("speed-up", format="%.2f×", width="small",
                                              help="estimated speed-up per token (dense over kept matrix parameters)"),
    **{c: st.column_config.Column(c, width="small") for c in ("status", "scope", "budget", "steps", "method")},
}
rows = C.table_rows(runs, busy=lambda r: jobs.busy_with(r.path), speedup=lambda r: estimated_speedup(r.config, r.results))
event = st.dataframe(rows, key=key, on_select="rerun", selection_mode="multi-row", hide_index=True, width="stretch",
                     selection_default={"selection": {"rows": [row_of[n] for n in pick]}}, placeholder="—",
                     column_config=columns)
picked = [runs[i].name for i in event.selection.rows if 0 <= i < len(runs)]
seen = ss.get(C.SEEN_KEY)
if seen is not None and seen[0] == key and list(seen[1]) != picked:  # the user changed the pick in this table
    ss[C.PICK_KEY] = C.merge_order(pick, picked)
ss[C.SEEN_KEY] = (key, picked)
if st.query_params.get_all(C.URL_KEY) != [C.url_value(ss[C.PICK_KEY])]:  # the URL keeps the pick: a reload too
    st.query_params[C.URL_KEY] = C.url_value(ss[C.PICK_KEY])

order = [n for n in ss[C.PICK_KEY] if n in by_name]
if not order:
    st.info("Pick one or more runs in the table: the first is run **A**, the next run **B**.")
    st.stop()
chosen = [by_name[n] for n in order]
colours = C.run_colours(order)
labels = {n: f"{C.letter(i)} · {n}" for i, n in enumerate(order)}
status = {r.name: C.run_status(r, jobs.busy_with(r.path)) for r in chosen}
a = chosen[0]
b = chosen[1] if len(chosen) > 1 else None
st.markdown("  \n".join(f"**{C.letter(i)}** `{r.name}`: {r.config.get('scope')}, {r.config.get('prune_ratio', 0):.0%}, "
                        f"{status[r.name]}" for i, r in enumerate(chosen)))
if b is not None:
    st.button("Swap A and B", icon=":material/swap_horiz:", key="cmp-swap",
              on_click=repick, args=([b.name, a.name, *order[2:]],))

# --- A against B: settings and parameters -----------------------------------------------------------------------
if b is not None:
    differs = C.differences(a.config, b.config)
    if differs:
        st.warning("These two runs differ in more than their scope, so the comparison is not like for like: "
                   + "; ".join(f"**{label}**: A {_ui.short(va)}, B {_ui.short(vb)}" for label, va, vb in differs) + ".")
    removed = [C.params_removed(r.results) for r in (a, b)]
    if None not in removed:
        dense = a.results["params_dense"]
        if abs(removed[0] - removed[1]) > 0.005 * dense:
            st.warning(f"These two runs removed different numbers of parameters: A {removed[0]:,}, B {removed[1]:,} "
                       f"({(removed[0] - removed[1]) / dense:+.1%} of the model). Their perplexities are not like for "
                       "like. Under the units budget a rate is a fraction of each unit pool's count, and a uniform run "
                       "rounds per layer; the parameter budget (the default) removes the same share of parameters in "
                       "both scopes.")
        else:
            st.success(f"Both runs removed the same number of parameters (not the same units), within 0.5 % of the "
                       f"model: A {removed[0]:,}, B {removed[1]:,}.")
    else:
        st.info("Whether the two runs removed the same number of parameters shows once both have finished.")

# --- charts: one colour per run -------------------------------------------------------------------------------
order_types = list(UNIT_TYPES)  # the registry's order; a unit type it no longer has goes last
units = sorted({u for r in chosen for u in r.config.get("units", [])},
               key=lambda u: order_types.index(u) if u in order_types else len(order_types))
st.plotly_chart(figures.sparsity_profiles([(labels[r.name], C.kept_fractions(r)) for r in chosen], units,
                                          colours=[colours[r.name] for r in chosen]),
                key="cmp-profiles", width="stretch", config=_ui.PLOT_CONFIG)
curves = [(labels[r.name], colours[r.name], C.curves(read_metrics(r.path), r.results)) for r in chosen]
if any(cv["steps"] or cv["val_steps"] for _, _, cv in curves):
    st.plotly_chart(C.curves_figure(curves), key="cmp-curves", width="stretch", config=_ui.PLOT_CONFIG)
finished = [r for r in chosen if r.results]
if finished:
    st.plotly_chart(figures.perplexity_bars([(labels[r.name], r.results) for r in finished],
                                            colours=[colours[r.name] for r in finished]),
                    key="cmp-ppl", width="stretch", config=_ui.PLOT_CONFIG)
else:
    st.info("Perplexities appear once a run has finished.")

# --- A's mask against B's, layer by layer ---------------------------------------------------------------------
if b is not None:
    st.subheader("Masks: A against B, layer by layer")
    ma, mb = C.run_masks(a), C.run_masks(b)
    if ma is None or mb is None:
        st.info("A mask shows once both runs have one: after their first step (its hard mask), or once finished "
                "(the saved mask).")
    elif (problem := C.mask_diff_problem(ma[1], mb[1])) is not None:
        st.info(f"No unit-by-unit comparison: {problem}.")
    else:
        st.caption(f"A: the {ma[0]} mask · B: the {mb[0]} mask. Read from each run's files (masks.safetensors, "
                   "or the last step's report in metrics.jsonl); a layer removed whole keeps none of its units.")
        common = [u for u in units if u in ma[1] and u in mb[1]]
        tabs = st.tabs([UNIT_TYPES[u].title if u in UNIT_TYPES else u for u in common]) if len(common) > 1 else [st.container()]
        for tab, u in zip(tabs, common):
            with tab:
                st.plotly_chart(C.mask_diff_figure(ma[1], mb[1], colours[a.name], colours[b.name], u),
                                key=f"cmp-mask-diff-{u}", width="stretch", config=_ui.PLOT_CONFIG)
        st.dataframe(C.mask_diff_rows(ma[1], mb[1]), hide_index=True, width="stretch", key="cmp-mask-diff-table")

# --- run A's match in the other scope -------------------------------------------------------------------------
other = C.other_scope(a.config.get("scope"))
match = C.counterpart(a, runs)
why_not = C.counterpart_problem(a, other) if match is None else None
snap = jobs.snapshot()
if snap.active:
    # a run is going (this page's Start, or Prune's): its progress, redrawn until it ends
    @st.fragment(run_every=1.5)
    def progress() -> None:
        s = jobs.snapshot()
        if not s.active:
            st.rerun()  # the whole page: the finished run's results join the table
        last = s.last
        total = (last or {}).get("total_steps") or (s.config or {}).get("steps", 1)
        done = last["step"] if last else 0
        st.progress(min(done / total, 1.0), text=f"Running `{Path(s.out_dir).name}` ({(s.config or {}).get('scope')}): "
                                                   f"{done}/{total} steps · {s.phase}")

    progress()
if match is not None:
    if b is None or b.name != match.name:
        st.info(f"Run A's matching {other} run is `{match.name}` ({C.run_status(match, jobs.busy_with(match.path))}).")
        st.button(f"Compare A with its {other} run", icon=":material/compare_arrows:", key="cmp-with-match",
                  on_click=repick, args=([a.name, match.name],))
elif why_not is not None:
    st.caption(f"No {other} run can match run A: {why_not}.")
elif snap.active:
    st.caption(f"The matching {other} run of A can start once the run above has ended.")
else:
    st.markdown(f"No **{other}** run with run A's model, units, budget, rate and steps yet.")
    if st.button(icon=":material/play_arrow:", label=f"Start the matching {other} run (same model, settings and parameter budget)",
                 key="cmp-start-match",
                 help="Removes the same share of the decoder's parameters as run A (under the parameter budget; a run A "
                      "made under the units budget is matched by the share it actually removed)."):
        try:
            config = PruneConfig.from_dict(C.matching_config(a.config, a.results, other)).resolved()
            out = _ui.runs_dir() / new_run_name(config)
            jobs.start(config, out)
            _ui.select_run(out)
            repick([a.name, out.name])  # B is the new run: once it is on disk, and after it finishes
            ss["cmp-started"] = out.name
            st.rerun()
        except UserError as e:
            st.error(f"Cannot start: {e}")
if (started := ss.pop("cmp-started", None)):
    st.success(f"Started {started}: it is run B; its progress is above, and on **Prune**.")
