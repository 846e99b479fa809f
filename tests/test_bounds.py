"""Issue 48, bounds and messages (second pass): the app survives any results.json and config.json (every value a
page reads is checked once, where the run is read: engine/ui/checks.py), an evaluation text with a byte-order mark,
a $PG_PRUNE_CACHE that names a file, odd masks.json unit types, a huge evaluation text in bounded memory. Each test
failed on the code before its change."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from conftest import REPO, TINY_MODEL

# A finished run's results.json as the engine writes it (the tiny model's two layers), with every key the pages read:
# the time plan, what a time budget cut, the refit, the per-layer counts.
RESULTS = {
    "status": "done", "model": "tinystories-656k", "method": "pg", "init": "flap", "units": ["kv_groups", "channels"],
    "scope": "global", "budget": "params", "prune_ratio": 0.3, "seed": 0,
    "ppl_dense": 20.5, "ppl_init": 30.25, "ppl_pruned": 28.0, "eval_windows": 2, "seqlen": 32,
    "params_dense": 656_000, "params_pruned": 520_000, "params_removed": 136_000, "params_decoder": 400_000,
    "removed_of_decoder": 0.3, "removed_of_model": 0.2,
    "params_removed_by_unit_type": {"kv_groups": 36_000, "channels": 100_000},
    "kept_per_layer": {"kv_groups": [3, 4], "channels": [300, 250]},
    "units_per_layer": {"kv_groups": [4, 4], "channels": [384, 384]},
    "steps": 3, "final_mask": "best-val", "mask_step": 2, "best_val": {"metric": "perplexity", "value": 27.5},
    "val_ppl_init": 29.0, "lr": 0.05,
    "seconds_per_step": 0.5, "seconds_in_steps": 1.5, "stopped_early": None, "time_budget": 5.0, "peak_rss_mb": 900.0,
    "reconstruction": {"ppl_before": 30.0, "batches": 4, "ridge": 0.1, "intercept": True},
    "seconds_by_phase": {"load": 1.0, "init metric": 2.0, "steps": 1.5, "total": 6.0},
    "plan_seconds_by_phase": {"load": 1.2, "init metric": 1.8, "steps": 2.0, "total": 6.5},
    "reduced": {"refit_batches": [64, 16], "why": "the time budget"},
}
CONFIG = {"model": str(TINY_MODEL), "scope": "global", "budget": "params", "method": "pg", "init": "flap",
          "units": ["kv_groups", "channels"], "prune_ratio": 0.3, "steps": 3, "dtype": "float32"}
BAD_VALUES = ["x", [1, 2], {"a": 1}, None, True, math.nan, -math.inf, -1]  # (a string, list, object, null, ...)


def _variants(doc: dict, path: tuple = ()):
    """(where, document) for every single change of one value of doc: each key deleted, or set to each bad value;
    nested objects changed the same way, one level down."""
    for key in list(doc):
        here = (*path, key)
        gone = copy.deepcopy(doc)
        del gone[key]
        yield f"{'.'.join(map(str, here))} deleted", gone
        for bad in BAD_VALUES:
            changed = copy.deepcopy(doc)
            changed[key] = bad
            yield f"{'.'.join(map(str, here))} = {bad!r}", changed
        if isinstance(doc[key], dict) and not path:
            for where, inner in _variants(doc[key], here):
                yield where, {**copy.deepcopy(doc), key: inner}


def _with(doc: dict, where: str, value) -> dict:
    out = copy.deepcopy(doc)
    out[where] = value
    return out


def results_variants():
    yield "whole: a list", [RESULTS]
    yield "whole: a string", "done"
    yield "whole: a number", 42
    yield "whole: null", None
    yield from _variants(RESULTS)
    yield "reduced entry a number", _with(RESULTS, "reduced", {"refit_batches": 64})
    yield "reduced entry one long", _with(RESULTS, "reduced", {"refit_batches": [64]})
    yield "plan without total", _with(RESULTS, "plan_seconds_by_phase", {"load": 1.0})
    yield "refit without ppl_before", _with(RESULTS, "reconstruction", {"batches": 4})
    yield "refit skipped", _with(RESULTS, "reconstruction", {"skipped": "no time left"})


def _read_everything(results: dict, config: dict) -> None:
    """Everything the pages compute from a run's results.json and config.json (a finished run's view, the Runs
    table's cells, Compare's and Chat's readers), outside a page: Streamlit calls run bare (no script), so what is
    tested is the pages' own code on these values."""
    from engine.errors import UserError
    from engine.ui import compare as C
    from engine.ui import figures
    from engine.ui import masks as M
    from engine.ui.jobs import RunInfo
    from engine.ui.settings import results_table, settings_table
    from pages import _ui

    info = RunInfo(path=Path("/nonexistent/run"), name="run", config=config, results=results, steps_done=3,
                   has_masks=False, has_model=False, has_checkpoint=False, modified=0.0)
    _ui.run_label(info)
    _ui.render_run([], config, [], results, key="fuzz")
    _ui.removed_short(results), _ui.removal_text(results), _ui.speedup_short(config, results)
    _ui.fmt_params(results.get("params_pruned"))
    M.mask_source(results)
    results_table(results), settings_table(config)
    C.params_removed(results), C.table_rows([info], lambda r: False), C.curves([], results), C.default_pick([info])
    C.counterpart_problem(info, C.other_scope(config.get("scope"))), C.kept_fractions(info)
    try:
        C.matching_config(config, results, C.other_scope(config.get("scope")))
    except UserError:
        pass
    figures.kept_fractions_from_results(results)
    figures.perplexity_bars([("run", results)])
    f"{config.get('prune_ratio', 0):.0%}", Path(config.get("model", "")).name, ",".join(config.get("units", []))


