"""Command-line cases of issue 63: a pickled weights file that would run code is one error line; a flag for a part
the run does not have is refused, not ignored; the plan says before the work what --time-budget will cut. Each test
failed on the code before the change."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, SMALL_CALIB, TINY_MODEL, clean_env, one_error


class _CreatesAFile:
    """Unpickling this calls open(path, "w"): a stand-in for any code a crafted weights file would run."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_eval_of_a_model_whose_pytorch_model_bin_would_run_code_is_one_error_line(tmp_path, capfd):
    """A model folder holding a tiny LLaMA's config.json and a pytorch_model.bin whose unpickling would create a
    file: `eval --model DIR` ends in one `error:` line (exit 2) saying the weights cannot be loaded safely and naming
    safetensors; the file is never created (before: transformers' UnpicklingError traceback, exit 1)."""
    from engine.cli import main

    folder, marker = tmp_path / "model", tmp_path / "created-by-the-weights"
    folder.mkdir()
    shutil.copy(TINY_MODEL / "config.json", folder / "config.json")
    torch.save({"model.embed_tokens.weight": _CreatesAFile(marker)}, folder / "pytorch_model.bin")
    capfd.readouterr()
    assert main(["eval", "--model", str(folder)]) == 2
    one_error(capfd, f"could not load model {folder}: its weights file pytorch_model.bin cannot be loaded safely",
              "io.open", "model.safetensors")
    assert not marker.exists()


INERT = {  # flags given for a part the run has not -> what the one line names
    "--self-docs with --calib-source data": (["--calib-source", "data", "--self-docs", "64"],
                                             "--self-docs applies to the model's own text", "(--calib-source data)"),
    "--self-tokens with auto below 0.5": (["--calib-source", "auto", "--prune-ratio", "0.3", "--self-tokens", "64"],
                                          "--self-tokens applies to the model's own text",
                                          "(--calib-source auto at --prune-ratio 0.3)"),
    "--mix-search without layers": (["--units", "heads,channels", "--mix-search", "exhaustive"],
                                    "--mix-search applies to the joint mix of whole layers and widths",
                                    "(--units heads,channels)"),
    "--mix-batches under --budget units": (["--units", "layers,heads", "--budget", "units", "--mix-batches", "2"],
                                           "--mix-batches applies to the joint mix", "(--budget units)"),
    "--step-calib-source where the default takes no steps": (
        ["--step-calib-source", "mix"], "--step-calib-source applies to the steps; this run takes none",
        "(--method flap: the default takes the init alone, --steps N buys steps)"),
    "--step-calib-source with a one-shot method": (["--method", "flap", "--preset", "fast", "--step-calib-source", "self"],
                                                   "--step-calib-source applies to the steps", "(--method flap)"),
}


@pytest.mark.parametrize("case", list(INERT))
def test_a_flag_for_a_part_the_run_has_not_is_refused_in_one_line(case, tmp_path, capfd):
    """--self-docs (-tokens, -temperature) where the calibration source generates no text, and --mix-search (and the
    other --mix-* flags) where no joint mix is chosen: one error line naming the flag and why it does nothing,
    before any work, as a method option given for another method is (before: ignored without a word)."""
    from engine.cli import main

    extra, *said = INERT[case]
    capfd.readouterr()
    assert main(["prune", "--model", str(TINY_MODEL), "--out", str(tmp_path / "run"), *extra]) == 2
    one_error(capfd, *said)
    assert not (tmp_path / "run").exists()


def test_the_same_flags_where_they_apply_are_taken(tmp_path):
    """The check refuses nothing that applies: --self-docs with self, mix or auto from 0.5 up; --mix-search with
    layers and widths on the parameter budget (the default preset's units)."""
    from engine.cli import parse_args

    base = ["prune", "--model", str(TINY_MODEL), "--out", str(tmp_path / "run")]
    for extra in (["--calib-source", "self", "--self-docs", "64"], ["--calib-source", "mix", "--self-tokens", "64"],
                  ["--calib-source", "auto", "--prune-ratio", "0.5", "--self-temperature", "0.8"],
                  ["--mix-search", "exhaustive"], ["--units", "layers,channels", "--mix-batches", "2"],
                  ["--calib-source", "data"], ["--units", "heads,channels"], ["--steps", "4", "--step-calib-source", "mix"]):
        assert parse_args(base + extra).command == "prune"


def test_the_plan_says_what_the_time_budget_will_cut_before_the_work(eval_file, tmp_path):
    """--time-budget with a refit whose statistics would not fit: a "plan:" line says, before the first phase of the
    work, that the budget cuts the refit's statistics (--reconstruct-batches 4096 to about N batches), which
    results.json's "reduced" records after (before: said only in the last lines and in results.json). 4096 batches
    of 8 x 128 are about 45 s at the fastest probe seen (0.011 ms per token), well past the third of an 18 s budget
    they may take; 256 fitted within it on a fast CI machine."""
    out = tmp_path / "run"
    argv = ["prune", "--model", str(TINY_MODEL), "--preset", "fast", "--units", "heads,channels", "--steps", "50",
            "--time-budget", "0.3", "--reconstruct-batches", "4096", "--batch-size", "8", "--seqlen", "128",
            "--eval-seqlen", "128", "--max-windows", "2", "--init-batches", "2", "--calib", str(SMALL_CALIB),
            "--eval-data", str(eval_file), "--out", str(out)]
    ran = subprocess.run([sys.executable, "-m", "engine", *argv], cwd=REPO, env=clean_env(OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    lines = ran.stderr.splitlines()
    said = [i for i, ln in enumerate(lines) if ln.startswith("plan: the time budget would cut the refit's statistics "
                                                               "(--reconstruct-batches 4096) to about ")]
    work = next(i for i, ln in enumerate(lines) if ln.startswith("initialising scores"))
    assert len(said) == 1 and said[0] < work, lines
    reduced = json.loads((out / "results.json").read_text())["reduced"]
    assert reduced["reconstruct_batches"][0] == 4096 and reduced["reconstruct_batches"][1] < 4096
