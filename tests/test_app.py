"""The Streamlit app through streamlit.testing.v1.AppTest, on the tiny real model (tinystories-656k).

One JobManager serves the whole process (st.cache_resource), as in the real server, so the tests
run jobs one after the other. Runs go to a temporary folder ($PG_PRUNE_RUNS_DIR).
"""

from __future__ import annotations

import importlib.util

import json
import shutil
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

from streamlit.testing.v1 import AppTest  # noqa: E402

from engine.run.phases import phase_line  # noqa: E402
from engine.settings.config import FAST as PG_FAST  # noqa: E402

TINY = ROOT.parent / "shared" / "models" / "tinystories-656k"
pytestmark = pytest.mark.skipif(not TINY.is_dir(), reason=f"tiny model not found at {TINY}")

FAST = dict(max_windows=4, init_batches=2, batch_size=2, seqlen=64, eval_seqlen=64, lr=0.02)


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    d = tmp_path_factory.mktemp("app") / "runs"
    mp.setenv("PG_PRUNE_RUNS_DIR", str(d))
    mp.setenv("TOKENIZERS_PARALLELISM", "false")
    yield d
    mp.undo()


def app() -> AppTest:
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.run()
    assert not at.exception, at.exception
    return at


def fill_prune_form(at: AppTest, model: str = str(TINY), rate: float = 0.5, steps: int = 6, scope: str = "global",
                    units=("kv_groups", "channels"), method: str = "pg", **extra) -> AppTest:
    """A policy-gradient run over KV groups and channels (the heatmap's steps; the form opens on the default run,
    one-shot over layers too)."""
    at.radio(key="model_choice").set_value("local")
    at.multiselect(key="units").set_value(list(units))
    at.selectbox(key="method").set_value(method)
    at.text_input(key="model_path").input(model)
    at.slider(key="rate").set_value(rate)
    at.radio(key="scope").set_value(scope)
    for k, v in {**FAST, "steps": steps, **extra}.items():
        at.number_input(key=k).set_value(v)
    return at


def start_button(at: AppTest):
    return next(b for b in at.button if "Start pruning" in b.label)


def confirm_long_run(at: AppTest) -> AppTest:
    """A run estimated over 10 minutes asks first (5,000 steps of the tiny model may be under it): say yes."""
    if any("Start it anyway?" in w.value for w in at.warning):
        next(b for b in at.button if b.label == "Yes, start it").click().run()
    return at


def phase(at: AppTest) -> str:
    """The running job's caption: its phase and run folder."""
    return next((c.value for c in at.caption if "run folder" in c.value), "")


def status(at: AppTest) -> str:
    return " ".join(s.value for s in at.subheader)


def wait_for(at: AppTest, predicate, timeout: float = 120.0, every: float = 0.5) -> AppTest:
    """Rerun the page (as run_every would) until predicate(at) holds."""
    end = time.time() + timeout
    while time.time() < end:
        at.run()
        assert not at.exception, at.exception
        if predicate(at):
            return at
        time.sleep(every)
    raise AssertionError(f"timed out; page shows: {status(at)} / {[c.value for c in at.caption][:3]} "
                         f"/ errors {[e.value for e in at.error]}")


def charts(at: AppTest) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def chart_types(at: AppTest) -> set[str]:
    return {trace.get("type", "scatter") for spec in charts(at) for trace in spec["data"]}


def finished_run(runs_dir: Path, scope: str) -> Path:
    """A finished run of this scope in runs_dir: one another test left, or else one made here (in process,
    outside the app), so that every test passes on its own and in any order."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    for p in sorted(runs_dir.iterdir()):
        try:
            cfg = json.loads((p / "config.json").read_text())
        except (OSError, ValueError):
            continue
        if cfg["scope"] == scope and (p / "results.json").exists():
            return p
    from engine.settings.config import PruneConfig
    from engine.run.loop import PruneRun

    out = runs_dir / f"fixture-{scope}-run"
    config = PruneConfig(model=str(TINY), scope=scope, prune_ratio=0.5, steps=4, **FAST,
                         calib=str(ROOT.parent / "shared" / "data" / "c4" / "c4-en.llamafactory-c4_demo.300.text-only.json.gz"))
    PruneRun(config, out, log=lambda m: None).run(progress=False)
    return out


# --- Prune -----------------------------------------------------------------------------------
def test_prune_page_defaults(runs_dir):
    """The form opens on the default run, as the command line's (engine/settings/config.py's default_run: the joint
    preset's one-shot init): its layers and widths, method flap."""
    from engine.settings.config import PRESETS, default_run

    at = app()
    assert at.title[0].value.endswith("Prune")
    assert at.slider(key="rate").value == pytest.approx(0.3)
    assert at.multiselect(key="units").value == PRESETS["joint"]["units"] and at.selectbox(key="method").value == "flap"
    assert at.number_input(key="steps").value == default_run().steps  # (the steps' setting, inert under flap)
    assert at.radio(key="scope").value == "global" and at.checkbox(key="fixed_layers").value is True
    assert any("No run yet" in i.value for i in at.info)