@pytest.fixture(scope="module")
def bare_streamlit():
    import logging

    import pages._ui  # noqa: F401

    for name in list(logging.root.manager.loggerDict):  # ("missing ScriptRunContext", once a call: these run bare)
        if name.startswith("streamlit"):
            logging.getLogger(name).setLevel(logging.ERROR)


def test_every_results_json_is_either_damaged_or_shown_without_a_crash(bare_streamlit):
    """Every single-value change of a finished run's results.json: results_problem says why the run is damaged,
    or every page's reading of it works (the old check let a plan without "total", a non-list "reduced" entry,
    a refit without ppl_before, a NaN duration and more through, and the run's view raised)."""
    from engine.ui.checks import results_problem

    assert results_problem(RESULTS) is None
    _read_everything(RESULTS, CONFIG)
    crashed, seen = [], 0
    for where, results in results_variants():
        why = results_problem(results)
        if why is not None:
            assert isinstance(why, str) and 0 < len(why) < 200, (where, why)
            continue
        seen += 1
        try:
            _read_everything(results, CONFIG)
        except Exception as e:  # noqa: BLE001 (any exception is a page's crash)
            crashed.append(f"{where}: {type(e).__name__}: {e}")
    assert not crashed, f"{len(crashed)} accepted results.json crash a page:\n" + "\n".join(crashed[:40])
    assert seen > 50  # (the check refuses what a page cannot show, not every change: optional keys may go)


def config_variants():
    for key in CONFIG:
        for bad in (None, 5, [], {"a": 1}, "x", math.nan):
            yield f"{key} = {bad!r}", _with(CONFIG, key, bad)


def test_every_config_json_is_either_damaged_or_shown_without_a_crash(bare_streamlit):
    from engine.ui.checks import config_problem

    assert config_problem(CONFIG) is None
    crashed = []
    for where, config in config_variants():
        if config_problem(config) is not None:
            continue
        try:
            _read_everything(RESULTS, config)
        except Exception as e:  # noqa: BLE001
            crashed.append(f"{where}: {type(e).__name__}: {e}")
    assert not crashed, f"{len(crashed)} accepted config.json crash a page:\n" + "\n".join(crashed[:40])


