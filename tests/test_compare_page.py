"""Issue 49, "Compare as an instrument": the Compare page (pages/compare.py, engine/ui/compare.py) picks runs from a
sortable table kept in the URL, overlays their loss and held-out curves, diffs two runs' saved masks layer by layer,
keeps one colour per run and one parameter count per run, never offers a matching run that cannot exist or that
exists already, and keeps run A across pages.

Most tests build small fake run folders with the engine's own writers (PruneConfig.save, StepReport.to_json,
save_mask_artifact, atomic_write_text) and drive the app with streamlit.testing.v1.AppTest; one starts a real
matching run of the tiny model (tinystories-656k).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from test_app_masks import CALIB, FAST, ROOT, TINY, needs_tiny  # (the app tests' tiny model and fast settings)

SIZES = {"kv_groups": [4, 4], "channels": [384, 384], "layers": [1, 1]}  # the tiny model's units per layer


# --- fake runs, written by the engine's own writers ----------------------------------------------------------
def _rows(n_layers_units: list[int], removed: dict[int, list[int]]) -> list[list[int]]:
    return [[0 if j in removed.get(i, []) else 1 for j in range(n)] for i, n in enumerate(n_layers_units)]


def make_run(runs: Path, name: str, *, scope: str = "global", units=("kv_groups", "channels"), ratio: float = 0.3,
             steps: int = 3, method: str = "pg", budget: str = "params", finished: bool = True, removed=None,
             checkpoint: bool = False, losses=None, val=None, params_removed: int = 118_272,
             params_pruned: int = 538_240, ppl_pruned: float = 31.234567, age: int = 0, **extra) -> Path:
    """A run folder: config.json, metrics.jsonl (one StepReport per step, with its hard masks), and when finished
    masks.safetensors / masks.json and results.json. removed: unit type -> {layer: [unit indices removed]}."""
    import torch

    from engine.settings.config import PruneConfig
    from engine.export.artifacts import save_mask_artifact
    from engine.storage.io import atomic_write_text
    from engine.run.state import StepReport
    from engine.model.units import UnitLayout

    run = runs / name
    run.mkdir(parents=True)
    config = PruneConfig(model=str(TINY), scope=scope, units=list(units), prune_ratio=ratio, steps=steps,
                         method=method, budget=budget, calib=str(CALIB), **{**FAST, **extra})
    config.save(run / "config.json")
    removed = removed or {}
    masks = {u: _rows(SIZES[u], removed.get(u, {})) for u in units}
    lines = []
    losses = losses if losses is not None else [[3.0 - 0.1 * s, 3.2 - 0.1 * s] for s in range(steps)]
    for s, ls in enumerate(losses, 1):
        kept = {u: [sum(r) / len(r) for r in rows] for u, rows in masks.items()}
        lines.append(StepReport(step=s, total_steps=steps, losses=ls, baseline=0.0, lr=0.02,
                                mean_score={u: [0.7] * 2 for u in units}, kept_fraction=kept,
                                head_scores=[[0.8] * 4, [0.6] * 4] if "kv_groups" in units else None, seconds=0.1,
                                eta_seconds=0.0, val_ppl=(val or {}).get(s), masks=masks).to_json())
    atomic_write_text(run / "metrics.jsonl", "".join(ln + "\n" for ln in lines))
    if checkpoint:
        atomic_write_text(run / "checkpoint.pt", "a checkpoint\n")  # (only its presence is read: "stopped")
    if finished:
        layout = UnitLayout({u: SIZES[u] for u in units})
        flat = {u: torch.tensor([x for row in rows for x in row], dtype=torch.float32) for u, rows in masks.items()}
        scores = {u: 0.25 + 0.5 * m for u, m in flat.items()}
        save_mask_artifact(run, str(TINY), layout, scores, flat, {u: s.clone() for u, s in scores.items()},
                           {u: m.clone() for u, m in flat.items()})
        results = {"status": "done", "ppl_dense": 20.0, "ppl_init": 40.123456, "ppl_pruned": ppl_pruned,
                   "params_dense": 656_000, "params_pruned": params_pruned, "params_removed": params_removed,
                   "removed_of_decoder": params_removed / 393_728, "removed_of_model": params_removed / 656_000,
                   "params_removed_by_unit_type": {u: params_removed // len(units) for u in units},
                   "kept_per_layer": {u: [sum(r) for r in rows] for u, rows in masks.items()},
                   "units_per_layer": {u: SIZES[u] for u in units}, "steps": steps, "final_mask": "last",
                   "mask_step": steps, "val_ppl_init": 50.0, "seconds_by_phase": {"load": 1.0, "total": 1.0}}
        atomic_write_text(run / "results.json", json.dumps(results, indent=2) + "\n")
    t = time.time() - 1000 + age  # list_runs orders by config.json's time: a larger age is newer
    os.utime(run / "config.json", (t, t))
    return run


# --- AppTest helpers ---------------------------------------------------------------------------------------------
def compare(monkeypatch, runs: Path, url: str | None = None):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("PG_PRUNE_RUNS_DIR", str(runs))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=300)  # (a first run on 2 loaded cores is slow)
    at.run()
    if url is not None:
        at.query_params["runs"] = url
    at.switch_page("pages/compare.py").run()
    assert not at.exception, at.exception
    return at


def picker(at):
    return next(d for d in at.dataframe if (d.key or "").startswith("cmp_pick-"))


def pick(at, names: list[str], clear: bool = True):
    """Tick the table's rows of these runs, in this order (as a user ticks their boxes); clear: untick the
    page's own pick first."""
    for rows in ([], names) if clear else (names,):
        table = picker(at)
        row = {n: i for i, n in enumerate(table.value["run"])}
        at.session_state[table.key] = {"selection": {"rows": [row[n] for n in rows], "columns": [], "cells": []}}
        at.run()
        assert not at.exception, at.exception
    return at


