"""Issue 49 in the app: every mask drawn is the run's own (StepReport.masks, masks.safetensors), damaged runs are
listed as damaged, and a tab can stay open all day (it redraws only while a job runs; a broken runs folder is one
line; invalid settings block Start; the heatmap's marks read on every colour).

AppTests on the tiny real model (tinystories-656k); each makes its own runs folder.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


TINY = ROOT.parent / "shared" / "models" / "tinystories-656k"
CALIB = ROOT.parent / "shared" / "data" / "c4" / "c4-en.llamafactory-c4_demo.300.text-only.json.gz"
FAST = dict(max_windows=4, init_batches=2, batch_size=2, seqlen=64, eval_seqlen=64, lr=0.02)
needs_tiny = pytest.mark.skipif(not TINY.is_dir(), reason=f"tiny model not found at {TINY}")


# --- pure pieces ----------------------------------------------------------------------------------
def test_mask_rows_round_trip_compactly():
    from engine.run.state import decode_mask_rows, encode_mask_rows, report_masks

    rows = [[1, 1, 0, 1], [0, 0, 0, 0, 1], [], [1] * 1536]
    encoded = encode_mask_rows(rows)
    assert encoded[0] == "4:d" and encoded[1] == "5:08" and encoded[2] == "0:"
    assert len(encoded[3]) == len("1536:") + 1536 // 4
    assert decode_mask_rows(encoded) == rows
    assert decode_mask_rows([[1, 0], [0, 1]]) == [[1, 0], [0, 1]]  # (lists pass through)
    assert report_masks({"step": 1}) is None  # a line from before reports carried masks
    assert report_masks({"masks": {"kv_groups": ["4:d"]}}) == {"kv_groups": [[1, 1, 0, 1]]}


def test_step_report_line_carries_its_masks():
    from engine.run.state import StepReport, report_masks

    r = StepReport(step=1, total_steps=2, losses=[1.0], baseline=0.0, lr=0.1, mean_score={}, kept_fraction={},
                   head_scores=None, seconds=0.1, eta_seconds=0.1, masks={"kv_groups": [[1, 0, 1, 1]], "layers": [[1], [0]]})
    line = json.loads(r.to_json())
    assert line["masks"] == {"kv_groups": ["4:b"], "layers": ["1:8", "1:0"]}
    assert report_masks(line) == r.masks


def test_text_colour_meets_wcag_aa_on_every_cell_colour():
    from plotly.colors import sample_colorscale

    from engine.ui import figures

    assert figures.contrast_ratio("#ffffff", "#000000") == pytest.approx(21.0)
    assert figures.contrast_ratio("#fde725", "#ffffff") == pytest.approx(1.26, abs=0.01)  # white on yellow: issue 49
    assert figures.text_colour("#fde725") == figures.DARK_TEXT and figures.text_colour("#440154") == figures.LIGHT_TEXT
    for c in sample_colorscale("Viridis", [i / 200 for i in range(201)]) + [figures.REMOVED, "#808080", "#767676"]:
        assert figures.contrast_ratio(c, figures.text_colour(c)) >= 4.5, c
    # the heatmap's marks: one colour per cell, from that cell's colour
    z = [[0.0, 0.5, 1.0, 0.95], [0.1, 0.2, 0.7, 0.3]]
    fig = figures.heads_heatmap(z, [[0, 1, 1, 1], [1, 0, 1, 0]])
    marks = next(t for t in fig.data if t.name == "marks")
    cells = figures.cell_colours(z)
    assert list(marks.text) == ["✗", "✓", "✓", "✓", "✓", "✗", "✓", "✗"]
    for k, colour in enumerate(marks.textfont.color):
        i, j = divmod(k, 4)
        assert figures.contrast_ratio(cells[i][j], colour) >= 4.5


def test_results_problem_names_what_is_wrong():
    from engine.ui import checks

    good = {"status": "done", "ppl_dense": 10.0, "ppl_init": 12.0, "ppl_pruned": 11.0, "params_dense": 100,
            "params_pruned": 70, "kept_per_layer": {"kv_groups": [3, 4]}, "units_per_layer": {"kv_groups": [4, 4]},
            "mask_step": None, "seconds_by_phase": {"load": 1.0, "total": 1.0}}
    assert checks.results_problem(good) is None
    assert checks.results_problem([1, 2]) == "holds a list, not an object"
    assert "no ppl_pruned" in checks.results_problem({k: v for k, v in good.items() if k != "ppl_pruned"})
    for key in ("ppl_dense", "ppl_init", "ppl_pruned", "params_dense", "params_pruned", "mask_step"):
        assert key in checks.results_problem({**good, key: "12.5"}), key
    assert "kept_per_layer" in checks.results_problem({**good, "kept_per_layer": {"kv_groups": [3]}})
    assert "kept_per_layer" in checks.results_problem({**good, "kept_per_layer": {"kv_groups": [3, 9]}})
    assert "seconds_by_phase" in checks.results_problem({**good, "seconds_by_phase": {"load": "x"}})
    assert checks.config_problem(["a"]) == "holds a list, not an object"
    assert "prune_ratio" in checks.config_problem({"prune_ratio": "0.3"})


def test_runs_dir_problem(tmp_path):
    from engine.ui import checks

    assert checks.runs_dir_problem(tmp_path / "new" / "runs") is None and (tmp_path / "new" / "runs").is_dir()
    (tmp_path / "file").write_text("x")
    assert "is a file, not a folder" in checks.runs_dir_problem(tmp_path / "file")
    assert "a part of its path is a file" in checks.runs_dir_problem(tmp_path / "file" / "runs")
    assert "not writable" in checks.runs_dir_problem("/proc")  # (unwritable even for root)
    assert list(tmp_path.joinpath("new", "runs").iterdir()) == []  # the write check leaves nothing behind


def test_rate_bounds_never_0_or_1():
    from engine.ui import checks

    assert checks.rate_bounds(0.3) == (0.05, 0.95, 0.3)
    assert checks.rate_bounds(0.0) == (0.05, 0.95, 0.05) and checks.rate_bounds(1.0) == (0.05, 0.95, 0.95)
    assert checks.rate_bounds(0.98) == (0.05, 0.98, 0.98)  # a loaded run's rate stays as it was
    assert checks.rate_bounds(None)[2] == 0.3


def test_masks_json_holds_the_kept_units():
    from engine.ui.masks import FINAL, MaskView, masks_json

    view = MaskView(FINAL, "final (best-val, from step 3)", {"kv_groups": [[1, 0, 1, 1]], "channels": [[0, 1, 1]]},
                    {}, {})
    data = json.loads(masks_json(view, "r"))
    assert data == {"run": "r", "mask": "final (best-val, from step 3)", "kept_units": {"kv_groups": [[0, 2, 3]],
                    "channels": [[1, 2]]}, "units_per_layer": {"kv_groups": [4], "channels": [3]}}


def test_kept_units_and_mask_source():
    from engine.ui.masks import kept_units, mask_source

    assert kept_units({"kv_groups": [[1, 0, 1, 1], [0, 0, 1, 0]], "layers": [[1], [0]]}) == {
        "kv_groups": [[0, 2, 3], [2]], "layers": [[0], []]}
    assert mask_source({"mask_step": 0, "final_mask": "best-val", "steps": 6}).startswith(
        "The final mask is from the init mask (step 0) (final mask: best-val")
    assert "step 4 of 6" in mask_source({"mask_step": 4, "final_mask": "best-val", "steps": 6})
    assert mask_source({}) is None


# --- AppTests ---------------------------------------------------------------------------------------
def _app(monkeypatch, runs: Path):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("PG_PRUNE_RUNS_DIR", str(runs))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.run()
    assert not at.exception, at.exception
    return at


def _fill(at, steps: int, rate: float = 0.3):
    """A policy-gradient run over KV groups and channels (the form opens on the default run: one-shot, layers too)."""
    at.radio(key="model_choice").set_value("local")
    at.text_input(key="model_path").input(str(TINY))
    at.multiselect(key="units").set_value(["kv_groups", "channels"])
    at.selectbox(key="method").set_value("pg")
    at.slider(key="rate").set_value(rate)
    for k, v in {**FAST, "steps": steps}.items():
        at.number_input(key=k).set_value(v)
    return at.run()


def _status(at) -> str:
    return " ".join(s.value for s in at.subheader)


def _wait(at, predicate, timeout: float = 120.0):
    end = time.time() + timeout
    while time.time() < end:
        at.run()
        assert not at.exception, at.exception
        if predicate(at):
            return at
        time.sleep(0.3)
    raise AssertionError(f"timed out; page shows {_status(at)} / {[e.value for e in at.error]}")


def _heatmap(at) -> dict | None:
    for c in at.get("plotly_chart"):
        spec = json.loads(c.proto.spec)
        if spec["data"] and spec["data"][0].get("type") == "heatmap":
            return spec
    return None


def heatmap_marks(spec: dict) -> list[list[int]]:
    """The ✓/✗ of each cell of the KV-group heatmap, read from the figure's data (its heatmap's text), as 0/1."""
    return [[{"✓": 1, "✗": 0, "": 0}[t] for t in row] for row in spec["data"][0]["text"]]


def _saved(run: Path, prefix: str = "masks") -> list[list[int]]:
    from safetensors.torch import load_file

    meta = json.loads((run / "masks.json").read_text())
    flat = load_file(str(run / "masks.safetensors"))[f"{prefix}.kv_groups"].tolist()
    rows, i = [], 0
    for n in meta["units_per_layer"]["kv_groups"]:
        rows.append([int(x > 0.5) for x in flat[i:i + n]])
        i += n
    return rows


def _run_folder(at) -> Path:
    return Path(next(c.value for c in at.caption if "run folder" in c.value).split("`")[1])


def _record_fragments(monkeypatch) -> list:
    """The run_every of every st.fragment the pages make, in order."""
    import streamlit

    made, real = [], streamlit.fragment

    def fragment(func=None, *, run_every=None, **kw):
        made.append(run_every)
        return real(func, run_every=run_every, **kw) if func is not None else real(run_every=run_every, **kw)

    monkeypatch.setattr(streamlit, "fragment", fragment)
    return made


@needs_tiny
def test_the_heatmap_draws_the_runs_own_masks_live_and_saved(tmp_path, monkeypatch):
    """A PG run over KV groups and channels on one parameter budget, 30 %: during the run the heatmap's marks
    are the hard mask of the step it shows (metrics.jsonl), at the end masks.safetensors' final mask, cell by cell;
    the toggle shows the init mask too, and the page says which step the final mask is from. The page redraws itself
    only while the job runs. (Before issue 49 the app redrew the KV groups' mask on their own budget: 6 of 8 kept
    where the run kept 7.)"""
    ticks = _record_fragments(monkeypatch)
    at = _fill(_app(monkeypatch, tmp_path / "runs"), steps=5000)
    from engine.run.state import report_masks
    from engine.ui.masks import mask_source

    assert at.multiselect(key="units").value == ["kv_groups", "channels"] and at.radio(key="budget").value == "params"
    assert ticks[-1] is None  # nothing runs: no redraws
    next(b for b in at.button if b.key == "start").click().run()
    if any("Start it anyway?" in w.value for w in at.warning):
        next(b for b in at.button if b.label == "Yes, start it").click().run()
    at = _wait(at, lambda a: "Running" in _status(a) and _heatmap(a) is not None
               and any("current (step" in r for r in _radio_or_caption(a)))
    assert ticks[-1] == 1.5  # a job runs: the live panel redraws itself
    run = _run_folder(at)
    for _ in range(2):  # twice: the marks follow the steps
        mask_view(at).set_value("current").run()
        step = shown_step(at)
        lines = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
        assert heatmap_marks(_heatmap(at)) == report_masks(lines[step])["kv_groups"], step
        time.sleep(0.5)
    next(b for b in at.button if b.key == "stop").click().run()
    at = _wait(at, lambda a: "Stopped" in _status(a))

    # a short run to the end: the final mask, as saved, and the init mask
    at = _fill(at, steps=4)
    next(b for b in at.button if b.key == "start").click().run()
    at = _wait(at, lambda a: "Done" in _status(a) and _heatmap(a) is not None)
    assert ticks[-1] is None  # done: the redraws stopped
    run = _run_folder(at)
    results = json.loads((run / "results.json").read_text())
    view = mask_view(at)
    assert view.value == "final" and view.options == ["final (best-val, from step %d)" % results["mask_step"],
                                                      "current (step 4)", "init (step 0)"]
    assert heatmap_marks(_heatmap(at)) == _saved(run)
    assert any(c.value == mask_source(results) for c in at.caption), [c.value for c in at.caption]
    table = next(d.value for d in at.dataframe if "layer kept" in d.value.columns)
    from engine.model.unit_types import UNIT_TYPES

    assert [int(x.split("/")[0]) for x in table[UNIT_TYPES["kv_groups"].title]] == [sum(r) for r in _saved(run)]
    view.set_value("init").run()
    assert heatmap_marks(_heatmap(at)) == _saved(run, "init_masks")
    # the "Masks (JSON)" download is the shown mask's (its content: test_masks_json_holds_the_kept_units)
    button = next(b for b in at.get("download_button") if b.proto.label == "Masks (JSON)")
    assert "init (step 0) mask" in button.proto.help


def mask_view(at):
    """The "Mask shown" toggle."""
    return next(r for r in at.radio if r.label == "Mask shown")


def shown_step(at) -> int:
    """The step of the current mask the toggle offers ("current (step 12)")."""
    label = next(o for o in mask_view(at).options if o.startswith("current"))
    return int(label.split("step ")[1].rstrip(")"))


def _radio_or_caption(at) -> list[str]:
    return [o for r in at.radio for o in r.options] + [c.value for c in at.caption]


def _finished_run(where: Path) -> Path:
    from engine.settings.config import PruneConfig
    from engine.run.loop import PruneRun

    out = where / "good"
    PruneRun(PruneConfig(model=str(TINY), prune_ratio=0.5, steps=2, num_mask_samples=2, calib=str(CALIB), **FAST), out,
             log=lambda m: None).run(progress=False)
    return out


def _stringify(x):
    """Every number in a JSON value as a string."""
    if isinstance(x, dict):
        return {k: _stringify(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_stringify(v) for v in x]
    return str(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else x


@needs_tiny
def test_damaged_results_are_listed_with_the_reason_and_crash_no_page(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    good = _finished_run(runs)
    results = json.loads((good / "results.json").read_text())
    damage = {"as-list": json.dumps([results]), "as-strings": json.dumps(_stringify(results)),
              "missing-keys": json.dumps({"status": "done", "ppl_dense": 1.0}), "not-json": "{\"status\": \"done\", ",
              "a-number": "42"}
    for name, text in damage.items():
        shutil.copytree(good, runs / name, ignore=shutil.ignore_patterns("model", "*.lock"))
        (runs / name / "results.json").write_text(text)
    at = _app(monkeypatch, runs)  # the home page, Prune
    notice = next(w.value for w in at.warning if "damaged run" in w.value)
    assert all(f"**{name}**" in notice for name in damage) and "good" not in notice.split(":")[0]
    assert "results.json holds a list, not an object" in notice and "results.json is not valid JSON" in notice
    assert "results.json no ppl_init" in notice and "results.json ppl_dense is '" in notice
    for page in ("pages/runs.py", "pages/compare.py", "pages/chat.py", "pages/prune.py"):
        at.switch_page(page).run()
        assert not at.exception, (page, at.exception)
    at.switch_page("pages/runs.py").run()
    table = at.dataframe[0].value
    assert sorted(table.loc[table["status"] == "damaged", "run"]) == sorted(damage)
    assert (table.loc[table["run"] == "good", "status"] == "done").all()
    for name in damage:  # each damaged run, chosen on Runs, then loaded into Prune
        box = at.selectbox[0]
        box.select_index(next(i for i, o in enumerate(box.options) if o.startswith(name + " "))).run()
        assert not at.exception, (name, at.exception)
        assert any(e.value.startswith(f"{name} is damaged: results.json") for e in at.error), [e.value for e in at.error]
        next(b for b in at.button if "Load into the pages" in b.label).click().run()
        at.switch_page("pages/prune.py").run()
        assert not at.exception, (name, at.exception)
        assert any(e.value.startswith(f"Run **{name}** is damaged") for e in at.error)
        at.switch_page("pages/runs.py").run()


@needs_tiny
@pytest.mark.parametrize("kind", ["file", "unwritable"])
def test_a_broken_runs_folder_is_one_line_and_blocks_start(tmp_path, monkeypatch, kind):
    if kind == "file":
        runs = tmp_path / "runs"
        runs.write_text("not a folder")
    else:
        runs = Path("/proc")
    at = _fill(_app(monkeypatch, runs), steps=2)
    lines = [e.value for e in at.error]
    assert len(lines) == 1 and lines[0].startswith("error: the runs folder") and "PG_PRUNE_RUNS_DIR" in lines[0], lines
    assert next(b for b in at.button if b.key == "start").disabled  # (AppTest, as a browser, cannot click it)
    at.switch_page("pages/runs.py").run()
    assert not at.exception and [e.value for e in at.error] == lines


def test_the_slider_refuses_0_and_1(tmp_path, monkeypatch):
    at = _app(monkeypatch, tmp_path / "runs")
    rate = at.slider(key="rate")
    assert 0 < rate.min <= 0.05 and 0.95 <= rate.max < 1


def test_an_idle_page_never_redraws_itself(tmp_path, monkeypatch):
    ticks = _record_fragments(monkeypatch)
    at = _app(monkeypatch, tmp_path / "runs")
    at.switch_page("pages/prune.py").run()
    assert ticks and all(t is None for t in ticks), ticks  # no job: no timer (the live run's: the heatmap test)


@needs_tiny
def test_invalid_settings_block_start_and_the_error_shows_once(tmp_path, monkeypatch):
    at = _fill(_app(monkeypatch, tmp_path / "runs"), steps=0)
    assert next(b for b in at.button if b.key == "start").disabled  # (AppTest, as a browser, cannot click it)
    shown = [x.value for x in [*at.error, *at.warning, *at.markdown, *at.caption] if "steps must be at least 1" in x.value]
    assert len(shown) == 1, shown
    at.number_input(key="steps").set_value(2).run()
    assert not next(b for b in at.button if b.key == "start").disabled


@needs_tiny
def test_chat_talks_to_the_export_and_checks_the_prompt_first(tmp_path, monkeypatch):
    """Chat's pruned side is the exported model by default (its greedy answer is the sliced export's, token for
    token); an empty or whitespace prompt is not sent; a prompt over the model's context is one line, nothing sent."""
    from engine.tools.chat import GenerationSettings, answer, load_sliced

    runs = tmp_path / "runs"
    run = _finished_run(runs)
    at = _app(monkeypatch, runs)
    at.session_state["selected_run"] = str(run)
    at.switch_page("pages/chat.py").run()
    assert not at.exception, at.exception
    mode = next(r for r in at.radio if r.label == "Pruned model")
    assert mode.value == "sliced" and mode.options[-1].startswith("Masks only, no refit")
    at.slider[0].set_value(16).run()  # max new tokens
    at.chat_input[0].set_value("   ").run()
    assert not at.exception and [w.value for w in at.warning] == ["Not sent: the prompt is empty: type something to send."]
    assert not [c for c in at.caption if "tokens/s" in c.value]
    at.chat_input[0].set_value("Once upon a time " * 200).run()  # about 800 tokens; the model has 512 positions
    lines = [e.value for e in at.error]
    assert not at.exception and len(lines) == 1 and lines[0].startswith("Not sent: the prompt is ") and \
        "over the context of 512 tokens" in lines[0], lines
    assert not [c for c in at.caption if "tokens/s" in c.value]
    at.chat_input[0].set_value("Once upon a time").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    shown = [m.value for m in at.markdown if m.value and not m.value.startswith("**") and m.value != "Once upon a time"]
    want, _ = answer(load_sliced(run), "Once upon a time", GenerationSettings(max_new_tokens=16, greedy=True))
    assert shown[-1].strip() == want.strip() and want.strip()  # the pruned column: the export's greedy answer (markdown trims)



def test_the_recovery_chart_draws_the_terms_the_loss_has():
    """A CE recovery (the default: no kl in its lines) is one line named by its term, and the title says CE alone;
    a KL + CE mixture draws the loss and both terms."""
    from engine.ui.figures import recovery_figure

    ce = recovery_figure([{"step": s, "loss": 5.0 - s / 10, "ce": 5.0 - s / 10} for s in (1, 2, 3)])
    assert [t.name for t in ce.data] == ["loss (cross-entropy)"] and list(ce.data[0].y) == [4.9, 4.8, 4.7]
    assert ce.layout.title.text.endswith("(cross-entropy)") and "KL" not in ce.layout.title.text
    mixed = recovery_figure([{"step": s, "loss": 2.0, "kl": 1.0, "ce": 3.0} for s in (1, 2)])
    assert [t.name for t in mixed.data] == ["loss", "KL from the dense model", "cross-entropy"]
    assert "KL from the dense model, cross-entropy" in mixed.layout.title.text