def test_joint_preset_button_sets_layers_widths_fixed_layers_and_steps(runs_dir, tmp_path, monkeypatch):
    """The joint preset's button: its settings, and its method (pg-alloc: the steps the default run does not take)."""
    from engine.settings.config import PRESETS

    monkeypatch.setenv("PG_PRUNE_RUNS_DIR", str(tmp_path / "runs"))  # (the form's settings persist beside the runs)
    at = app()
    at.multiselect(key="units").set_value(["kv_groups", "channels"]).run()
    next(b for b in at.button if b.key == "preset-joint").click().run()
    assert not at.exception, at.exception
    joint = PRESETS["joint"]
    assert at.multiselect(key="units").value == joint["units"] and at.selectbox(key="layer_init").value == joint["layer_init"]
    assert at.checkbox(key="fixed_layers").value is True and at.number_input(key="init_batches").value == joint["init_batches"]
    assert at.selectbox(key="method").value == joint["method"]
    assert not [e for e in at.error], [e.value for e in at.error]  # the form's config validates
    at.checkbox(key="fixed_layers").uncheck().run()
    assert at.checkbox(key="fixed_layers").value is False and not at.exception


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_rate_0_or_1_is_refused_by_the_slider(runs_dir, rate, tmp_path, monkeypatch):
    """The slider has no 0 or 1; settings saved with one (an older app's) open at the nearest rate it has."""
    from engine.ui.settings import SETTINGS_FILE

    monkeypatch.setenv("PG_PRUNE_RUNS_DIR", str(tmp_path / "runs"))
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / SETTINGS_FILE).write_text(json.dumps({"values": {"rate": rate}}))
    at = app()
    slider = at.slider(key="rate")
    assert 0 < slider.min <= slider.value <= slider.max < 1 and abs(slider.value - rate) < 0.06


def test_folder_without_model_is_an_error(runs_dir, tmp_path):
    at = fill_prune_form(app(), model=str(tmp_path))
    start_button(at).click().run()
    assert not at.exception
    assert any("holds no model" in e.value for e in at.error)


