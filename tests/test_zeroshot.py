"""Zero-shot evaluation through lm-evaluation-harness on the local task data.

The faithfulness test runs our path (a model object loaded by the engine, handed to HFLM) and
lm-eval's own path (`simple_evaluate(model="hf", model_args="pretrained=<folder>")`, which loads
the model itself) on the same task configs and asserts equal accuracies.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.model.arch import ModelAdapter
from engine.export.artifacts import export_pruned, save_mask_artifact
from engine.tools.zeroshot import (ALL_TASKS, TABLE_METRIC, ZeroshotConfig, evaluate_model, run_zeroshot, summarize,
                                   write_task_dir)
from engine.model.units import UnitLayout

from conftest import DATA_DIR, assert_cli_fails_with_one_line
from engine.model.unit_types import unit_sizes


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    return write_task_dir(tmp_path_factory.mktemp("tasks"), ALL_TASKS)


def _acc(raw, task):
    return {k: v for k, v in raw["results"][task].items() if k.split(",")[0] in ("acc", "acc_norm")}


def test_task_configs_include_the_harness_and_read_local_files(task_dir):
    import lm_eval.tasks
    import yaml
    from lm_eval.tasks import TaskManager

    harness = Path(lm_eval.tasks.__file__).parent
    for task in ALL_TASKS:
        text = (task_dir / f"{task}.yaml").read_text()
        include = text.split("include:", 1)[1].splitlines()[0].strip().strip('"')
        assert Path(include).is_file() and Path(include).is_relative_to(harness)
        files = yaml.safe_load(text.replace("!function", ""))["dataset_kwargs"]["data_files"]
        zeroshot = (DATA_DIR / "zeroshot").resolve()  # (shared/ may be a link: compare the real paths)
        assert all(Path(p).is_file() and Path(p).resolve().is_relative_to(zeroshot) for p in files.values())
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    tasks = manager.load(["arc_easy", "boolq", "lambada_openai", "winogrande"])["tasks"]
    # every document of the real splits, with the harness's own prompts
    assert len(tasks["arc_easy"].eval_docs) == 2376
    assert len(tasks["winogrande"].eval_docs) == 1267
    assert len(tasks["lambada_openai"].eval_docs) == 5153
    boolq = tasks["boolq"].eval_docs
    assert len(boolq) == 3270 and all(d["label"] == int(d["answer"]) for d in boolq.select(range(50)))
    doc = tasks["arc_easy"].eval_docs[0]
    assert tasks["arc_easy"].doc_to_text(doc) == f"Question: {doc['question']}\nAnswer:"
    assert tasks["arc_easy"].doc_to_choice(doc) == doc["choices"]["text"]


def test_same_accuracy_as_lm_evals_own_model_loading(tiny, tiny_path, task_dir):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model, tok = tiny
    tasks = ["arc_easy", "piqa"]
    ours = evaluate_model(model, tok, tasks, task_dir, limit=20, batch_size=4)
    theirs = simple_evaluate(model="hf", model_args=f"pretrained={tiny_path},device=cpu", tasks=tasks, num_fewshot=0,
                             limit=20, batch_size=4, task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
                             log_samples=False, bootstrap_iters=0)
    for task in tasks:
        assert ours["n-samples"][task]["effective"] == theirs["n-samples"][task]["effective"] == 20
        assert _acc(ours, task) == _acc(theirs, task) and len(_acc(ours, task)) == 2


@pytest.fixture(scope="module")
def run_dir(tiny, tiny_path, tmp_path_factory):
    """A finished-looking prune run of the tiny model: masks artifact and the sliced export."""
    model, tok = tiny
    a = ModelAdapter.for_model(model)
    layout = UnitLayout({"kv_groups": unit_sizes(a)["kv_groups"], "channels": unit_sizes(a)["channels"]})
    g = torch.Generator().manual_seed(3)
    masks = {"kv_groups": torch.tensor([1.0, 0, 1, 1, 1, 1, 0, 1]),
             "channels": (torch.rand(layout.total("channels"), generator=g) > 0.4).float()}
    out = tmp_path_factory.mktemp("run")
    save_mask_artifact(out, str(tiny_path), layout, masks, {u: m.clone() for u, m in masks.items()},
                       {u: m.clone() for u, m in masks.items()})
    export_pruned(model, tok, layout, masks, out / "model")
    return out


def test_masked_base_equals_its_sliced_export(run_dir, tmp_path):
    tasks = ["arc_easy", "hellaswag"]
    masked = run_zeroshot(ZeroshotConfig(run=str(run_dir), tasks=tasks, limit=12, batch_size=4), tmp_path / "a", log=lambda m: None)
    sliced = run_zeroshot(ZeroshotConfig(model=str(run_dir / "model"), tasks=tasks, limit=12, batch_size=4), tmp_path / "b",
                          log=lambda m: None)
    assert masked["label"].startswith("masked base")
    assert masked["params"] == sliced["params"]
    for task in tasks:
        assert masked["tasks"][task]["metrics"]["acc"] == pytest.approx(sliced["tasks"][task]["metrics"]["acc"])
        assert masked["tasks"][task]["metrics"]["acc_norm"] == pytest.approx(sliced["tasks"][task]["metrics"]["acc_norm"])


def test_cli_writes_config_results_and_a_table_row(tiny_path, tmp_path, capfd):
    from engine.cli import main

    out = tmp_path / "zs"
    assert main(["zeroshot", "--model", str(tiny_path), "--tasks", "winogrande,boolq", "--limit", "6", "--out", str(out)]) == 0
    printed = capfd.readouterr().out
    summary = json.loads((out / "zeroshot.json").read_text())
    assert json.loads((out / "zeroshot_config.json").read_text())["limit"] == 6
    assert set(summary["tasks"]) == {"winogrande", "boolq"} and summary["limit"] == 6
    for task, r in summary["tasks"].items():
        assert r["samples"] == 6 and r["score"] == r["metrics"][TABLE_METRIC[task]]
        assert r["score"] * 6 == pytest.approx(round(r["score"] * 6))  # a fraction of 6 documents
    assert summary["average"] == pytest.approx(sum(r["score"] for r in summary["tasks"].values()) / 2)
    row = (out / "zeroshot.md").read_text().splitlines()[2]
    assert row in printed and row.endswith(f"| {100 * summary['average']:.2f} |")
    assert (out / "tasks" / "boolq.yaml").is_file() and (out / "tasks" / "local_docs.py").is_file()


def test_write_tasks_only(tmp_path, capfd):
    from engine.cli import main

    assert main(["zeroshot", "--write-tasks", str(tmp_path / "t")]) == 0
    assert sorted(p.stem for p in (tmp_path / "t").glob("*.yaml")) == sorted(ALL_TASKS)
    assert "--include_path" in capfd.readouterr().out


def test_summarize_picks_the_table_metric():
    raw = {"results": {"hellaswag": {"alias": "hellaswag", "acc,none": 0.25, "acc_stderr,none": "N/A", "acc_norm,none": 0.5}},
           "n-samples": {"hellaswag": {"original": 10042, "effective": 8}}}
    s = summarize(raw, ["hellaswag"])["hellaswag"]
    assert s == {"metrics": {"acc": 0.25, "acc_norm": 0.5}, "table_metric": "acc_norm", "score": 0.5, "samples": 8}


@pytest.mark.parametrize("args,message", [
    (["--tasks", "piqa,mmlu"], "unknown task mmlu"),
    (["--limit", "0"], "limit must be at least 1"),
    (["--model", "/no/such/model"], "model not found"),
    (["--data-dir", "/no/such/dir"], "zero-shot data folder not found"),
    (["--run", "/no/such/run"], "not a finished prune run"),
    (["--batch-size", "0"], "batch size must be at least 1"),
])
def test_bad_input_is_one_error_line(args, message, tiny_path, capfd):
    assert_cli_fails_with_one_line(["zeroshot", "--model", str(tiny_path), *args], message, capfd)


def test_missing_default_data_dir_is_a_user_error(tiny_path, tmp_path, monkeypatch, capfd):
    from engine.cli import main

    monkeypatch.setenv("PG_PRUNE_DATA_DIR", str(tmp_path))  # a data folder without zeroshot/
    assert main(["zeroshot", "--model", str(tiny_path)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no zero-shot data found" in err[0]
