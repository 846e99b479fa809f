"""Artifacts made by an earlier version keep working: exports reload with the same logits, and a stopped
run resumes to the same final masks.

The fixtures in tests/fixtures/compat_v1 were written by the engine at commit 7cc98ec (before methods,
metrics, unit types and architectures became registries): two tiny random exports (a pruned_llama with a
removed layer, GQA, q/k/v/o and MLP biases and bias-compensation output biases; a pruned_mistral) with the
logits they gave then, and a TinyStories run (heads, channels and layers; 4 steps) stopped after step 2,
with the final masks and perplexity that version reached when it resumed that run.
"""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import engine
from conftest import REPO, SMALL_CALIB, TINY_MODEL, WIKI_RAW

FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures" / "compat_v1"


def test_old_exports_reload_with_the_same_logits():
    engine.register_pruned_classes()
    expected = load_file(str(FIXTURES / "expected_logits.safetensors"))
    for name in ("llama_fill", "mistral"):
        model = AutoModelForCausalLM.from_pretrained(FIXTURES / name).eval()
        assert model.config.model_type.startswith("pruned_")
        with torch.no_grad():
            logits = model(input_ids=expected["input_ids"]).logits.float()
        torch.testing.assert_close(logits, expected[f"logits.{name}"], rtol=1e-5, atol=1e-5)


def test_an_old_run_resumes_to_the_same_masks(tmp_path):
    """A run stopped by an earlier version (its KV groups saved under their older name, heads) resumes to the masks
    and perplexity that version's uninterrupted run ended with; the finished run names them kv_groups."""
    from engine.cli import main
    from engine.export.artifacts import load_mask_artifact

    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "run_stopped", run)
    config = json.loads((run / "config.json").read_text())  # the paths of this machine's shared data
    config.update(model=str(TINY_MODEL), calib=str(SMALL_CALIB), eval_data=str(WIKI_RAW))
    (run / "config.json").write_text(json.dumps(config, indent=2))
    assert main(["prune", "--out", str(run), "--resume"]) == 0
    expected = json.loads((FIXTURES / "run_expected.json").read_text())
    results = json.loads((run / "results.json").read_text())
    assert results["steps"] == expected["steps"] == 4
    assert "heads" in expected["kept_per_layer"]  # (the fixture's version named KV groups heads)
    assert results["kept_per_layer"] == {("kv_groups" if u == "heads" else u): v
                                         for u, v in expected["kept_per_layer"].items()}
    masks, want = load_file(str(run / "masks.safetensors")), load_file(str(FIXTURES / "run_expected_masks.safetensors"))
    assert any(".heads" in key for key in want)  # (the fixture's own names)
    for key, mask in want.items():
        assert torch.equal(masks[key.replace(".heads", ".kv_groups")], mask), key
    meta, _, _ = load_mask_artifact(run)
    assert meta["unit_types"] == [u for u in ("kv_groups", "channels", "layers") if u in meta["unit_types"]]
    assert abs(results["ppl_pruned"] - expected["ppl_pruned"]) <= 1e-4 * expected["ppl_pruned"]
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_masks_saved_under_an_older_name_read_under_todays(tmp_path, monkeypatch):
    """masks.safetensors of a run saved when KV groups were named heads reads as kv_groups wherever a finished
    run's masks are read: the engine's reader, and the bench scripts that rebuild an export from them (the recovery
    study's cells stopped on 'KeyError: heads' rebuilding a tuning seed's export)."""
    from engine.export.artifacts import saved_mask_tensors, saved_masks

    path = FIXTURES / "run_expected_masks.safetensors"
    old, new = load_file(str(path)), saved_mask_tensors(path)
    assert any(".heads" in key for key in old) and not any(".heads" in key for key in new)
    assert new.keys() == {key.replace(".heads", ".kv_groups") for key in old}
    for key, t in old.items():
        assert torch.equal(new[key.replace(".heads", ".kv_groups")], t), key
    both = tmp_path / "both.safetensors"  # (one kind of several, per unit type)
    save_file({"masks.heads": old["masks.heads"], "init_masks.heads": 1 - old["masks.heads"]}, str(both))
    init = saved_masks(both, "init_masks")
    assert list(init) == ["kv_groups"] and torch.equal(init["kv_groups"], 1 - old["masks.heads"])
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import confirm

    shutil.copy(path, tmp_path / "masks.safetensors")
    masks = confirm.final_masks(tmp_path)
    assert "kv_groups" in masks and "heads" not in masks
    assert torch.equal(masks["kv_groups"], old["masks.heads"])