def test_unsupported_architecture_is_an_error(runs_dir, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2-tiny"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=64, n_positions=32)).save_pretrained(folder)
    at = fill_prune_form(app(), model=str(folder))
    start_button(at).click().run()
    at = wait_for(at, lambda a: "Failed" in status(a), timeout=60)
    assert any("unsupported architecture 'gpt2'" in e.value for e in at.error)


def test_start_heatmap_refuse_second_stop_resume(runs_dir):
    at = fill_prune_form(app(), steps=5000)
    start_button(at).click().run()
    confirm_long_run(at)
    assert not at.error, [e.value for e in at.error]
    at = wait_for(at, lambda a: len(charts(a)) >= 3)
    assert {"heatmap", "bar", "scatter"} <= chart_types(at)
    heat = next(s for s in charts(at) if s["data"][0].get("type") == "heatmap")["data"][0]
    assert len(heat["z"]) == 2 and len(heat["z"][0]) == 4  # 2 layers x 4 KV groups
    assert {t for row in heat["text"] for t in row} <= {"✓", "✗"}
    # The heatmap follows the steps.
    step = int(phase(at).split("step ")[1].split("/")[0])
    at = wait_for(at, lambda a: "step " in phase(a)
                  and int(phase(a).split("step ")[1].split("/")[0]) > step)

    # A second Start while it runs is refused, with a message.
    second = app()
    fill_prune_form(second)
    start_button(second).click().run()
    assert any("already running" in e.value for e in second.error)

    next(b for b in at.button if "Stop" in b.label).click().run()
    at = wait_for(at, lambda a: "Stopped" in status(a))
    run_dir = Path(phase(at).split("`")[1])
    assert (run_dir / "checkpoint.pt").exists() and not (run_dir / "results.json").exists()

    # Resume, then stop again.
    next(b for b in at.button if "Resume" in b.label).click().run()
    at = wait_for(at, lambda a: "Running" in status(a) or "Loading" in status(a))
    next(b for b in at.button if "Stop" in b.label).click().run()
    wait_for(at, lambda a: "Stopped" in status(a))


def test_full_run_global(runs_dir):
    at = fill_prune_form(app(), steps=6, scope="global")
    start_button(at).click().run()
    at = wait_for(at, lambda a: "Done" in status(a))
    labels = [m.label for m in at.metric]
    assert "Dense perplexity" in labels and "Pruned perplexity" in labels
    assert "heatmap" in chart_types(at)


def test_two_sessions_see_one_job(runs_dir):
    """Two browser sessions at once: the first starts a job, the second sees it running, cannot start a
    second one, and stops it; the first sees it stopped. Nothing raises on either page."""
    before = set(runs_dir.iterdir()) if runs_dir.exists() else set()
    first = fill_prune_form(app(), steps=5000)
    start_button(first).click().run()
    confirm_long_run(first)
    assert not first.error, [e.value for e in first.error]
    second = wait_for(app(), lambda a: "Running" in status(a))
    run_dir = phase(first).split("`")[1] if "`" in phase(first) else None
    fill_prune_form(second)
    start_button(second).click().run()
    assert any("already running" in e.value for e in second.error)
    assert not second.exception
    next(b for b in second.button if "Stop" in b.label).click().run()
    first = wait_for(first, lambda a: "Stopped" in status(a))
    second = wait_for(second, lambda a: "Stopped" in status(a))
    if run_dir:
        assert (Path(run_dir) / "checkpoint.pt").exists()
    # leave no stopped 5,000-step run behind: the Compare test would take it for a finished global run
    for made in set(runs_dir.iterdir()) - before:  # (the run's folder; the form's saved settings, a file, stay)
        if made.is_dir():
            shutil.rmtree(made)


# --- Compare ---------------------------------------------------------------------------------
def test_compare_starts_matching_uniform_run_and_compares(runs_dir):
    finished_run(runs_dir, "global")
    at = app()
    at.switch_page("pages/compare.py").run()
    assert not at.exception
    start = next(b for b in at.button if "matching uniform" in b.label)
    start.click().run()
    assert any("Started" in s.value for s in at.success), [e.value for e in at.error]
    prune = app()
    wait_for(prune, lambda a: "Done" in status(a))
    finished_run(runs_dir, "uniform")

    at = app()
    at.switch_page("pages/compare.py").run()
    a, b = compared_configs(at, runs_dir)[:2]
    assert {a["scope"], b["scope"]} == {"global", "uniform"}
    titles = [s["layout"]["title"]["text"] for s in charts(at)]
    assert any("Sparsity per layer" in t for t in titles) and any("Perplexity" in t for t in titles)
    assert not any("Start the matching" in b.label for b in at.button)  # the match exists: not offered again


def compared_configs(at: AppTest, runs: Path) -> list[dict]:
    """The configs of the runs Compare compares, A first (its pick, engine/ui/compare.py's PICK_KEY)."""
    return [json.loads((runs / name / "config.json").read_text()) for name in at.session_state["cmp_runs"]]


# --- Chat ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["masked", "sliced", pytest.param("gguf", marks=pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed (install.sh installs it)"))])
def test_chat_dense_and_pruned_answer(runs_dir, mode):
    run = finished_run(runs_dir, "global")
    at = app()
    at.session_state["selected_run"] = str(run)
    at.switch_page("pages/chat.py").run()
    assert not at.exception, at.exception
    at.radio[0].set_value(mode)
    at.slider[0].set_value(16)  # max new tokens
    at.chat_input[0].set_value("Once upon a time").run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    stats = [c.value for c in at.caption if "tokens/s" in c.value]
    assert len(stats) == 2
    assert all(int(s.split(" tokens")[0]) > 0 for s in stats)
    answers = [m.value for m in at.markdown if m.value and not m.value.startswith("**") and m.value != "Once upon a time"]
    assert len([a for a in answers if len(a.strip()) > 0]) >= 2
    # dense 656 k parameters, pruned fewer
    assert "656 k parameters" in stats[0] and "656 k parameters" not in stats[1]
    # both sides in the same backend, named under each answer, and the speed-up measured in it
    backend = "llama.cpp f16" if mode == "gguf" else "transformers float32"
    assert all(f"tokens/s in {backend} ·" in s for s in stats), stats
    if mode == "masked":  # masks only, no refit: no speed-up shown (they compute every weight)
        assert [i.value for i in at.info if "speed-up" in i.value.lower()] == [
            i.value for i in at.info if i.value.startswith("Masks only, no refit: no speed-up")] and at.info
        return
    speed = [i.value for i in at.info if "Speed-up, same backend" in i.value]
    assert len(speed) == 1 and f"({backend})" in speed[0], [i.value for i in at.info]
    tps = [float(s.split(" · ")[1].split(" tokens/s")[0]) for s in stats]  # (shown to 0.1 tokens/s)
    shown = float(speed[0].split("= **")[1].split("×")[0])  # (the ratio of the unrounded speeds, to 0.01)
    low, high = (tps[1] - 0.05) / (tps[0] + 0.05), (tps[1] + 0.05) / max(tps[0] - 0.05, 1e-9)
    assert low - 0.005 <= shown <= high + 0.005, (shown, tps)
    if mode == "gguf":  # llama.cpp's thread count is shown beside its tokens/s: the cores this process may use
        from engine.tools.llamacpp import default_threads

        assert all(s.endswith(f" · {default_threads()} threads") for s in stats), stats
    else:
        assert not any("threads" in s for s in stats), stats
    if mode == "gguf":  # the run's GGUF was written once, atomically, and is what llama.cpp ran; the dense model
        # was converted once, with the same weight type, beside the runs
        from engine.tools.gguf_cache import DENSE_GGUF_DIR, gguf_outtype

        assert (run / "model.gguf").is_file() and not list(run.glob("*.tmp*"))
        dense = list((runs_dir / DENSE_GGUF_DIR).glob("tinystories-656k-*.f16.gguf"))
        assert len(dense) == 1 and gguf_outtype(dense[0]) == "f16" and gguf_outtype(run / "model.gguf") == "f16"
        assert not list((runs_dir / DENSE_GGUF_DIR).glob(".*tmp*"))


def test_recover_on_a_finished_run_shows_its_loss_live_and_writes_run_recover(runs_dir):
    """Prune's view of a finished run has a Recover action: it recovers the export for the minutes given into
    RUN/recover in a background thread (the page draws the snapshot: the status, the loss per step, the result),
    and the recovered model is then in RUN/recover/model, where Chat finds it."""
    import shutil

    from engine.tools.chat import recovered_folder

    run = finished_run(runs_dir, "global")
    shutil.rmtree(run / "recover", ignore_errors=True)  # (another test's recovery of this run: started again here)
    at = app()
    at.session_state["selected_run"] = str(run)
    at.switch_page("pages/prune.py").run()
    assert not at.exception, at.exception
    memory = [c.value for c in at.caption if c.value.startswith("Memory: peak")]  # (the peak beside the plan's)
    assert len(memory) == 1 and "the plan estimated" in memory[0], [c.value for c in at.caption]
    next(n for n in at.number_input if n.key.endswith("-recover-min")).set_value(0.1)
    next(b for b in at.button if b.label == "Recover").click().run()
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    wait_for(at, lambda a: any("Recovery failed" in e.value for e in a.error) or any(
        "the recovered model is in" in s.value for s in a.success), timeout=300)
    assert not at.error, [e.value for e in at.error]
    assert any("Recovery: loss per step" in c.proto.spec for c in at.get("plotly_chart")), "no loss chart"
    assert recovered_folder(run) == run / "recover" / "model"
    res = json.loads((run / "recover" / "recover_results.json").read_text())
    assert res["ended_by"] == "time budget" and res["steps"] >= 1 and "ppl_after" in res


def test_chat_puts_the_recovered_model_in_a_third_column(runs_dir):
    """A run with RUN/recover (prune --recover): Chat's sliced mode answers with the dense, the pruned and the
    recovered model side by side, each under its own label with its tokens/s; the toggle takes the third away."""
    from engine.tools.recover import recover

    run = finished_run(runs_dir, "global")
    recover(run, run / "recover", overwrite=(run / "recover").exists(), steps=1, seqlen=32, batch_size=2,
            skip_eval=True, log=lambda m: None)
    at = app()
    at.session_state["selected_run"] = str(run)
    at.switch_page("pages/chat.py").run()
    assert not at.exception, at.exception
    at.slider[0].set_value(16)
    at.chat_input[0].set_value("Once upon a time").run()
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    turn = at.session_state["chat_history"][-1]
    assert turn["recovered_label"].startswith("Recovered · fine-tuned on the text (CE), LoRA")  # (recover's default)
    assert all(turn[side].strip() and "tokens/s" in turn[side + "_stats"] for side in ("dense", "pruned", "recovered"))
    assert len([c.value for c in at.caption if "tokens/s" in c.value]) == 3
    next(t for t in at.toggle if t.key == "chat-recovered").set_value(False).run()
    at.chat_input[0].set_value("The cat sat").run()
    assert "recovered_label" not in at.session_state["chat_history"][-1]


def test_chat_runs_the_saved_prompt_set(runs_dir, tmp_path, monkeypatch):
    """One click answers every prompt of the saved set, dense and pruned side by side, in the file's order; an
    empty entry is skipped, and a missing file offers no set."""
    import json

    import engine.tools.chat as chat

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["Once upon a time", "  ", "The cat sat"]}))
    monkeypatch.setattr(chat, "PROMPTS_FILE", prompts)
    monkeypatch.setattr(chat.saved_prompts, "__defaults__", (prompts,))
    run = finished_run(runs_dir, "global")
    at = app()
    at.session_state["selected_run"] = str(run)
    at.switch_page("pages/chat.py").run()
    at.slider[0].set_value(8)
    button = next(b for b in at.button if "saved prompt set" in b.label)
    assert "(2 prompts)" in button.label
    button.click().run()
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    history = at.session_state["chat_history"]
    assert [t["prompt"] for t in history] == ["Once upon a time", "The cat sat"]
    assert all(t["dense"].strip() and t["pruned"].strip() and "tokens/s" in t["dense_stats"]
               and "tokens/s" in t["pruned_stats"] for t in history), history
    assert chat.saved_prompts(tmp_path / "missing.json") == []


