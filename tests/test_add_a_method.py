"""The "Add a method" walkthrough of docs/architecture.md, followed literally: the toy random-search method of
docs/examples/random_search.py, registered from outside the engine, runs from the CLI with its own option (and
again from its run's config.json), shows in `--help` and in the app, and its option is validated where every
setting is. The documented command line itself runs in a fresh interpreter."""

from __future__ import annotations

import json
import re
import runpy
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from streamlit.testing.v1 import AppTest

from conftest import REPO, SMALL_CALIB, TINY_MODEL, WIKI_RAW, assert_cli_fails_with_one_line, clean_env

EXAMPLE = REPO / "docs" / "examples" / "random_search.py"
ARCHITECTURE = REPO / "docs" / "architecture.md"
BAD_PULL = "random-search: pull must be at least 0.0, got -1.0"


@pytest.fixture(scope="module")
def registered():
    """Register the method as the walkthrough does (run the file), and take it out again for the other tests."""
    from engine.algo.methods import METHODS

    assert "random-search" not in METHODS
    runpy.run_path(str(EXAMPLE))
    try:
        yield METHODS["random-search"]
    finally:
        METHODS.pop("random-search", None)


def walkthrough() -> str:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    return text[text.index("## Add a method\n"):text.index("## Repository layout\n")]


def tiny_args(tmp_path) -> list[str]:
    wiki = tmp_path / "wiki.txt"
    wiki.write_text(WIKI_RAW.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    return ["--model", str(TINY_MODEL), "--steps", "3", "--batch-size", "2", "--seqlen", "32", "--eval-seqlen", "32",
            "--max-windows", "2", "--init-batches", "1", "--num-mask-samples", "2", "--calib", str(SMALL_CALIB),
            "--eval-data", str(wiki)]


def test_the_listing_is_the_example_file():
    (listing,) = re.findall(r"```python\n(.*?)```", walkthrough(), re.S)
    assert listing.strip() in EXAMPLE.read_text(encoding="utf-8")
    assert "@register_method(\"random-search\")" in listing


def test_its_gradient_pulls_the_scores_toward_the_best_sample(registered):
    """No model: a stand-in context whose second of three samples has the lowest loss."""
    from engine.algo.policy import sample_masks

    ctx = SimpleNamespace(num_samples=3, rng=torch.Generator().manual_seed(0),
                          losses=lambda samples, batch: torch.tensor([2.0, 1.0, 3.0], dtype=torch.float64))
    s = {"kv_groups": torch.full((8,), 0.5, dtype=torch.float64), "channels": torch.full((16,), 0.7, dtype=torch.float64)}
    g = registered(ctx, registered.Options(pull=0.5)).gradient(SimpleNamespace(scores=s), batch=None)
    rng = torch.Generator().manual_seed(0)  # the same draws, in the same order
    for u, scores in s.items():
        best = sample_masks(scores, 3, rng)[1].double()
        assert torch.equal(g.grads[u], -0.5 * (best - scores))  # so s - lr g moves s toward the best mask
    assert g.losses.tolist() == [2.0, 1.0, 3.0] and g.baseline == pytest.approx(2.0)


def test_the_method_runs_from_the_cli_with_its_option(registered, tmp_path, capsys):
    from engine.cli import main
    from engine.algo.methods import METHODS

    assert "random-search" in METHODS
    with pytest.raises(SystemExit) as e:  # python -m engine prune --help
        main(["prune", "--help"])
    assert e.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--random-search-pull PULL" in help_text and "random-search: how far one step moves s toward" in help_text
    assert re.search(r"--method \{[^}]*random-search[^}]*\}", help_text)

    out = tmp_path / "rs"
    argv = ["prune", "--method", "random-search", "--random-search-pull", "0.5", *tiny_args(tmp_path), "--out", str(out)]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert results["method"] == "random-search" and results["steps"] == 3
    assert config["method"] == "random-search" and config["method_options"] == {"pull": 0.5}
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3

    again = tmp_path / "from-config"  # --config carries the option
    assert main(["prune", "--config", str(out / "config.json"), "--steps", "1", "--out", str(again)]) == 0
    assert json.loads((again / "config.json").read_text())["method_options"] == {"pull": 0.5}


def test_its_option_is_validated_like_every_setting(registered, tmp_path, capfd):
    assert_cli_fails_with_one_line(["prune", "--method", "random-search", "--random-search-pull", "-1",
                                    *tiny_args(tmp_path), "--out", str(tmp_path / "bad")], BAD_PULL, capfd)
    assert_cli_fails_with_one_line(["prune", "--random-search-pull", "0.5", *tiny_args(tmp_path), "--out",
                                    str(tmp_path / "bad2")],
                                   "--random-search-pull applies to --method random-search, not pg", capfd)


def test_the_documented_command_line_registers_it_and_passes_the_exit_status_on(tmp_path):
    """The walkthrough's first command, as written (its `python -c` code, run from the repository root), with a bad
    value: the flag is known (so the file registered the method) and the refusal is exit status 2, one line."""
    (command,) = [c for c in re.findall(r'python -c "([^"]*)"', walkthrough()) if "engine.cli" in c]
    proc = subprocess.run([sys.executable, "-c", command, "prune", "--method", "random-search", "--random-search-pull",
                           "-1", *tiny_args(tmp_path), "--out", str(tmp_path / "bad")],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {BAD_PULL}"]


def test_the_app_offers_the_method_and_its_option(registered, tmp_path, monkeypatch):
    monkeypatch.setenv("PG_PRUNE_RUNS_DIR", str(tmp_path / "runs"))
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=120)
    at.run()
    assert not at.exception, at.exception
    method = at.selectbox(key="method")
    assert "random-search" in method.options
    assert any(e.label.startswith("Options of method random-search") for e in at.expander)
    pull = at.number_input(key="opt-random-search-pull")
    assert pull.value == 1.0 and pull.label == "Pull toward the best mask"
    assert pull.help.startswith("how far one step moves s toward the best sampled mask")

    # the page validates it as the CLI does, once, and Start waits until it is fixed (the model is the tiny one)
    at.radio(key="model_choice").set_value("local")
    at.text_input(key="model_path").input(str(TINY_MODEL))
    method.set_value("random-search")
    pull.set_value(-1.0)
    at.run()
    assert not at.exception, at.exception
    assert [w.value for w in at.warning if "error:" in w.value] == [f"Cannot start as set — error: {BAD_PULL}"]
    assert next(b for b in at.button if "Start pruning" in b.label).disabled and not at.error
