"""The Python API (docs/api.md): prune a model held in memory, get masks, a sliced model and the report, with
nothing written to disk. The example in docs/api.md runs here as written, on the tiny model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import SMALL_CALIB

API_MD = Path(__file__).resolve().parent.parent / "docs" / "api.md"
CHEAP = dict(init_batches=1, reconstruct_batches=1, batch_size=2, seqlen=64, eval_seqlen=64, max_windows=2)


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


@pytest.fixture(scope="module")
def texts():
    from engine.data.text import load_calibration_texts

    return load_calibration_texts(str(SMALL_CALIB))[0][:40]


@pytest.fixture(scope="module")
def small_data_dir(tmp_path_factory, small_eval_file) -> Path:
    """A data folder whose evaluation text is the first ~40k characters of WikiText-2 raw test: the example's default
    evaluation data, at a test's cost."""
    from engine.data.text import _EVAL_SUBDIR

    base = tmp_path_factory.mktemp("data")
    (base / _EVAL_SUBDIR).mkdir()
    (base / _EVAL_SUBDIR / "wiki.test.raw").write_text(small_eval_file.read_text(encoding="utf-8"), encoding="utf-8")
    return base


def fingerprint(model) -> list[tuple[str, float]]:
    return [(k, float(v.double().sum())) for k, v in model.state_dict().items()]


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*"))


def test_docs_example_runs_in_memory_and_writes_nothing(tiny, texts, small_data_dir, tmp_path, monkeypatch):
    """docs/api.md's first code block, executed as written: the sliced model's perplexity is the report's, the
    model given is untouched, and no file appears (working folder, caches)."""
    model, tokenizer = tiny
    before = fingerprint(model)
    cache = Path(__import__("os").environ["PG_PRUNE_CACHE"])  # (the test's own, from conftest)
    monkeypatch.setenv("PG_PRUNE_DATA_DIR", str(small_data_dir))
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    example = python_blocks(API_MD.read_text(encoding="utf-8"))[0]
    scope = {"model": model, "tokenizer": tokenizer, "texts": texts}
    exec(compile(example, str(API_MD), "exec"), scope)  # (its own assert: the sliced model's perplexity = the report's)

    result = scope["result"]
    assert set(result.masks) == {"layers", "kv_groups", "channels"} and all(m.dtype == torch.bool for m in result.masks.values())
    dense = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in result.model.parameters()) == result.report["params_pruned"] < dense
    assert result.report["calib_data"] == "in memory" and result.report["steps"] == 0  # (one-shot: no steps)
    assert "masks" not in result.report and "model" not in result.report  # (the report is results.json's content)
    assert fingerprint(model) == before  # the model given stays as it was
    assert files_under(work) == [] and files_under(cache) == []


def test_masks_say_what_the_report_removed(tiny, texts, small_eval_file):
    """The masks are the ones the report counts: kept units per layer, from the same run."""
    from engine import PruneConfig, prune

    model, tokenizer = tiny
    result = prune(model, tokenizer, PruneConfig(prune_ratio=0.4, method="pg-alloc", steps=2, val_every=1, **CHEAP,
                                                        eval_data=str(small_eval_file)), calib=texts)
    layout = result.report["units_per_layer"]
    for unit, mask in result.masks.items():
        per_layer = [int(part.sum()) for part in torch.split(mask.int(), layout[unit])]
        assert per_layer == result.report["kept_per_layer"][unit]
    assert result.report["removed_of_decoder"] == pytest.approx(0.4, abs=0.05)


def test_prune_with_out_writes_the_cli_run(tiny, texts, small_eval_file, tmp_path):
    """`out` asks for the command line's run folder; the sliced model is then the export read back."""
    from engine import PruneConfig, perplexity, prune

    model, tokenizer = tiny
    config = PruneConfig(prune_ratio=0.3, **CHEAP, eval_data=str(small_eval_file))
    result = prune(model, tokenizer, config, calib=texts, out=tmp_path / "run")
    assert (tmp_path / "run" / "results.json").is_file() and (tmp_path / "run" / "model" / "config.json").is_file()
    assert perplexity(result.model, tokenizer, config) == pytest.approx(result.report["ppl_pruned"], rel=1e-4)


def test_bad_calibration_is_one_user_error(tiny):
    from engine import prune
    from engine.errors import UserError

    model, tokenizer = tiny
    with pytest.raises(UserError, match="calib must be a list"):
        prune(model, tokenizer, calib=[1, 2, 3])


def test_the_readmes_python_line_and_command_1_give_the_same_masks(tiny, small_eval_file, tmp_path):
    """README's `prune(model, tokenizer, PruneConfig(prune_ratio=0.3), calib=texts)` is command 1's run: on the tiny
    model, with the same data (and two evaluation windows, on both sides), the CLI's masks.safetensors and the API's
    masks are the same masks."""
    import dataclasses
    import shlex

    from safetensors.torch import load_file

    from conftest import TINY_MODEL
    from engine import PruneConfig, prune
    from engine.cli import main
    from engine.data.text import load_calibration_texts

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if "python -m engine prune --prune-ratio 0.3 --time-budget" in ln)
    argv = shlex.split(line.split("python -m engine", 1)[1])
    argv[argv.index("--out") + 1] = str(tmp_path / "cli")
    data = ["--model", str(TINY_MODEL), "--calib", str(SMALL_CALIB), "--eval-data", str(small_eval_file),
            "--max-windows", "2"]
    assert main(argv + data) == 0
    on_disk = load_file(str(tmp_path / "cli" / "masks.safetensors"))
    python = re.search(r"prune\(model, tokenizer, (PruneConfig\(.*?\)), calib=texts\)", readme).group(1)
    config = dataclasses.replace(eval(python, {"PruneConfig": PruneConfig}), model=str(TINY_MODEL),  # (README's call,
                                 calib=str(SMALL_CALIB), eval_data=str(small_eval_file), max_windows=2)  # the same data)
    model, tokenizer = tiny
    result = prune(model, tokenizer, config, calib=load_calibration_texts(str(SMALL_CALIB))[0])
    assert {f"masks.{u}" for u in result.masks} == {k for k in on_disk if k.startswith("masks.")}
    assert all(torch.equal(on_disk[f"masks.{u}"].bool(), m.bool()) for u, m in result.masks.items())
    assert any(not bool(m.bool().all()) for m in result.masks.values())  # (a mask that prunes: not all kept)