# --- Deploy: the downloads of a finished run -----------------------------------------------------
def test_model_zip_loads_with_transformers(runs_dir, tmp_path):
    import io
    import zipfile

    import torch
    from transformers import AutoModelForCausalLM

    from engine.tools.chat import load_sliced
    from engine.ui.deploy import model_zip_bytes, model_zip_name

    run = finished_run(runs_dir, "global")
    data = model_zip_bytes(run)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert z.testzip() is None
        z.extractall(tmp_path)
    folder = tmp_path / model_zip_name(run)[: -len(".zip")]
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True)  # as a user loads it
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        got = model(ids).logits
        want = load_sliced(run).model(ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert not list(run.glob(".*tmp*")) and not list(run.glob("*.zip"))  # built in memory: nothing written


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_gguf_download_is_made_once_cached_and_loads_in_llama_cpp(runs_dir):
    import numpy as np

    from engine.tools import llamacpp
    from engine.ui.deploy import cached_run_gguf, ensure_run_gguf, gguf_download_name, gguf_outtype, run_gguf_path

    run = finished_run(runs_dir, "global")
    for outtype in ("f16", "q8_0"):
        path = ensure_run_gguf(run, outtype)
        assert path.parent == run and gguf_outtype(path) == outtype and cached_run_gguf(run, outtype) == path
        mtime = path.stat().st_mtime_ns
        assert ensure_run_gguf(run, outtype) == path and path.stat().st_mtime_ns == mtime  # cached: not re-exported
        assert run_gguf_path(run, outtype) == path
        llm = llamacpp.open_gguf(path, n_ctx=64, logits_all=True)  # llama.cpp loads it
        try:
            z = llamacpp.logits(llm, [1, 5, 9, 42])
            assert z.shape[0] == 4 and np.isfinite(z).all()
        finally:
            llamacpp.close(llm)
        assert gguf_download_name(run, outtype) == f"{run.name}-{outtype}.gguf"
    assert not list(run.glob(".*tmp*"))
    if (run / "model.gguf").is_file():  # Chat's (or --export-gguf's) file serves its own type
        assert run_gguf_path(run, gguf_outtype(run / "model.gguf")) == run / "model.gguf"


def test_deploy_bad_input_is_one_clear_error(tmp_path):
    from engine.errors import UserError
    from engine.ui.deploy import ensure_run_gguf, model_zip_bytes

    with pytest.raises(UserError, match="no sliced model"):
        model_zip_bytes(tmp_path)
    with pytest.raises(UserError, match="no sliced model"):
        ensure_run_gguf(tmp_path, "f16")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(UserError, match="GGUF type must be one of"):
        ensure_run_gguf(tmp_path, "q4_k")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # nothing written


def test_speed_comparison_and_dense_gguf_path(tmp_path):
    from engine.tools.chat import GenerationStats, speed_comparison, speedup
    from engine.tools.gguf_cache import dense_gguf_path

    # the speed is the decoding after the first token: 9 tokens in 2.0 - 0.2 s against 9 in 1.0 - 0.1 s
    assert speedup(GenerationStats(10, 2.0, 0.2), GenerationStats(10, 1.0, 0.1)) == pytest.approx(2.0)
    assert GenerationStats(10, 2.0, 0.2).decode_tokens_per_s == pytest.approx(9 / 1.8)
    assert speedup(GenerationStats(0, 1.0), GenerationStats(10, 1.0, 0.1)) is None
    assert GenerationStats(7, 1.0, 0.1).decode_tokens_per_s is None  # (under MIN_SPEED_TOKENS: not shown)
    assert speed_comparison("llama.cpp f16", None, "llama.cpp f16", 5.0).startswith("No speed-up: a side generated "
                                                                                    "fewer than 8 tokens")
    same = speed_comparison("llama.cpp f16", 5.0, "llama.cpp f16", 7.5)
    assert "same backend (llama.cpp f16)" in same and "**1.50×**" in same and "expected" not in same
    assert "no speed-up is expected" in speed_comparison("transformers float32", 5, "transformers float32", 5, masked=True)
    assert speed_comparison("transformers float32", 20.0, "llama.cpp f16", 5.0).startswith("No speed-up")
    assert speed_comparison("llama.cpp f16", 0.0, "llama.cpp f16", 5.0).startswith("No speed-up")
    # one cached file per model and type, named after the model; a model folder rewritten gets a new one
    model = tmp_path / "my model"
    shutil.copytree(TINY, model)
    f16, q8 = dense_gguf_path(str(model), "f16", tmp_path / "c"), dense_gguf_path(str(model), "q8_0", tmp_path / "c")
    assert f16.name.startswith("my-model-") and f16.name.endswith(".f16.gguf") and q8.name.endswith(".q8_0.gguf")
    assert dense_gguf_path(str(model), "f16", tmp_path / "c") == f16
    time.sleep(0.01)
    (model / "config.json").write_text((model / "config.json").read_text() + " ")
    assert dense_gguf_path(str(model), "f16", tmp_path / "c") != f16


def test_runs_and_prune_offer_the_downloads(runs_dir):
    run = finished_run(runs_dir, "global")
    at = app()
    at.session_state["selected_run"] = str(run)
    at.run()
    for page in ("pages/prune.py", "pages/runs.py"):
        at.switch_page(page).run()
        assert not at.exception, at.exception
        if page.endswith("runs.py"):
            at.selectbox[0].select_index(next(i for i, o in enumerate(at.selectbox[0].options) if run.name in o)).run()
        labels = [b.proto.label for b in at.get("download_button")]
        assert "Sliced model (zip)" in labels, labels
        assert any(b.label.startswith("Make the GGUF") for b in at.button) or any(lb.startswith("GGUF ") for lb in labels)
    if importlib.util.find_spec("llama_cpp") is not None:  # made on demand, then offered for download
        (run / "model.q8_0.gguf").unlink(missing_ok=True)
        at.selectbox(key="runs-deploy-gguf-type").set_value("q8_0").run()
        next(b for b in at.button if b.label == "Make the GGUF (q8_0)").click().run()
        assert not at.exception and not at.error, [e.value for e in at.error]
        assert any(b.proto.label.startswith("GGUF q8_0 (") for b in at.get("download_button"))
        assert (run / "model.q8_0.gguf").is_file()


# --- Runs ------------------------------------------------------------------------------------
def test_runs_list_load_export_delete(runs_dir, tmp_path):
    done = finished_run(runs_dir, "global")
    at = app()
    at.switch_page("pages/runs.py").run()
    assert not at.exception
    table = at.dataframe[0].value
    assert len(table) == len([p for p in runs_dir.iterdir() if (p / "config.json").exists()]) >= 1

    at.selectbox[0].select_index(next(i for i, o in enumerate(at.selectbox[0].options) if done.name in o)).run()
    next(b for b in at.button if "Load into the pages" in b.label).click().run()
    assert at.session_state["selected_run"] == str(done)

    dest = tmp_path / "exported"
    at.text_input[0].input(str(dest))
    next(b for b in at.button if b.label == "Export model").click().run()
    assert (dest / "config.json").exists(), [e.value for e in at.error]

    # Delete needs the confirmation box.
    delete = next(b for b in at.button if "Delete run" in b.label)
    assert delete.disabled
    from engine.ui.deploy import ensure_run_gguf

    if importlib.util.find_spec("llama_cpp") is not None:  # the GGUF downloads made in the run folder go with it
        ensure_run_gguf(done, "q8_0")
    at.checkbox[0].check().run()
    next(b for b in at.button if "Delete run" in b.label).click().run()
    assert not done.exists()


# --- Layers ----------------------------------------------------------------------------------
def test_layer_pruning_run_shows_the_layers_chart(runs_dir):
    at = fill_prune_form(app(), steps=4, rate=0.5)
    # the layer metric shows with whole layers; layers alone, so that the hard mask removes one of the 2 whatever
    # the width metric (with heads too the joint mix chooses between a layer and width, as its losses say)
    at.multiselect(key="units").set_value(["layers"]).run()
    at.selectbox(key="layer_init").set_value("sleb")
    start_button(at).click().run()
    assert not at.error, [e.value for e in at.error]
    at = wait_for(at, lambda a: "Done" in status(a))
    titles = [s["layout"]["title"]["text"] for s in charts(at)]
    assert any(t.startswith("Whole layers") for t in titles), titles
    layers = next(s for s in charts(at) if s["layout"]["title"]["text"].startswith("Whole layers"))["data"][0]
    assert len(layers["x"]) == 2 and layers["text"].count("✗") == 1  # 2 layers, the hard mask removes one


def test_compare_two_layer_runs_and_warns_when_the_parameters_differ(tmp_path, monkeypatch):
    """Compare opens runs that pruned whole layers (it once sorted unit types by a fixed list and crashed),
    and says so in words when the two runs removed different numbers of parameters."""
    from engine.settings.config import PruneConfig
    from engine.run.loop import PruneRun

    runs = tmp_path / "runs"
    monkeypatch.setenv("PG_PRUNE_RUNS_DIR", str(runs))
    calib = str(ROOT.parent / "shared" / "data" / "c4" / "c4-en.llamafactory-c4_demo.300.text-only.json.gz")
    for name, units in (("layers", ["layers"]), ("layers-and-width", ["kv_groups", "channels", "layers"])):
        config = PruneConfig(model=str(TINY), units=units, prune_ratio=0.5, steps=2, method="pg", **FAST, calib=calib,
                             budget="units")  # each type loses half its count: the two runs remove different parameters
        PruneRun(config, runs / name, log=lambda m: None).run(progress=False)
    at = app()
    at.switch_page("pages/compare.py").run()
    assert not at.exception, at.exception
    a, b = compared_configs(at, runs)[:2]
    assert {tuple(a["units"]), tuple(b["units"])} == {("layers",), ("kv_groups", "channels", "layers")}
    assert any("removed different numbers of parameters" in w.value for w in at.warning), [w.value for w in at.warning]
    titles = [s["layout"]["title"]["text"] for s in charts(at)]
    assert any("Sparsity per layer" in t for t in titles)


def test_compare_says_why_a_joint_run_has_no_uniform_match(tmp_path, monkeypatch):
    """A joint run (layers and widths on one parameter budget) exists only in global scope: Compare offers no
    matching uniform run, says why in one line, and starts nothing (it once offered one, which failed in flag
    language)."""
    from engine.settings.config import PruneConfig
    from engine.run.loop import PruneRun

    runs = tmp_path / "runs"
    monkeypatch.setenv("PG_PRUNE_RUNS_DIR", str(runs))
    calib = str(ROOT.parent / "shared" / "data" / "c4" / "c4-en.llamafactory-c4_demo.300.text-only.json.gz")
    config = PruneConfig(model=str(TINY), units=["layers", "kv_groups", "channels"], prune_ratio=0.5, steps=2, **FAST,
                         calib=calib, mix_batches=1)
    PruneRun(config, runs / "joint", log=lambda m: None).run(progress=False)
    at = app()
    at.switch_page("pages/compare.py").run()
    assert not at.exception, at.exception
    assert not any("matching" in b.label for b in at.button), [b.label for b in at.button]
    assert any(c.value.startswith("No uniform run can match run A") and "global scope" in c.value for c in at.caption)
    assert sorted(p.name for p in runs.iterdir() if p.is_dir()) == ["joint"]


# --- issue 25: the plan, settings that persist, re-run, removed layers, Compare's differences -------------
def plan_count(at: AppTest) -> int:
    """The parameter count the plan panel says the run will remove."""
    line = next(m.value for m in at.markdown if m.value.startswith("Will remove"))
    return int(line.split("**")[1].replace(",", ""))


def test_the_plan_matches_what_the_run_removes_and_settings_persist(runs_dir):
    at = fill_prune_form(app(), steps=3, rate=0.4)
    at.run()
    planned = plan_count(at)
    assert {m.label for m in at.metric} >= {"Removes", "Time (est.)", "Memory (est.)", "Speed-up (est.)"}
    # another page and back: the form keeps the tiny model and its steps
    at.switch_page("pages/runs.py").run()
    at.switch_page("pages/prune.py").run()
    assert at.text_input(key="model_path").value == str(TINY) and at.number_input(key="steps").value == 3
    assert app().number_input(key="steps").value == 3  # a new session (a browser reload) too
    start_button(at).click().run()
    at = wait_for(at, lambda a: "Done" in status(a))
    run = Path(next(c.value for c in at.caption if "run folder" in c.value).split("`")[1])
    results = json.loads((run / "results.json").read_text())
    assert [c.value for c in at.caption if c.value.startswith("Wall time ")] == [  # where the run's time went
        "W" + phase_line(results["seconds_by_phase"])[1:]]
    tolerance = int(next(m.value for m in at.markdown if m.value.startswith("Will remove")).split("up to ")[1].split(" ")[0]
                    .replace(",", "")) if "up to" in next(m.value for m in at.markdown if m.value.startswith("Will remove")) else 0
    assert abs(results["params_removed"] - planned) <= max(tolerance, 1)


def test_a_run_the_time_budget_cut_says_what_it_cut(runs_dir):
    from engine.run.results import reduced_line

    done = finished_run(runs_dir, "global")
    saved = (done / "results.json").read_text()  # (the module's runs are shared: put it back after)
    results = {**json.loads(saved), "reduced": {"init_batches": [64, 16], "why": "the pre-step phases' plan"}}
    (done / "results.json").write_text(json.dumps(results))
    try:
        at = app()
        at.switch_page("pages/runs.py").run()
        at.selectbox[0].select_index(next(i for i, o in enumerate(at.selectbox[0].options) if done.name in o)).run()
        line = reduced_line(results["reduced"])
        line = line[0].upper() + line[1:]
        assert not at.exception, at.exception
        assert [c.value for c in at.caption if "time budget" in c.value] == [line]  # the Results tab
        next(b for b in at.button if "Load into the pages" in b.label).click().run()
        at.switch_page("pages/prune.py").run()  # and beside the run's charts
        assert not at.exception, at.exception
        assert [c.value for c in at.caption if "time budget" in c.value] == [line]
    finally:
        (done / "results.json").write_text(saved)
    assert "init-batches 64 -> 16" in line


def test_steps_0_is_one_clear_error(runs_dir):
    at = fill_prune_form(app(), steps=0)
    at.run()
    assert [w.value for w in at.warning if "steps must be at least 1" in w.value] == [  # the plan says so at once, once
        "Cannot start as set — error: steps must be at least 1, got 0"]
    assert start_button(at).disabled and not at.exception and not at.error  # Start waits until it is fixed


def test_rerun_with_these_settings_reproduces_the_config(runs_dir):
    done = finished_run(runs_dir, "global")
    at = app()
    at.switch_page("pages/runs.py").run()
    at.selectbox[0].select_index(next(i for i, o in enumerate(at.selectbox[0].options) if done.name in o)).run()
    next(b for b in at.button if b.label == "Re-run").click().run()
    assert not at.exception, at.exception
    assert at.title[0].value.endswith("Prune") and at.number_input(key="steps").value == json.loads(
        (done / "config.json").read_text())["steps"]
    at.switch_page("pages/prune.py").run()  # (AppTest's next run would be the Runs page again)
    start_button(at).click().run()
    at = wait_for(at, lambda a: "Done" in status(a))
    run = Path(next(c.value for c in at.caption if "run folder" in c.value).split("`")[1])
    assert run != done
    assert json.loads((run / "config.json").read_text()) == json.loads((done / "config.json").read_text())


def test_compare_names_the_differing_steps(tmp_path, monkeypatch):
    from engine.settings.config import PruneConfig
    from engine.run.loop import PruneRun

    runs = tmp_path / "runs"
    monkeypatch.setenv("PG_PRUNE_RUNS_DIR", str(runs))
    calib = str(ROOT.parent / "shared" / "data" / "c4" / "c4-en.llamafactory-c4_demo.300.text-only.json.gz")
    for scope, steps in (("global", 2), ("uniform", 3)):
        config = PruneConfig(**{**PG_FAST, **FAST, "steps": steps}, model=str(TINY), scope=scope, prune_ratio=0.5,
                             calib=calib, num_mask_samples=2)
        PruneRun(config, runs / f"{scope}-{steps}", log=lambda m: None).run(progress=False)
        time.sleep(1.1)
    at = app()
    at.switch_page("pages/compare.py").run()
    assert not at.exception, at.exception
    warning = next(w.value for w in at.warning if "not like for like" in w.value)
    assert "**Steps**: A 2, B 3" in warning or "**Steps**: A 3, B 2" in warning
    assert "Scope" not in warning
    assert any("matching" in b.label for b in at.button)  # no fair pair yet: offered


def test_a_removed_layer_is_drawn_removed(runs_dir):
    at = fill_prune_form(app(), steps=2, rate=0.5)
    at.multiselect(key="units").set_value(["kv_groups", "channels", "layers"]).run()
    at.selectbox(key="layer_init").set_value("layerwise-ppl")
    start_button(at).click().run()
    assert not at.error, [e.value for e in at.error]
    at = wait_for(at, lambda a: "Done" in status(a))
    run = Path(next(c.value for c in at.caption if "run folder" in c.value).split("`")[1])
    kept_layers = json.loads((run / "results.json").read_text())["kept_per_layer"]["layers"]
    removed = [i for i, k in enumerate(kept_layers) if not k]
    heat = next(s for s in charts(at) if s["data"][0].get("type") == "heatmap")
    grey = next((t for t in heat["data"] if t.get("name") == "removed layers"), None)
    if not removed:
        assert grey is None
        return
    assert [i for i, row in enumerate(grey["z"]) if row[0] == 1] == removed
    assert all(row == [None] * len(row) for i, row in enumerate(heat["data"][0]["z"]) if i in removed)
    table = next(d.value for d in at.dataframe if "layer kept" in d.value.columns)
    assert list(table.index[table["layer kept"] == "removed"]) == removed


def test_a_run_over_10_minutes_asks_first(runs_dir):
    at = fill_prune_form(app(), steps=6)
    at.number_input(key="time_budget").set_value(20.0).run()  # a 20-minute time budget: the plan says 20 min
    assert any(m.label == "Time (est.)" and m.value == "20 min" for m in at.metric), [m.value for m in at.metric]
    start_button(at).click().run()
    assert any("Start it anyway?" in w.value for w in at.warning) and "Running" not in status(at)
    next(b for b in at.button if b.label == "No").click().run()
    assert not any("Start it anyway?" in w.value for w in at.warning) and not at.exception
    at.number_input(key="time_budget").set_value(None).run()


def test_a_budget_that_fits_too_few_steps_says_so_before_start(runs_dir):
    """A time budget whose plan fits fewer steps than pay: the plan panel says the run takes none and exports its
    init, before Start; a budget with room for the steps says nothing of it."""
    at = fill_prune_form(app(), steps=50)
    at.number_input(key="time_budget").set_value(0.05).run()
    said = [w.value for w in at.warning if "measured to pay" in w.value]
    assert len(said) == 1 and "no steps; the init mask" in said[0] and "steps fit in 0.05 min" in said[0], said
    at.number_input(key="time_budget").set_value(600.0).run()
    assert not [w.value for w in at.warning if "measured to pay" in w.value]
    at.number_input(key="time_budget").set_value(None).run()


def progress_text(at: AppTest) -> str:
    return " ".join(p.proto.text for p in at.get("progress"))


def test_a_slowed_check_is_named_and_its_overrun_said_in_the_progress_line(runs_dir, monkeypatch):
    """A run slowed on purpose ($PG_PRUNE_SLOW_PHASE: each held-out check sleeps 15 s): while a check runs, the
    progress line names it and says it is over its plan, by how much."""
    from engine.run.phases import SLOW_ENV

    monkeypatch.setenv(SLOW_ENV, "validation:15")
    at = fill_prune_form(app(), steps=40)  # (5 checks planned in all: the second one's 15 s are over their plan)
    start_button(at).click().run()
    confirm_long_run(at)
    assert not at.error, [e.value for e in at.error]
    at = wait_for(at, lambda a: "a held-out check running for" in progress_text(a)
                  and "× the plan" in progress_text(a), timeout=300, every=1.0)
    line = progress_text(at)
    assert "validation: " in line and "checks included" in line, line  # (the steps have begun: their line)
    if any("Stop" in b.label for b in at.button):
        next(b for b in at.button if "Stop" in b.label).click().run()
    wait_for(at, lambda a: "Stopped" in status(a) or "Done" in status(a), timeout=120)


def test_estimated_speedup_of_a_run(runs_dir):
    from engine.plan.forecast import model_skeleton, speedup
    from engine.ui.settings import estimated_speedup

    run = finished_run(runs_dir, "global")
    config, results = json.loads((run / "config.json").read_text()), json.loads((run / "results.json").read_text())
    x = estimated_speedup(config, results)
    assert x == pytest.approx(speedup(model_skeleton(config["model"]), results["params_removed"])) and x > 1
    assert estimated_speedup(config, None) is None and estimated_speedup({"model": "/no/such/model"}, results) is None


def test_a_metric_cards_duration_is_short():
    """The plan's time card: seconds, then whole minutes, then hours and minutes (a longer value is cut off)."""
    from pages._ui import fmt_duration

    assert [fmt_duration(s) for s in (0.4, 59.4, 60, 89, 91, 1098, 3569, 3571, 3600, 3931, 36000)] == [
        "0 s", "59 s", "1 min", "1 min", "2 min", "18 min", "59 min", "1 h 00", "1 h 00", "1 h 06", "10 h 00"]


def test_special_tokens_spelled_with_ordinary_tokens_are_not_printed():
    """Issue 66: the tiny model's answers began with a literal <|end_story|> (spelled "<|" "end_story" "|>", which
    skip_special_tokens cannot drop): every special token's text is taken out of the stream, across pieces."""
    from engine.tools.chat import without_special_text

    specials = ["<|end_story|>", "<unk>", "<|start_story|>"]
    pieces = ["<|", "end_story", "|>Once", " upon a <", "|start_story|>time <un", "k>.", " <|"]
    out = list(without_special_text(pieces, specials))
    assert "".join(out) == "Once upon a time . <|"  # (a trailing "<|" that began nothing is given back at the end)
    assert out[0] == "Once" and all("end_story" not in p for p in out)
    assert "".join(without_special_text(["a <b> c"], specials)) == "a <b> c"