def test_the_pages_list_runs_with_damaged_values_as_damaged(tmp_path, monkeypatch):
    """Run folders whose results.json or config.json hold values the old check let through: every page renders,
    and Runs lists them as damaged with the reason."""
    from streamlit.testing.v1 import AppTest

    runs = tmp_path / "runs"
    cases = {"good": (CONFIG, RESULTS),
             "plan-as-list": (CONFIG, _with(RESULTS, "plan_seconds_by_phase", [1, 2])),
             "phases-no-total": (CONFIG, _with(RESULTS, "seconds_by_phase", {"load": 1.0})),
             "reduced-number": (CONFIG, _with(RESULTS, "reduced", {"refit_batches": 64})),
             "null-ratio": (_with(CONFIG, "prune_ratio", None), RESULTS),
             "null-units": (_with(CONFIG, "units", None), RESULTS)}
    for name, (config, results) in cases.items():
        (runs / name).mkdir(parents=True)
        (runs / name / "config.json").write_text(json.dumps(config))
        (runs / name / "results.json").write_text(json.dumps(results))
    monkeypatch.setenv("PG_PRUNE_RUNS_DIR", str(runs))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=300)
    at.run()
    assert not at.exception, at.exception
    for page in ("pages/runs.py", "pages/compare.py", "pages/chat.py"):
        at.switch_page(page).run()
        assert not at.exception, (page, at.exception)
    at.switch_page("pages/runs.py").run()
    table = at.dataframe[0].value
    damaged = dict(zip(table["run"], table["damaged"]))
    assert sorted(n for n, why in damaged.items() if why) == sorted(set(cases) - {"good"}), damaged
    assert "plan_seconds_by_phase" in damaged["plan-as-list"] and "total" in damaged["phases-no-total"]
    assert "prune_ratio" in damaged["null-ratio"] and "units" in damaged["null-units"]


# --- evaluation text with a byte-order mark ------------------------------------------------------------
def test_an_evaluation_text_with_a_utf8_bom_is_read_without_it(tmp_path):
    """A .txt/.raw evaluation file a Windows editor saved starts with a BOM: read as text, it was kept as a
    U+FEFF character at the start of the evaluation text (a token the model never saw)."""
    from engine.data.text import load_eval_text

    for name in ("wiki.txt", "wiki.raw"):
        folder = tmp_path / name.replace(".", "-")
        folder.mkdir()
        (folder / name).write_bytes("\ufeff".encode() + b" = Robert Boulter = \n\nRobert Boulter is an actor .\n")
        for given in (folder / name, folder):  # the file, or the folder holding it
            text, _ = load_eval_text(str(given))
            assert text == " = Robert Boulter = \n\nRobert Boulter is an actor .\n", (given, text[:5])


