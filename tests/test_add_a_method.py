"""The "add a method" walkthrough of docs/architecture.md, followed literally: the toy random-search method of
docs/examples/random_search.py, registered from outside the engine, runs from the CLI with its own option,
shows in `--help` and in the app, and its option is validated where every setting is."""

from __future__ import annotations

import json
import runpy

import pytest
from streamlit.testing.v1 import AppTest

from conftest import REPO, SMALL_CALIB, TINY_MODEL, WIKI_RAW, assert_cli_fails_with_one_line

EXAMPLE = REPO / "docs" / "examples" / "random_search.py"


@pytest.fixture(scope="module")
def registered():
    from engine.methods import METHODS

    runpy.run_path(str(EXAMPLE))
    yield METHODS["random-search"]
    METHODS.pop("random-search")


def tiny_args(tmp_path) -> list[str]:
    wiki = tmp_path / "wiki.txt"
    wiki.write_text(WIKI_RAW.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    return ["--model", str(TINY_MODEL), "--steps", "3", "--batch-size", "2", "--seqlen", "32", "--eval-seqlen", "32",
            "--max-windows", "2", "--init-batches", "1", "--num-mask-samples", "2", "--calib", str(SMALL_CALIB),
            "--eval-data", str(wiki)]


def test_the_method_runs_from_the_cli_with_its_option(registered, tmp_path):
    from engine.cli import build_parser, main

    assert "--random-search-pull" in build_parser()._subparsers._group_actions[0].choices["prune"].format_help()
    out = tmp_path / "rs"
    assert main(["prune", "--method", "random-search", "--random-search-pull", "0.5", *tiny_args(tmp_path), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert results["method"] == "random-search" and results["steps"] == 3
    assert config["method_options"] == {"pull": 0.5}
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


def test_its_option_is_validated_like_every_setting(registered, tmp_path, capfd):
    assert_cli_fails_with_one_line(["prune", "--method", "random-search", "--random-search-pull", "-1",
                                    *tiny_args(tmp_path), "--out", str(tmp_path / "bad")], "pull must be at least 0.0", capfd)
    assert_cli_fails_with_one_line(["prune", "--random-search-pull", "0.5", *tiny_args(tmp_path), "--out",
                                    str(tmp_path / "bad2")], "applies to --method random-search, not pg", capfd)


def test_the_app_offers_the_method_and_its_option(registered, tmp_path, monkeypatch):
    monkeypatch.setenv("PG_PRUNE_RUNS_DIR", str(tmp_path / "runs"))
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=120)
    at.run()
    assert not at.exception, at.exception
    method = at.selectbox(key="method")
    assert "random-search" in method.options
    assert any("Options of method random-search" in e.label for e in at.expander)
    pull = at.number_input(key="opt-random-search-pull")
    assert pull.value == 1.0 and pull.label == "Pull toward the best mask"