def picked(at) -> list[str]:
    """The runs the page compares, A first: its header line, "**A** `name`: ..." per run."""
    line = next(m.value for m in at.markdown if m.value.startswith("**A** `"))
    return [part.split("`")[1] for part in line.split("  \n")]


def diff_table(at):
    """The per-layer diff of A's and B's masks (the table with a "unit type" column)."""
    return next(d.value for d in at.dataframe if "unit type" in d.value.columns)


def charts(at) -> dict[str, dict]:
    return {json.loads(c.proto.spec)["layout"]["title"]["text"].split("<br>")[0]: json.loads(c.proto.spec)
            for c in at.get("plotly_chart")}


def chart(at, start: str) -> dict:
    return next(spec for title, spec in charts(at).items() if title.startswith(start))


def trace_colour(trace: dict) -> str:
    return (trace.get("line") or {}).get("color") or (trace.get("marker") or {}).get("color")


# --- the pick: a sortable table, names shown, kept in the URL and across pages ------------------------------------
@needs_tiny
def test_runs_are_picked_from_a_sortable_table_with_names_and_kept_in_the_url(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    names = [make_run(runs, f"run-{k}", scope=s, age=k).name for k, s in enumerate(("global", "uniform", "global"))]
    at = compare(monkeypatch, runs)
    table = picker(at)
    assert table.proto.selection_mode and "run" in table.value.columns  # rows can be picked; names are shown
    assert sorted(table.value["run"]) == sorted(names)
    assert json.loads(table.proto.columns)["run"]["pinned"] is True  # the name stays in view when scrolled
    pick(at, ["run-1", "run-0"])  # B after A
    assert picked(at) == ["run-1", "run-0"]
    url = at.query_params["runs"]
    assert (url if isinstance(url, str) else ",".join(url)) == "run-1,run-0"
    pick(at, ["run-2", "run-1", "run-0"], clear=False)  # a third run joins last: A and B stay
    assert picked(at) == ["run-1", "run-0", "run-2"]
    # a reload (a new session) with that URL opens on the same pick
    again = compare(monkeypatch, runs, url="run-1,run-0,run-2")
    assert picked(again) == ["run-1", "run-0", "run-2"]
    rows = picker(again).proto.selection_default
    assert sorted(json.loads(rows)["selection"]["rows"]) == sorted(
        list(picker(again).value["run"]).index(n) for n in ("run-1", "run-0", "run-2"))


@needs_tiny
def test_switching_pages_keeps_run_a(tmp_path, monkeypatch):
    """Run A stays the run picked, not the newest global run (here one stopped at 1 of 200 steps)."""
    runs = tmp_path / "runs"
    make_run(runs, "old-global", age=1)
    make_run(runs, "old-uniform", scope="uniform", age=2)
    make_run(runs, "newest-global-stopped", steps=200, losses=[[3.0, 3.1]], finished=False, checkpoint=True, age=3)
    at = compare(monkeypatch, runs)
    pick(at, ["old-global", "old-uniform"])
    for page in ("pages/prune.py", "pages/runs.py"):
        at.switch_page(page).run()
        at.switch_page("pages/compare.py").run()
        assert not at.exception, at.exception
        assert picked(at) == ["old-global", "old-uniform"], page
    next(b for b in at.button if b.label == "Swap A and B").click().run()
    assert picked(at) == ["old-uniform", "old-global"]
    at.switch_page("pages/prune.py").run()
    at.switch_page("pages/compare.py").run()
    assert picked(at) == ["old-uniform", "old-global"]


# --- curves, masks and colours ----------------------------------------------------------------------------------
@needs_tiny
def test_loss_and_held_out_curves_of_several_runs_overlaid_one_colour_per_run(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    make_run(runs, "a", losses=[[3.0, 2.0], [2.5, 1.5], [2.0, 1.0]], val={2: 30.0, 3: 25.0}, age=1)
    make_run(runs, "b", scope="uniform", losses=[[4.0, 4.0], [3.0, 3.0]], val={2: 35.0}, age=2)
    make_run(runs, "c-running", steps=50, losses=[[5.0, 5.0]], finished=False, age=3)  # no results: no bars
    at = compare(monkeypatch, runs)
    pick(at, ["c-running", "a", "b"])  # A has not finished: its colour is the first, in every chart
    curves = chart(at, "Loss and held-out curves")["data"]
    loss = {t["name"]: t for t in curves if t.get("xaxis", "x") == "x"}
    val = {t["name"]: t for t in curves if t.get("xaxis") == "x2"}
    assert loss["B · a"]["y"] == [2.5, 2.0, 1.5] and loss["C · b"]["y"] == [4.0, 3.0]  # the mean over the samples
    assert loss["A · c-running"]["y"] == [5.0]
    assert val["B · a"]["x"] == [0, 2, 3] and val["B · a"]["y"] == [50.0, 30.0, 25.0]  # step 0: the init mask's
    colour = {}
    for title in ("Loss and held-out curves", "Sparsity per layer", "Perplexity"):
        for t in chart(at, title)["data"]:
            colour.setdefault(t["name"], set()).add(trace_colour(t))
    assert all(len(c) == 1 for c in colour.values()), colour  # one colour per run, in every chart
    assert len({next(iter(c)) for c in colour.values()}) == 3  # and three runs, three colours
    bars = {t["name"] for t in chart(at, "Perplexity")["data"]}
    assert bars == {"B · a", "C · b"}


@needs_tiny
def test_per_layer_kept_and_removed_diff_reads_each_runs_saved_masks(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    make_run(runs, "a", removed={"kv_groups": {1: [0, 2]}, "channels": {0: list(range(100))}}, age=1)
    make_run(runs, "b", scope="uniform", removed={"kv_groups": {0: [3], 1: [2]}, "channels": {0: list(range(50, 130))}},
             age=2)
    at = compare(monkeypatch, runs)
    pick(at, ["a", "b"])
    table = diff_table(at)
    heads = table[table["unit type"].str.startswith("KV")].to_dict("records")
    assert [(r["layer"], r["A keeps"], r["B keeps"], r["both keep"], r["A only"], r["B only"], r["both remove"])
            for r in heads] == [(0, 4, 3, 3, 1, 0, 0), (1, 2, 3, 2, 0, 1, 1)]
    ch0 = table[table["unit type"] == "MLP channels"].to_dict("records")[0]
    assert (ch0["A keeps"], ch0["B keeps"], ch0["both keep"], ch0["A only"], ch0["B only"], ch0["both remove"]) == (
        284, 304, 254, 30, 50, 50)
    fig = chart(at, "KV groups (attention heads): A's mask against B's")
    assert fig["data"][0]["z"] == [[3, 3, 3, 2], [1, 3, 0, 3]]  # 3 both, 2 A only, 1 B only, 0 neither
    assert any("A: the final" in c.value and "B: the final" in c.value for c in at.caption)
    # a run that has not finished: its last step's mask (metrics.jsonl)
    make_run(runs, "c-live", finished=False, removed={"kv_groups": {0: [0]}}, age=3)
    at = compare(monkeypatch, runs)
    pick(at, ["a", "c-live"])
    assert any("B: the current (step 3)" in c.value for c in at.caption), [c.value for c in at.caption]
    table = diff_table(at)
    assert table[table["unit type"].str.startswith("KV")]["B keeps"].tolist() == [3, 4]


# --- the matching run: never one that cannot exist, never a duplicate ----------------------------------------------
@needs_tiny
def test_a_joint_run_is_offered_no_uniform_match(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    make_run(runs, "joint", units=("layers", "kv_groups", "channels"), layer_init="layerwise-ppl")
    at = compare(monkeypatch, runs)
    assert not any("matching" in b.label for b in at.button), [b.label for b in at.button]
    line = next(c.value for c in at.caption if c.value.startswith("No uniform run can match run A"))
    assert "joint" in line and "--" not in line  # in the page's words, not flags
    assert sorted(p.name for p in runs.iterdir() if p.is_dir()) == ["joint"]


@needs_tiny
def test_an_existing_match_is_offered_to_compare_not_started_again(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    make_run(runs, "a-global", age=1)
    make_run(runs, "a-uniform", scope="uniform", age=2)  # A's match: same model, units, budget, rate, steps
    make_run(runs, "other", scope="uniform", ratio=0.5, age=3)
    at = compare(monkeypatch, runs)
    pick(at, ["a-global", "other"])
    assert not any("Start the matching" in b.label for b in at.button)
    assert any("a-uniform" in i.value for i in at.info), [i.value for i in at.info]
    next(b for b in at.button if "Compare A with its uniform run" in b.label).click().run()
    assert picked(at) == ["a-global", "a-uniform"]
    assert not any("Compare A with" in b.label or "Start the matching" in b.label for b in at.button)
    assert sorted(p.name for p in runs.iterdir() if p.is_dir()) == ["a-global", "a-uniform", "other"]


@needs_tiny
def test_started_match_is_run_b_labelled_running_and_then_no_button(tmp_path, monkeypatch):
    """Start the matching uniform run: while it runs it is run B, labelled running (its folder holds a
    checkpoint, which alone would say "stopped"); after it finishes it is still run B, and the button is gone."""
    runs = tmp_path / "runs"
    make_run(runs, "a-global", steps=40, checkpoint_every=1, val_every=0, final_mask="last")
    at = compare(monkeypatch, runs)
    next(b for b in at.button if "Start the matching uniform run" in b.label).click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    new = runs / next(s.value for s in at.success if s.value.startswith("Started ")).split(" ")[1].rstrip(":")
    seen_running = False
    end = time.time() + 300
    while time.time() < end:
        at.run()
        assert not at.exception, at.exception
        if len(picked(at)) > 1:
            assert picked(at) == ["a-global", new.name]
            row = picker(at).value.set_index("run").loc[new.name]
            if (new / "checkpoint.pt").exists() and not (new / "results.json").exists() and row["status"] == "running":
                head = next(m.value for m in at.markdown if m.value.startswith("**A** `"))
                seen_running = seen_running or f"`{new.name}`: uniform, 30%, running" in head
            if row["status"] == "done":
                break
        time.sleep(0.5)
    assert seen_running
    assert picked(at) == ["a-global", new.name]
    assert not any("Start the matching" in b.label or "Compare A with" in b.label for b in at.button)
    assert sorted(p.name for p in runs.iterdir() if p.is_dir()) == sorted(["a-global", new.name])


# --- one parameter count; settings that apply to both; cells -----------------------------------------------------
@needs_tiny
def test_one_parameter_count_per_run_the_results_params_removed(tmp_path, monkeypatch):
    """results.json's params_removed (118,272, the budget's count, Prune's) is what Compare says the run removed;
    dense minus the exported model's count (117,760: bias compensation adds 512 biases) is never shown."""
    runs = tmp_path / "runs"
    make_run(runs, "a", params_removed=118_272, params_pruned=538_240, age=1)
    make_run(runs, "b", scope="uniform", params_removed=118_300, params_pruned=538_200, age=2)
    at = compare(monkeypatch, runs)
    pick(at, ["a", "b"])
    table = picker(at).value.set_index("run")
    assert table.loc["a", "removed"] == 118_272 and table.loc["b", "removed"] == 118_300
    said = next(s.value for s in at.success if "removed the same number of parameters" in s.value)
    assert "A 118,272" in said and "B 118,300" in said
    page = " ".join(e.value for e in [*at.markdown, *at.success, *at.warning, *at.info, *at.caption])
    assert "117,760" not in page and "117760" not in page


def test_differences_name_only_settings_that_apply_to_both():
    from engine.ui.compare import differences

    base = dict(model="m", units=["kv_groups", "channels"], prune_ratio=0.3, steps=50, calib="c")
    pg = {**base, "method": "pg", "lr": 0.02, "num_mask_samples": 8}
    flap = {**base, "method": "flap", "lr": 0.5, "num_mask_samples": 4, "steps": 10}
    labels = [d[0] for d in differences(pg, flap)]
    assert "Method" in labels[0] or any(lbl.startswith("Method") for lbl in labels)
    for name in ("Learning rate", "Steps", "N_s", "Mask samples"):  # the one-shot run has no steps
        assert not any(name.lower() in lbl.lower() for lbl in labels), labels
    # whole-layer settings differ only where both prune whole layers
    layers = {**pg, "units": ["layers", "kv_groups", "channels"], "layer_init": "layerwise-ppl"}
    labels = [d[0] for d in differences(pg, layers)]
    assert not any("layer init" in lbl.lower() or "layer metric" in lbl.lower() for lbl in labels), labels
    assert any(lbl.startswith("Units") for lbl in labels)
    both = [d for d in differences({**layers, "layer_init": "sleb"}, layers)]
    assert len(both) == 1 and both[0][1:] == ("sleb", "layerwise-ppl")
    # a method's options: compared within one method, and only where they apply (pg's window T: moving average)
    a = {**pg, "method_options": {"baseline": "leave-one-out", "baseline_window": 5}}
    b = {**pg, "method_options": {"baseline": "leave-one-out", "baseline_window": 9}}
    assert differences(a, b) == []
    c = {**pg, "method_options": {"baseline": "moving-average", "baseline_window": 5}}
    d = {**pg, "method_options": {"baseline": "moving-average", "baseline_window": 9}}
    assert [x[1:] for x in differences(c, d)] == [(5, 9)]
    # scoring samples refit: a difference only between two refitting runs with steps
    refit = {**pg, "reconstruct": True}
    assert [x[1:] for x in differences({**refit, "step_refit": True}, refit)] == [(True, False)]
    assert differences({**flap, "step_refit": True}, flap) == []  # a one-shot run scores no samples


@needs_tiny
def test_differences_list_on_the_page_and_cells_show_dash_and_two_decimals(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    make_run(runs, "pg-run", ppl_pruned=31.234567, age=1)
    make_run(runs, "flap-run", scope="uniform", method="flap", steps=3, lr=0.5, age=2)
    make_run(runs, "live", steps=50, finished=False, age=3)
    at = compare(monkeypatch, runs)
    pick(at, ["pg-run", "flap-run"])
    warning = next(w.value for w in at.warning if "not like for like" in w.value)
    assert "**Method**: A pg, B flap" in warning and "Learning rate" not in warning
    table = picker(at)
    assert table.proto.placeholder == "—"  # a missing value (the live run's perplexities) shows a dash, not None
    live = table.value.set_index("run").loc["live"]
    assert live[["ppl dense", "ppl init", "ppl pruned", "removed"]].isna().all()
    config = json.loads(table.proto.columns)
    for c in ("ppl dense", "ppl init", "ppl pruned"):
        assert config[c]["type_config"]["format"] == "%.2f", config[c]
    bars = chart(at, "Perplexity")["data"]
    assert "31.23" in next(t for t in bars if t["name"] == "A · pg-run")["text"]


def test_pure_pick_helpers():
    from engine.ui.compare import merge_order, parse_names, run_colours, table_key

    assert parse_names("a, b,,a,c") == ["a", "b", "c"] and parse_names(None) == [] and parse_names(["a,b", "c"]) == [
        "a", "b", "c"]
    assert merge_order(["a", "b"], ["c", "b", "a"]) == ["a", "b", "c"]  # A stays A
    assert merge_order(["a", "b", "c"], ["c", "b"]) == ["b", "c"]
    assert table_key(["x", "y"]) == table_key(["y", "x"]) != table_key(["x", "y", "z"])
    colours = run_colours(["p", "q", "r"])
    assert len(set(colours.values())) == 3


def test_curves_and_mask_diff_rows_are_the_runs_own():
    from engine.ui.compare import curves, mask_diff_problem, mask_diff_rows

    history = [{"step": 1, "losses": [2.0, 4.0]}, {"step": 2, "losses": [1.0, 3.0], "val_ppl": 12.5}]
    assert curves(history, {"val_ppl_init": 20.0}) == {"steps": [1, 2], "loss": [3.0, 2.0], "val_steps": [0, 2],
                                                       "val_ppl": [20.0, 12.5]}
    a = {"kv_groups": [[1, 1, 0, 0]], "layers": [[1]]}
    b = {"kv_groups": [[1, 0, 1, 0]], "layers": [[0]]}  # B removes the layer whole: none of its groups kept
    rows = mask_diff_rows(a, b)
    by = {r["unit type"]: r for r in rows}
    assert by["Whole layers"]["A only"] == 1
    assert (by["KV groups (attention heads)"]["B keeps"], by["KV groups (attention heads)"]["A only"]) == (0, 2)
    assert mask_diff_problem({"kv_groups": [[1, 1]]}, {"kv_groups": [[1, 1, 1]]}) is not None
    assert mask_diff_problem({"kv_groups": [[1]]}, {"channels": [[1]]}) is not None


# --- the run a page shows is kept in the URL (issue 66) ----------------------------------------------------------
def test_the_loaded_run_is_kept_in_the_url_and_a_reload_shows_it_again(monkeypatch, tmp_path):
    """Loading a run sets ?run=NAME; a fresh session (a browser reload) with that URL shows the same run on Prune;
    a name that is no run folder directly in the runs folder (a stale or crafted link) shows none."""
    from streamlit.testing.v1 import AppTest

    from engine.ui.paths import run_from_url

    runs = tmp_path / "runs"
    make_run(runs, "alpha")
    monkeypatch.setenv("PG_PRUNE_RUNS_DIR", str(runs))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=300)
    at.run()
    at.session_state["selected_run"] = str(runs / "alpha")
    at.switch_page("pages/prune.py").run()
    assert not at.exception, at.exception
    assert at.query_params["run"] in (["alpha"], "alpha")  # (AppTest keeps a list per key)
    again = AppTest.from_file(str(ROOT / "app.py"), default_timeout=300)  # a reload: a new session, the same URL
    again.query_params["run"] = "alpha"
    again.switch_page("pages/prune.py").run()
    assert not again.exception, again.exception
    assert any("Run **alpha**" in c.value for c in again.caption), [c.value for c in again.caption]
    for bad in ("..", "../runs/alpha", "/etc", "", "missing"):
        assert run_from_url(bad, runs) is None
    assert run_from_url("alpha", runs) == runs / "alpha"


def test_a_runs_summary_is_read_again_when_one_of_its_files_changes(tmp_path):
    """read_run keeps a summary while the run's files stay as they were, and reads again when one changes: a
    finished run rewritten, steps appended, results.json removed or damaged."""
    from engine.ui.jobs import read_run

    run = make_run(tmp_path / "runs", "alpha", ppl_pruned=31.0)
    assert read_run(run).results["ppl_pruned"] == 31.0 and read_run(run).status == "done"
    results = json.loads((run / "results.json").read_text())
    (run / "results.json").write_text(json.dumps({**results, "ppl_pruned": 29.25}))  # (in place: another size)
    assert read_run(run).results["ppl_pruned"] == 29.25
    steps = read_run(run).steps_done
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"step": steps + 1}) + "\n")
    assert read_run(run).steps_done == steps + 1
    (run / "results.json").write_text("{not json")
    assert read_run(run).damaged and read_run(run).results is None
    (run / "results.json").unlink()
    assert read_run(run).results is None and not read_run(run).damaged
    (run / "config.json").unlink()
    assert read_run(run) is None