# --- caches named by the environment ----------------------------------------------------------------------
def test_a_pg_prune_cache_that_is_a_file_is_one_line(tmp_path, monkeypatch, capfd):
    """$PG_PRUNE_CACHE (the dense perplexity, the time probe and the model copies) naming a file: one error line at
    the run's start (before: every cache silently skipped, or a NotADirectoryError deep in a write)."""
    from engine.cli import main

    cache = tmp_path / "cache-file"
    cache.write_text("mine")
    monkeypatch.setenv("PG_PRUNE_CACHE", str(cache))
    out = tmp_path / "run"
    capfd.readouterr()
    assert main(["prune", "--model", str(TINY_MODEL), "--steps", "1", "--out", str(out)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    errors = [ln for ln in err if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    assert "$PG_PRUNE_CACHE" in errors[0] and "not a folder" in errors[0] and len(errors[0]) < 300
    assert cache.read_text() == "mine" and not out.exists()


# --- a damaged masks.json or results.json under zeroshot --run and chat --------------------------------------
def test_a_masks_json_naming_an_odd_unit_type_is_damaged_not_a_traceback():
    """masks.json's unit_types holding a list (unhashable: a TypeError) or a name no unit type has: the run's
    masks are damaged, said in the one line load_mask_artifact raises (zeroshot --run, chat, export)."""
    import torch

    from engine.export.artifacts import mask_meta_problem

    tensors = {"masks.kv_groups": torch.ones(8), "scores.kv_groups": torch.zeros(8)}
    good = {"unit_types": ["kv_groups"], "units_per_layer": {"kv_groups": [4, 4]}}
    assert mask_meta_problem(good, tensors) is None
    for odd in (["kv_groups"], {"a": 1}, 5, "nonesuch"):
        why = mask_meta_problem({**good, "unit_types": [odd]}, tensors)
        assert why is not None and "unit type" in why and len(why) < 200, (odd, why)


def test_the_parameters_a_damaged_results_json_records_are_counted_instead(tmp_path):
    """chat's and zeroshot --run's masked model reads the pruned parameters from results.json: one that holds a
    list (TypeError before), a string or a negative number is not used (the masked model's are counted)."""
    from engine.tools.chat import recorded_params

    assert recorded_params(tmp_path) is None  # no results.json
    for text, want in (('{"params_pruned": 520000}', 520000), ('[{"params_pruned": 520000}]', None),
                       ('{"params_pruned": "520000"}', None), ('{"params_pruned": -1}', None), ('"done"', None),
                       ('{"params_pruned": 5', None), ('{"params_pruned": true}', None)):
        (tmp_path / "results.json").write_text(text)
        assert recorded_params(tmp_path) == want, text


# --- a huge evaluation text ----------------------------------------------------------------------------------
def test_a_huge_evaluation_text_is_tokenized_in_bounded_pieces():
    """An evaluation text over 4 M characters was handed to the tokenizer whole (~100x its size in memory, as the
    calibration line of issue 48); now in pieces of at most CHUNK_CHARS, and only until the windows asked for
    are filled. The first windows are the whole text's; texts up to EVAL_WHOLE_CHARS (WikiText-2's test split)
    take the old path unchanged."""
    from transformers import AutoTokenizer

    from engine.data.text import EVAL_WHOLE_CHARS, eval_windows
    from engine.data.tokenize_docs import CHUNK_CHARS

    from conftest import WIKI_RAW

    tok, longest = AutoTokenizer.from_pretrained(TINY_MODEL), [0]

    class Watching:  # the tokenizer, noting the longest text it is handed at once
        def __call__(self, texts, **kw):
            longest[0] = max([longest[0]] + [len(t) for t in ([texts] if isinstance(texts, str) else texts)])
            return tok(texts, **kw)

    text = WIKI_RAW.read_text(encoding="utf-8")
    assert len(text) <= EVAL_WHOLE_CHARS  # (the results' evaluation text: tokenized whole, as before)
    big = text * (EVAL_WHOLE_CHARS // len(text) + 1)
    windows = eval_windows(Watching(), big, 32, 4)
    assert longest[0] <= CHUNK_CHARS < len(big)
    first = tok(text[:20_000], add_special_tokens=False)["input_ids"][:4 * 32]
    assert windows.shape == (4, 32) and windows.flatten().tolist() == first


# --- a huge calibration line, measured ------------------------------------------------------------------------
_PEAK = """
import json, resource, sys
from pathlib import Path
from transformers import AutoTokenizer
from engine.run import loop as pruner
from engine.settings.config import PruneConfig
tok = AutoTokenizer.from_pretrained(sys.argv[1])
config = PruneConfig(model=sys.argv[1], calib=sys.argv[2], eval_data=sys.argv[3], seqlen=32, eval_seqlen=32,
                     max_windows=2, batch_size=2, steps=3, val_every=0, final_mask="last").resolved()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sampler = pruner._run_data(tok, config)[0]
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"growth_kb": after - before, "longest": max(len(d) for d in sampler.docs)}))
"""


def test_a_20_mb_calibration_line_is_read_in_bounded_memory(tmp_path):
    """Issue 48: one 200 MB calibration line peaked at 19.7 GB RSS (99x the file). The run's data for a 20 MB
    line, in a fresh interpreter: its peak RSS grows by less than 15x the file (the line and its decoded text, a
    document's capped token ids, the tokenizer's pieces), where tokenizing it whole took ~100x."""
    import subprocess
    import sys

    from conftest import REPO, WIKI_RAW, clean_env

    calib = tmp_path / "one-line.jsonl"
    words = "the cat sat on a mat and ran over the hill to see the dog. "
    calib.write_text(json.dumps({"text": words * (20_000_000 // len(words))}) + "\n")
    eval_file = tmp_path / "wiki.txt"
    eval_file.write_text(WIKI_RAW.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    p = subprocess.run([sys.executable, "-c", _PEAK, str(TINY_MODEL), str(calib), str(eval_file)], cwd=REPO,
                       env=clean_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-2000:]
    found = json.loads(p.stdout.strip().splitlines()[-1])
    file_kb = calib.stat().st_size / 1024
    assert found["growth_kb"] < 15 * file_kb, (found, file_kb)
    assert found["longest"] >= 1_000_000  # (the document is kept, up to its cap: the run draws from it)


# --- eval's batch, checked before it is allocated -----------------------------------------------------------
def test_an_eval_batch_whose_logits_cannot_fit_is_one_line(tmp_path, monkeypatch, capfd):
    """`eval` checked nothing: a --eval-batch-size whose logits do not fit ended in the allocator's traceback
    (prune checks the same in PruneRun). With 1 MiB available, 8 windows of 32 tokens need 4 MiB of logits."""
    from engine.model import memory_check
    from engine.cli import main

    from conftest import WIKI_RAW

    eval_file = tmp_path / "wiki.txt"
    eval_file.write_text(WIKI_RAW.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    flags = ["eval", "--model", str(TINY_MODEL), "--eval-data", str(eval_file), "--eval-seqlen", "32",
             "--max-windows", "8", "--eval-batch-size", "100000"]
    monkeypatch.setattr(memory_check, "available_bytes", lambda device="cpu": 1 << 20)
    capfd.readouterr()
    assert main(flags) == 2
    err = capfd.readouterr().err.strip().splitlines()
    errors = [ln for ln in err if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    assert "an evaluation batch (--eval-batch-size x --eval-seqlen) of 8 x 32 tokens needs at least 4.0 MiB" \
        in errors[0] and "more than the 1.0 MiB available" in errors[0]
    assert len(errors[0]) < 300
    monkeypatch.setattr(memory_check, "available_bytes", lambda device="cpu": 4 << 20)  # exactly enough: taken
    assert main(flags) == 0


def test_a_self_calib_cache_that_is_a_file_is_one_line(tmp_path, monkeypatch, capfd):
    """$PG_PRUNE_SELF_CALIB_CACHE naming a file, on a run that generates its calibration text: one error line at the
    run's start (before: the generation ran, then "not cached", and every later run generated it again)."""
    from engine.cli import main

    cache = tmp_path / "self-cache-file"
    cache.write_text("mine")
    monkeypatch.setenv("PG_PRUNE_SELF_CALIB_CACHE", str(cache))
    out = tmp_path / "run"
    capfd.readouterr()
    assert main(["prune", "--model", str(TINY_MODEL), "--steps", "1", "--calib-source", "self", "--out", str(out)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    errors = [ln for ln in err if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    assert "$PG_PRUNE_SELF_CALIB_CACHE" in errors[0] and "not a folder" in errors[0] and len(errors[0]) < 300
    assert cache.read_text() == "mine" and not out.exists()
