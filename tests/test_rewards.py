"""Rewards (--reward ce | kl, engine/algo/rewards.py) and calibration sources (--calib-source, engine/data/calib_sources.py):
the KL reward against a hand computation, the dense mask's KL, ce bit for bit, every executor, a resumed kl run,
and the self-generated calibration text."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine.data import calib_sources
from engine.model.arch import ModelAdapter
from engine.data.calib_sources import (CALIB_SOURCES, PHASE as CALIB_PHASE, PROMPT_TOKENS, SELF_FROM, config_text_cached,
                                  generated_tokens, source_of)
from engine.settings.config import PRESETS, PruneConfig
from engine.algo.context import StepContext
from engine.algo.evaluate import batch_loss
from engine.model.executors import EXECUTORS
from engine.model.masking import MaskHooks
from engine.plan.forecast import GENERATE_WEIGHT, model_skeleton, phase_tokens
from engine.run.loop import PruneRun
from engine.run.initialise import fresh_state
from engine.algo.rewards import REWARDS, DenseKL, row_kl

from test_adapters_export import build_model
from test_executors import ARCHS, batch, full_layout, random_fill, random_samples
from test_pruner import assert_same_run, metric_lines, quiet, resume_run, small_config, stop_after


def context(model, executor: str, reward) -> StepContext:
    return StepContext(model, ModelAdapter.for_model(model), full_layout(model), EXECUTORS[executor],
                       torch.Generator().manual_seed(0), 2, 1, reward=reward)


def hand_kl(model, ids, masks_one, layout, comp_means=None) -> float:
    """sum_v p log(p / q) averaged over positions 0..T-2 and rows, in float64, q under the masks."""
    with torch.no_grad():
        p = torch.softmax(model(input_ids=ids).logits.double(), -1)[:, :-1]
        with MaskHooks(ModelAdapter.for_model(model)) as hooks:
            hooks.set({u: layout.split(u, m) for u, m in masks_one.items()}, comp_means)
            q = torch.softmax(model(input_ids=ids).logits.double(), -1)[:, :-1]
    return float((p * (p.log() - q.log())).sum(-1).mean())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("executor", sorted(EXECUTORS))
def test_kl_reward_equals_a_hand_computation_in_every_executor(arch, executor):
    model = build_model(arch)
    layout, ids, comp_means = full_layout(model), batch(model), random_fill(model, 2)
    samples = random_samples(layout, 3, seed=5)
    got = context(model, executor, DenseKL()).rewards(samples, ids, comp_means)
    want = [hand_kl(model, ids, {u: m[j] for u, m in samples.items()}, layout, comp_means) for j in range(3)]
    assert got.dtype == torch.float64 and got.shape == (3,)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-6)
    assert all(x > 0 for x in want)  # (a pruned model differs from the dense one)


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
def test_the_dense_mask_has_kl_zero(executor):
    model = build_model("llama")
    layout, ids = full_layout(model), batch(model)
    ones = {u: torch.ones(2, layout.total(u)) for u in layout.unit_types}
    kl = context(model, executor, DenseKL()).rewards(ones, ids, None)
    assert torch.all(kl.abs() < 1e-6), kl


def test_the_real_model_kl_equals_a_hand_computation(tiny):
    model, tokenizer = tiny
    layout = full_layout(model)
    ids = tokenizer(["Once upon a time there was a little girl who liked to play in the park with her dog."] * 2,
                    return_tensors="pt")["input_ids"]
    samples = random_samples(layout, 2, seed=3, keep=0.7)
    got = context(model, "sliced", DenseKL()).rewards(samples, ids, None)
    want = [hand_kl(model, ids, {u: m[j] for u, m in samples.items()}, layout) for j in range(2)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
def test_ce_is_the_calibration_loss_bit_for_bit(executor):
    """--reward ce scores every sample exactly as the steps always did (the executors' loss, batch_loss)."""
    model = build_model("qwen2")
    layout, ids, comp_means = full_layout(model), batch(model), random_fill(model, 4)
    samples = random_samples(layout, 4, seed=9)
    ctx = context(model, executor, REWARDS["ce"]())
    assert torch.equal(ctx.rewards(samples, ids, comp_means), ctx.losses(samples, ids, comp_means))
    with MaskHooks(ModelAdapter.for_model(model)) as hooks:  # the executor as it was called before rewards
        before = EXECUTORS[executor](hooks, layout, ids, samples, comp_means)
    assert torch.equal(ctx.rewards(samples, ids, comp_means), before)
    assert REWARDS["ce"]().scorer(model, ids) is batch_loss


def test_kl_shares_one_dense_forward_per_batch_and_refuses_edited_weights():
    model = build_model("llama")
    layout, ids = full_layout(model), batch(model)
    reward = DenseKL(keep=2)
    ctx = context(model, "sequential", reward)
    for seed in range(3):
        ctx.rewards(random_samples(layout, 2, seed=seed), ids, None)
    assert reward.dense_forwards == 1
    reward.frozen = True  # (what RunMasks.weights sets while a refit edits the weights)
    with pytest.raises(RuntimeError, match="weights are edited"):
        ctx.rewards(random_samples(layout, 2, seed=0), batch(model, seed=1), None)
    ctx.rewards(random_samples(layout, 2, seed=0), ids, None)  # a batch prepared before: fine


@pytest.mark.parametrize("arch", ARCHS)
def test_kls_dense_targets_stay_within_their_bytes_and_come_back_bit_for_bit(arch):
    """The KL reward keeps full dense log-probabilities only up to its byte bound (a 24-step run had kept 24
    batches: 4.8 GB of the default model's 7.5 GB peak); a dropped batch's come back from the LM head's kept input,
    equal to the forward's bit for bit, without a forward, and also while the weights are edited (prepared
    batches: a held-out check under a refit)."""
    model = build_model(arch)
    batches = [batch(model, seed=s) for s in range(5)]
    one = batches[0].shape[0] * batches[0].shape[1] * model.config.vocab_size * 4
    reward = DenseKL(max_bytes=2 * one)
    first = [reward.dense_logp(model, b).clone() for b in batches]
    assert reward.dense_forwards == 5 and len(reward._dense) == 2  # (the last two, within 2 batches' bytes)
    hidden = sum(h.numel() * h.element_size() for h in reward._hidden.values())
    assert hidden == 5 * one // model.config.vocab_size * model.config.hidden_size  # (rows x T x hidden a batch)
    assert reward.cached_bytes() == 2 * one + hidden
    reward.frozen = True
    again = reward.dense_logp(model, batches[0])  # (dropped, and the weights "edited": the head alone)
    assert torch.equal(again, first[0]) and reward.dense_forwards == 5 and reward.head_recomputes == 1
    logits = torch.randn(batches[1].shape[0], batches[1].shape[1], model.config.vocab_size)
    assert torch.equal(reward.rows(logits, batches[1], batches[1]), row_kl(logits, first[1]))  # (held-out rows)
    reward.frozen = False
    tight = DenseKL(max_bytes=1)  # (below one batch: the current batch is kept all the same)
    tight.dense_logp(model, batches[0])
    assert len(tight._dense) == 1 and torch.equal(tight.dense_logp(model, batches[0]), first[0])
    assert tight.dense_forwards == 1


def test_row_kl_compares_every_copy_with_the_dense_rows():
    g = torch.Generator().manual_seed(0)
    dense = torch.log_softmax(torch.randn(2, 5, 7, generator=g), -1)
    other = torch.randn(2, 5, 7, generator=g)
    both = row_kl(torch.cat([dense.exp().log(), other]).repeat(1, 1, 1)[:2].clone(), dense)
    assert torch.all(both.abs() < 1e-6)
    copies = row_kl(torch.cat([other, other]), dense)
    torch.testing.assert_close(copies[:2], copies[2:])
    torch.testing.assert_close(copies[:2], row_kl(other, dense))


@pytest.mark.parametrize("arch", ARCHS)
def test_scores_run_the_head_by_chunks_and_equal_the_whole_batch_logits(arch, monkeypatch):
    """Without gradients, the CE, the KL and a held-out check run the LM head on HEAD_TOKENS positions at a time
    (chunks that cross rows and copies included): no logits or log-softmax of the whole batch exist, and the values
    are those of the forward's whole logits."""
    import engine.algo.evaluate as evaluate

    model = build_model(arch)
    ids = batch(model)  # (rows x T: a chunk of 5 positions crosses rows)
    monkeypatch.setattr(evaluate, "HEAD_TOKENS", 5)
    vocab, largest = model.config.vocab_size, []
    head = model.get_output_embeddings().register_forward_hook(lambda m, i, out: largest.append(out.numel()))
    real_log_softmax = torch.nn.functional.log_softmax
    monkeypatch.setattr(torch.nn.functional, "log_softmax",
                        lambda x, *a, **k: largest.append(x.numel()) or real_log_softmax(x, *a, **k))
    try:
        ce = batch_loss(model, ids)
        reward = DenseKL()
        dense = reward.dense_logp(model, ids)
        with MaskHooks(ModelAdapter.for_model(model)) as hooks:
            layout = full_layout(model)
            hooks.set({u: layout.split(u, m[0]) for u, m in random_samples(layout, 1, seed=2).items()})
            kl = reward.scorer(model, ids)(model, ids.repeat(2, 1))  # (two copies of the batch)
            held_ce, held_kl = reward.held_out_means(model, [ids])
            largest_scored = max(largest)
            masked_logits = model(input_ids=ids).logits.float()
    finally:
        head.remove()
    assert largest_scored <= 5 * vocab
    full = model(input_ids=ids).logits.float()
    from engine.algo.evaluate import _row_losses

    torch.testing.assert_close(ce, _row_losses(full, ids), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dense, torch.log_softmax(full, -1), rtol=1e-5, atol=1e-5)
    want = row_kl(masked_logits, dense)
    torch.testing.assert_close(kl, torch.cat([want, want]), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(float(held_kl), float(want.double().mean()), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(float(held_ce), float(_row_losses(masked_logits, ids).double().mean()), rtol=1e-5,
                               atol=1e-5)
    assert float(kl.min()) > 0


def kl_config(tiny_path, small_eval_file, **kw) -> PruneConfig:
    return small_config(tiny_path, small_eval_file, reward="kl", **kw)


def test_a_kl_run_reports_its_reward_and_resumes_as_an_uninterrupted_one(tiny, tiny_path, small_eval_file, tmp_path):
    a, b = tmp_path / "A", tmp_path / "B"
    results_a = PruneRun(kl_config(tiny_path, small_eval_file), a, model=tiny[0], tokenizer=tiny[1], log=quiet).run(
        progress=False)
    assert results_a["reward"] == "kl" and results_a["calib_source"] == "data"
    lines = metric_lines(a)
    assert all(x >= 0 for ln in lines for x in ln["losses"])  # KL, not a cross-entropy
    checked = [ln for ln in lines if ln.get("val_ppl")]
    assert checked and all(ln["val_reward"] is not None and ln["val_reward"] < 5 for ln in checked)
    assert stop_after(kl_config(tiny_path, small_eval_file), b, tiny, 3)["status"] == "stopped"
    results_b = resume_run(b, tiny)
    assert_same_run(a, b, results_a, results_b)


def test_a_ce_run_writes_no_reward_value(tiny, tiny_path, small_eval_file, tmp_path):
    PruneRun(small_config(tiny_path, small_eval_file), tmp_path / "A", model=tiny[0], tokenizer=tiny[1],
             log=quiet).run(progress=False)
    assert all(ln.get("val_reward") is None for ln in metric_lines(tmp_path / "A"))


# --- calibration sources ----------------------------------------------------------------------------
def self_config(**kw) -> PruneConfig:
    return PruneConfig.of(**{"calib_source": "self", "self_docs": 3, "self_tokens": 20, "seed": 0, **kw})


def test_self_generated_documents_are_seeded_cached_and_start_from_calibration_prompts(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny
    monkeypatch.setenv("PG_PRUNE_SELF_CALIB_CACHE", str(tmp_path / "cache"))
    texts = [f"Story {i}: the cat sat on the mat and looked at the bird in the tree." for i in range(5)]
    docs, what = CALIB_SOURCES["self"](texts, model, tokenizer, self_config(), "model-A", log=quiet)
    again, _ = CALIB_SOURCES["self"](texts, model, tokenizer, self_config(), None, log=quiet)  # (uncached: sampled)
    assert docs == again and len(docs) == 3 and "temperature 1.0" in what
    for d in docs:
        ids = tokenizer(d, add_special_tokens=False)["input_ids"]
        assert len(ids) >= PROMPT_TOKENS + 10  # the prompt and its sampled continuation
        assert any(d.startswith(t[:8]) for t in texts)
    assert len(list((tmp_path / "cache").iterdir())) == 1
    other, _ = CALIB_SOURCES["self"](texts, model, tokenizer, self_config(seed=1), "model-A", log=quiet)
    assert other != docs
    # the cache serves the same documents without sampling
    monkeypatch.setattr("engine.data.calib_sources.sample_documents", lambda *a, **k: pytest.fail("sampled again"))
    cached, _ = CALIB_SOURCES["self"](texts, model, tokenizer, self_config(), "model-A", log=quiet)
    assert cached == docs


def test_a_cached_generation_serves_fewer_documents_and_goes_on_for_more(tiny, tmp_path, monkeypatch):
    """Documents are sampled in seeded batches, so a generation's first whole batches are a smaller one's: the
    cache serves them without sampling, a larger count samples only the batches it lacks, and what either gives
    equals an uncached generation of that count. A count that ends inside a cached batch samples its last batch
    and leaves the longer cache as it was."""
    model, tokenizer = tiny
    monkeypatch.setenv("PG_PRUNE_SELF_CALIB_CACHE", str(tmp_path / "cache"))
    texts = [f"Note {i}: the dog ran to the gate and barked at the man with the hat." for i in range(7)]

    def fresh(n):  # an uncached generation of n documents (no fingerprint: never cached), 2 a batch
        return CALIB_SOURCES["self"](texts, model, tokenizer, self_config(self_docs=n, self_batch=2), None,
                                     log=quiet)[0]

    def cached(n, seen=None):
        return CALIB_SOURCES["self"](texts, model, tokenizer, self_config(self_docs=n, self_batch=2), "model-A",
                                     log=quiet if seen is None else seen.append)[0]

    want = {n: fresh(n) for n in (3, 4, 6)}
    four = cached(4)
    assert four == want[4]
    (path,) = (tmp_path / "cache").iterdir()
    sampled = []  # documents each generation sampled (its result less the whole batches it was given)
    real = calib_sources.sample_documents

    def counting(model, tokenizer, prompt_ids, new_tokens, temperature, seed, log, done, keep, **how):
        docs = real(model, tokenizer, prompt_ids, new_tokens, temperature, seed, log, done, keep, **how)
        sampled.append(len(docs) - (len(done) - len(done) % how["batch_size"]))
        return docs

    monkeypatch.setattr("engine.data.calib_sources.sample_documents", counting)
    seen = []
    assert cached(2, seen) == four[:2] and not sampled and any("the first 2 of 4" in m for m in seen)
    assert cached(6) == want[6] and sampled == [2]
    assert len(calib_sources.read_documents(path)) == 6 and len(list((tmp_path / "cache").iterdir())) == 1
    sampled.clear()
    assert cached(3) == want[3] and sampled == [1]  # ends inside the second cached batch: sampled at its own size
    assert want[3][:2] == four[:2] and len(calib_sources.read_documents(path)) == 6  # the longer one stays cached
    # a cache an earlier version wrote for this count (its name held the count) is read and renamed
    old = calib_sources.self_key("model-B", self_config(self_docs=4), calib_sources.texts_digest(texts), 4)
    calib_sources.write_documents(tmp_path / "cache" / f"{old}.jsonl.gz", four, quiet)
    digest = calib_sources.texts_digest(texts)
    assert calib_sources.text_cached(self_config(self_docs=4), "model-B", lambda: digest)  # (the plan's look:
    assert (tmp_path / "cache" / f"{old}.jsonl.gz").exists()  # it moves nothing)
    monkeypatch.setattr("engine.data.calib_sources.sample_documents", lambda *a, **k: pytest.fail("sampled again"))
    assert CALIB_SOURCES["self"](texts, model, tokenizer, self_config(self_docs=4), "model-B", log=quiet)[0] == four
    assert not (tmp_path / "cache" / f"{old}.jsonl.gz").exists()


def test_the_mix_interleaves_calibration_and_generated_documents(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny
    monkeypatch.setenv("PG_PRUNE_SELF_CALIB_CACHE", str(tmp_path / "cache"))
    texts = [f"Document {i} tells of a small dog who ran far away from home one day." for i in range(6)]
    mixed, what = CALIB_SOURCES["mix"](texts, model, tokenizer, self_config(), "model-A", log=quiet)
    generated, _ = CALIB_SOURCES["self"](texts, model, tokenizer, self_config(), "model-A", log=quiet)
    assert mixed[1::2] == generated and all(d in texts for d in mixed[0::2]) and len(set(mixed[0::2])) == 3
    assert "interleaved" in what


def test_a_run_on_self_generated_text_records_it(tiny, tiny_path, small_eval_file, tmp_path, monkeypatch):
    monkeypatch.setenv("PG_PRUNE_SELF_CALIB_CACHE", str(tmp_path / "cache"))
    config = small_config(tiny_path, small_eval_file, calib_source="self", self_docs=24, self_tokens=150, steps=2)
    res = PruneRun(config, tmp_path / "A", model=tiny[0], tokenizer=tiny[1], log=quiet).run(progress=False)
    assert res["calib_source"] == "self" and "sampled from the dense model" in res["scored_on"]
    assert json.loads((tmp_path / "A" / "config.json").read_text())["calib_source"] == "self"
    # the text's sampling is a phase of its own, planned and measured (not "load")
    assert res["seconds_by_phase"][CALIB_PHASE] > 0 and res["plan_seconds_by_phase"][CALIB_PHASE] > 0
    assert set(res["plan_seconds_by_phase"]) == set(res["seconds_by_phase"])


def test_the_steps_may_read_another_source_than_the_init(tiny, tiny_path, small_eval_file, tmp_path, monkeypatch):
    """--step-calib-source: the steps' batches and their held-out check come from that source's text, while the
    init (its metric, the joint mix, the refit's statistics) reads --calib-source's, every document of it; same
    (the default) is one source for both, as before."""
    from engine.data.calib_sources import run_generates, step_source_of
    from engine.data.text import CalibrationSampler, load_calibration_texts
    from engine.data.tokenize_docs import tokenize_documents

    def key(doc) -> tuple:  # (a sampler's documents are tensors, tokenize_documents' may be lists)
        return tuple(doc.tolist() if hasattr(doc, "tolist") else doc)

    def inside(row: list[int], doc: tuple) -> bool:
        return any(list(doc[i:i + len(row)]) == row for i in range(len(doc) - len(row) + 1))

    monkeypatch.setenv("PG_PRUNE_SELF_CALIB_CACHE", str(tmp_path / "cache"))
    config = small_config(tiny_path, small_eval_file, calib_source="data", step_calib_source="self", self_docs=20,
                          self_tokens=70, steps=1, val_every=1)
    assert step_source_of(config) == "self" and run_generates(config) and generated_tokens(config) > 0
    assert step_source_of(dataclasses.replace(config, step_calib_source="same")) == "data"
    assert not run_generates(dataclasses.replace(config, step_calib_source="same"))
    run = PruneRun(config, tmp_path / "A", model=tiny[0], tokenizer=tiny[1], log=quiet)
    own, _ = CALIB_SOURCES["self"](load_calibration_texts(config.calib)[0], tiny[0], tiny[1], config, None, log=quiet)
    own_ids = {key(d) for d in tokenize_documents(tiny[1], own)}
    steps_docs, init_docs = {key(d) for d in run.res.sampler.docs}, {key(d) for d in run.res.init_sampler.docs}
    assert steps_docs < own_ids and len(steps_docs) == len(own_ids) - len(own_ids) // 10  # (every 10th held out)
    assert not init_docs & own_ids  # (the init reads the calibration documents, all of them)
    every = CalibrationSampler(tiny[1], None, config.seqlen, config.batch_size, config.seed,
                               tokenize_documents(tiny[1], load_calibration_texts(config.calib)[0]))
    assert init_docs == {key(d) for d in every.docs}
    held_out = [r for b in run.res.val_batches for r in b.tolist()]
    assert held_out and all(any(inside(r, d) for d in own_ids - steps_docs) for r in held_out)  # (own text, held out)
    res = run.run(progress=False)
    assert res["calib_source"] == "data" and res["step_calib_source"] == "self"
    assert "the steps and their check" in res["scored_on"] and res["seconds_by_phase"][CALIB_PHASE] > 0


def test_auto_reads_the_own_text_from_half_the_decoder_and_the_documents_below(tiny, tiny_path, small_eval_file,
                                                                              tmp_path, monkeypatch):
    """--calib-source auto (the joint preset's): the source measured best at the run's rate, resolved per run;
    the run records what it read; an explicit source is taken as given."""
    monkeypatch.setenv("PG_PRUNE_SELF_CALIB_CACHE", str(tmp_path / "cache"))
    assert PRESETS["joint"]["calib_source"] == "auto"
    below, at, above = (PruneConfig.of(calib_source="auto", prune_ratio=r) for r in (SELF_FROM - 0.05, SELF_FROM, 0.7))
    assert [source_of(c) for c in (below, at, above)] == ["data", "self", "self"]
    assert generated_tokens(below) == 0 and generated_tokens(at) == at.self_docs * (PROMPT_TOKENS + at.self_tokens)
    assert source_of(PruneConfig.of(calib_source="self", prune_ratio=0.1)) == "self"
    assert source_of(PruneConfig.of(calib_source="data", prune_ratio=0.9)) == "data"
    runs = {}
    for name, rate in (("low", 0.3), ("high", SELF_FROM)):
        config = small_config(tiny_path, small_eval_file, calib_source="auto", prune_ratio=rate, self_docs=20,
                              self_tokens=70, steps=1)
        runs[name] = PruneRun(config, tmp_path / name, model=tiny[0], tokenizer=tiny[1], log=quiet).run(progress=False)
    assert runs["low"]["calib_source"] == "data" and runs["low"]["scored_on"] == "the calibration documents"
    assert CALIB_PHASE not in runs["low"]["seconds_by_phase"]
    assert runs["high"]["calib_source"] == "self" and "sampled from the dense model" in runs["high"]["scored_on"]
    assert json.loads((tmp_path / "high" / "config.json").read_text())["calib_source"] == "auto"


def test_the_plan_counts_the_text_a_source_generates_until_it_is_cached(tiny, tiny_path, small_eval_file, tmp_path,
                                                                       monkeypatch):
    """The app's plan, before a run: the generated text's tokens (each document's prompt and continuation) at
    GENERATE_WEIGHT, at the sampler's measured speed-up (the default's 128 a batch, in bfloat16 where native),
    while it is not cached, nothing once a run from the model's files has cached it, nothing for the calibration
    documents as given."""
    from engine.data.calib_sources import generation_dtype
    from engine.plan.forecast import GENERATE_SPEEDUP

    monkeypatch.setenv("PG_PRUNE_SELF_CALIB_CACHE", str(tmp_path / "cache"))
    skeleton = model_skeleton(str(tiny_path))
    config = small_config(tiny_path, small_eval_file, calib_source="self", self_docs=20, self_tokens=70, steps=1)
    assert generated_tokens(config) == 20 * (PROMPT_TOKENS + 70)
    speedup = GENERATE_SPEEDUP[(config.self_batch, generation_dtype(config))]
    assert phase_tokens(config, skeleton)[CALIB_PHASE] == pytest.approx(20 * (PROMPT_TOKENS + 70) * GENERATE_WEIGHT
                                                                        / speedup)
    assert CALIB_PHASE not in phase_tokens(config, skeleton, text_cached=True)
    assert CALIB_PHASE not in phase_tokens(small_config(tiny_path, small_eval_file), skeleton)
    assert not config_text_cached(config) and not config_text_cached(small_config(tiny_path, small_eval_file))
    PruneRun(config, tmp_path / "A", log=quiet).run(progress=False)  # (the model read from its files: cached)
    assert config_text_cached(config)
    assert not config_text_cached(dataclasses.replace(config, seed=1))
    assert not config_text_cached(dataclasses.replace(config, self_tokens=71))
    second = PruneRun(config, tmp_path / "B", log=quiet).run(progress=False)  # (read from the cache: about 0 s)
    assert second["seconds_by_phase"].get(CALIB_PHASE, 0.0) < 1.0
    # a model in memory is never taken for the files' (no cache), unless the caller says it is them (the app)
    seen = []
    PruneRun(config, tmp_path / "C", model=tiny[0], tokenizer=tiny[1], log=seen.append).run(progress=False)
    assert not any("from the cache" in m for m in seen)
    seen.clear()
    PruneRun(config, tmp_path / "D", model=tiny[0], tokenizer=tiny[1], log=seen.append, from_files=True).run(progress=False)
    assert any("from the cache" in m for m in seen)


def test_an_interrupted_generation_goes_on_from_its_last_batch(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny
    monkeypatch.setenv("PG_PRUNE_SELF_CALIB_CACHE", str(tmp_path / "cache"))
    texts = [f"Tale {i}: a boy found a red ball under the big old tree near the river." for i in range(5)]
    one = self_config(self_batch=1)  # (one document a batch)
    whole, _ = CALIB_SOURCES["self"](texts, model, tokenizer, one, None, log=quiet)  # (uncached)

    def stop_after_one(msg):
        if "1/3 documents" in msg:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        CALIB_SOURCES["self"](texts, model, tokenizer, one, "model-A", log=stop_after_one)
    (partial,) = (tmp_path / "cache").glob("*.partial.jsonl.gz")
    seen = []
    docs, _ = CALIB_SOURCES["self"](texts, model, tokenizer, one, "model-A", log=seen.append)
    assert docs == whole and any("1 documents from an interrupted generation" in m for m in seen)
    assert not partial.exists() and len(list((tmp_path / "cache").iterdir())) == 1


def test_the_self_batch_and_dtype_sample_their_own_text_under_their_own_cache_key(tiny, tmp_path, monkeypatch):
    """--self-batch N samples N continuations at once, each batch from its own seed: a batch of 3 gives other
    documents than batches of 1 (the seeds differ), the same ones again when asked again, and another cache entry;
    --self-dtype bfloat16 samples with decode_bfloat16 under a key of its own, and leaves the weights as they were.
    The float32 sampler at 32 a batch (the default before 2026-12-06) keeps the key it had before the settings
    existed; the default (128, auto) has a key of its own."""
    model, tokenizer = tiny
    monkeypatch.setenv("PG_PRUNE_SELF_CALIB_CACHE", str(tmp_path / "cache"))
    texts = [f"Tale {i}: a boy found a red ball under the big old tree near the river." for i in range(5)]
    digest = calib_sources.texts_digest(texts)
    by = {b: CALIB_SOURCES["self"](texts, model, tokenizer, self_config(self_batch=b), "model-A", log=quiet)[0]
          for b in (1, 3)}
    assert by[1] != by[3] and len(by[3]) == 3
    assert CALIB_SOURCES["self"](texts, model, tokenizer, self_config(self_batch=3), None, log=quiet)[0] == by[3]
    assert len(list((tmp_path / "cache").iterdir())) == 2
    keys = {calib_sources.self_key("m", self_config(**kw), digest) for kw in
            ({"self_dtype": "float32"}, {"self_batch": 3}, {"self_dtype": "bfloat16"},
             {"self_batch": 32, "self_dtype": "float32"})}
    assert len(keys) == 4
    # (the float32 sampler at 32 a batch: as the files it cached were named)
    before = calib_sources.self_key("m", self_config(self_batch=32, self_dtype="float32"), digest)
    import hashlib
    old = ["m", "float32", 0, 20, 1.0, calib_sources.PROMPT_TOKENS, digest]
    assert before == hashlib.sha256(json.dumps(old).encode()).hexdigest()[:20]
    calls = []
    real = calib_sources.decode_bfloat16
    monkeypatch.setattr("engine.data.calib_sources.decode_bfloat16", lambda *a: calls.append(a[1].shape) or real(*a))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    bf = CALIB_SOURCES["self"](texts, model, tokenizer, self_config(self_dtype="bfloat16"), None, log=quiet)[0]
    assert calls and len(bf) == 3
    assert all(p.dtype == torch.float32 and torch.equal(p, weights[n]) for n, p in model.named_parameters())


def test_the_bfloat16_decoder_is_generate_with_a_kv_cache(tiny):
    """decode_bfloat16 (the own text's sampler in bfloat16): at a temperature near 0 it continues each prompt as
    transformers' greedy generate does with the same bfloat16 weights (its cache and positions are right), and it
    gives prompt + continuation; inside bfloat16_linears every linear weight is bfloat16, outside it the model is
    as it was, its LM head tied again."""
    from engine.data.calib_sources import bfloat16_linears, decode_bfloat16

    model, _ = tiny
    prompt = torch.randint(5, 200, (3, 6), generator=torch.Generator().manual_seed(0))
    with bfloat16_linears(model):
        assert all(m.weight.dtype == torch.bfloat16 for m in model.modules() if isinstance(m, torch.nn.Linear))
        ours = decode_bfloat16(model, prompt, 7, 1e-6)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            greedy = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                    max_new_tokens=7, min_new_tokens=7, pad_token_id=0)
    assert ours.shape == (3, 13) and torch.equal(ours[:, :6], prompt) and torch.equal(ours, greedy)
    assert all(m.weight.dtype == torch.float32 for m in model.modules() if isinstance(m, torch.nn.Linear))
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.get_input_embeddings().weight


def test_the_preallocated_cache_samples_the_tokens_a_growing_cache_samples(tiny):
    """decode_bfloat16 keeps its keys and values in buffers filled in place (preallocated_cache): at temperature 1,
    from the same seed, it samples exactly the tokens that the same loop over transformers' DynamicCache samples
    (the cache is a speed-up, not another text: the own-text cache's key stays valid); a cache asked for more
    positions than it holds says so."""
    from transformers import DynamicCache

    from engine.data.calib_sources import bfloat16_linears, decode_bfloat16, preallocated_cache

    model, _ = tiny
    prompt = torch.randint(5, 200, (4, 5), generator=torch.Generator().manual_seed(1))

    @torch.no_grad()
    def growing(new_tokens):  # the sampler's loop, over the cache that concatenates
        cache, x, out = DynamicCache(), prompt, [prompt]
        for _ in range(new_tokens):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            cdf = torch.softmax(logits.float(), dim=-1).cumsum(dim=-1)
            x = torch.searchsorted(cdf, torch.rand(cdf.shape[0], 1) * cdf[:, -1:]).clamp_(max=cdf.shape[1] - 1)
            out.append(x)
        return torch.cat(out, dim=1)

    with bfloat16_linears(model):
        torch.manual_seed(3)
        ours = decode_bfloat16(model, prompt, 9, 1.0)
        torch.manual_seed(3)
        theirs = growing(9)
    assert ours.shape == (4, 14) and torch.equal(ours, theirs)
    assert not torch.equal(ours[:, 5:], torch.full_like(ours[:, 5:], int(ours[0, 5])))  # (sampled, not constant)
    cache = preallocated_cache(3)
    k = torch.randn(2, 1, 2, 4)
    assert torch.equal(cache.update(k, k + 1, 0)[0], k)
    keys, values = cache.update(k[:, :, :1] * 2, k[:, :, :1], 0)
    assert torch.equal(keys, torch.cat([k, k[:, :, :1] * 2], dim=2)) and cache.get_seq_length(0) == 3
    with pytest.raises(ValueError, match="holds 3 positions"):
        cache.update(k, k, 0)


# --- --step-refit: samples scored as they would be exported ------------------------------------------
def test_step_refit_scores_each_sample_under_its_own_refit(tiny, tiny_path, small_eval_file, tmp_path):
    """With --step-refit a step's sample j scores exactly what the run's refit of mask j scores (RunMasks.weights,
    as the export is made), the weights are the dense ones again after the step, and the refit moves the scores
    (so the option is not a no-op); a run with it finishes, and without --reconstruct it scores no refit."""
    from engine.algo.policy import sample_masks

    model = tiny[0]
    run = PruneRun(small_config(tiny_path, small_eval_file, step_refit=True, reconstruct=True, reconstruct_batches=2,
                                steps=2),
                   tmp_path / "A", model=model, tokenizer=tiny[1], log=quiet)
    state = fresh_state(run.res, run.call_hooks)
    batch = run.res.sampler.next_batch()
    samples = {u: sample_masks(s, 3, torch.Generator().manual_seed(1), False) for u, s in state.scores.items()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    got = run.res.ctx.rewards(samples, batch)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    weights, run.res.ctx.weights = run.res.ctx.weights, None
    plain = run.res.ctx.rewards(samples, batch)
    for j in range(3):
        one = {u: m[j] for u, m in samples.items()}
        with run.res.masks.weights(one) as comp_means:
            want = run.res.ctx.losses({u: m[j:j + 1] for u, m in samples.items()}, batch, comp_means)
        assert torch.equal(got[j:j + 1], want), (j, got, want)
    assert not torch.allclose(got, plain)
    run.res.ctx.weights = weights
    results = run.run(progress=False)
    assert results["status"] == "done" and results["steps"] == 2
    # without --reconstruct there is no refit to score under (as --mix-refit): the samples get the compensation only
    plain_run = PruneRun(small_config(tiny_path, small_eval_file, step_refit=True, reconstruct=False, steps=1), None,
                         model=model, tokenizer=tiny[1], log=quiet)
    assert plain_run.res.ctx.weights is None
