"""Recovery by distillation (issue 67) on the tiny real model: an identical teacher changes nothing, one KL step is
the hand computation, LoRA merged is LoRA unmerged, a stopped and resumed recovery ends bit for bit as an
uninterrupted one, the recovered export reloads and converts to GGUF, bad input is one error line."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import torch

import engine
from engine.data.text import load_calibration_texts
from engine.model.loading import load_model, resolve_model
from engine.tools.finetune import training_segments
from engine.tools.recover import (RecoverConfig, RecoverInterrupted, TrainState, batch_indices, ce_loss,
                                  distil_step, finished_model, kl_loss, lr_factor, make_optimizer, mixed_loss,
                                  next_step_fits, prepare_student, recover, train)

from conftest import SMALL_CALIB, TINY_MODEL, assert_cli_fails_with_one_line, one_error, quiet, run_engine

SMALL = dict(seqlen=32, batch_size=2, skip_eval=True, checkpoint_every=4)


@pytest.fixture(scope="module")
def segments(tiny):
    texts = load_calibration_texts(str(SMALL_CALIB))[0][:40]
    return training_segments(tiny[1], texts, 32, 10**9, seed=0)


def fresh(path=TINY_MODEL):
    """A model of its own (the session's `tiny` is shared): (model, tokenizer)."""
    return load_model(resolve_model(str(path)))


def state_max_diff(a, b) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


# --- the pure parts -----------------------------------------------------------------------------------------
def test_the_sampler_is_a_pure_function_of_the_step():
    n, bs = 10, 3
    first = [i for s in range(4) for i in batch_indices(s, n, bs, seed=7)]  # 12 positions: one epoch and 2 more
    assert sorted(first[:10]) == list(range(10))  # an epoch reads every segment once
    assert first == [i for s in range(4) for i in batch_indices(s, n, bs, seed=7)]  # the same again, any time
    assert batch_indices(3, n, bs, seed=7) == first[9:12]
    assert first != [i for s in range(4) for i in batch_indices(s, n, bs, seed=8)]


def test_schedule_loss_mix_and_time_budget():
    assert [lr_factor(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(0, 0) == 1.0
    kl, ce = torch.tensor(2.0), torch.tensor(float("nan"))
    assert mixed_loss(kl, ce, 0.0) is kl  # (no zero-weighted term: a NaN CE never leaks into the pure KL)
    assert float(mixed_loss(torch.tensor(2.0), torch.tensor(4.0), 0.25)) == 2.5
    assert next_step_fits(0.0, None, 1.0)  # the first step runs
    assert next_step_fits(50.0, 10.0, 60.0) and not next_step_fits(50.1, 10.0, 60.0)
    assert next_step_fits(1e9, 10.0, None)


# --- the loss and one step ----------------------------------------------------------------------------------
def test_kl_and_ce_equal_a_hand_computation_in_float64():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(3, 7, 50, generator=g) * 3, torch.randn(3, 7, 50, generator=g) * 3
    ids = torch.randint(50, (3, 7), generator=g)
    s, t = student.double(), teacher.double()
    p = t.softmax(-1)
    hand_kl = (p * (t.log_softmax(-1) - s.log_softmax(-1))).sum(-1)[:, :-1].mean()  # positions 0..T-2
    hand_ce = -s.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    assert float(kl_loss(student, teacher)) == pytest.approx(float(hand_kl), rel=1e-5)
    assert float(ce_loss(student, ids)) == pytest.approx(float(hand_ce), rel=1e-5)
    # and its gradient in the student's logits is the exact one: torch's gradcheck in float64
    s64 = s.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: kl_loss(x, t), (s64,))


def test_one_kl_step_equals_a_hand_computation(finished_template, tiny, segments):
    """Full mode, one AdamW step from the pruned export toward the tiny dense model: the weights move by AdamW's first
    step, -lr g / (|g| + eps), where g is the gradient of the KL written out by hand in float64."""
    teacher = fresh()[0]
    student = fresh(finished_template / "model")[0]
    reference = fresh(finished_template / "model")[0].double()
    batch, lr = segments[:2], 1e-3
    config = RecoverConfig(mode="full", lr=lr, **SMALL)
    trained, params = prepare_student(student, config)
    before = {n: p.detach().clone() for n, p in params}
    losses = distil_step(trained, teacher, batch, make_optimizer(params, config), lr, 0.0)

    ref_params = dict(reference.named_parameters())
    for n, _ in params:
        ref_params[n].requires_grad_(True)
    with torch.no_grad():
        p = teacher(input_ids=batch).logits.double().softmax(-1)
    logq = reference(input_ids=batch).logits.log_softmax(-1)
    hand = (p * (p.log() - logq)).sum(-1)[:, :-1].mean()
    hand.backward()
    assert losses["kl"] == pytest.approx(float(hand.detach()), rel=1e-5) and losses["loss"] == losses["kl"]
    for n, param in params:
        grad = ref_params[n].grad
        want = -lr * grad / (grad.abs() + 1e-8)  # AdamW's first step (no weight decay): bias-corrected m / sqrt(v)
        moved = (param.detach() - before[n]).double()
        clear = grad.abs() > 1e-6  # (where |g| is far above eps: the float32 and float64 gradients give one sign)
        assert clear.float().mean() > 0.5, n
        assert torch.allclose(moved[clear], want[clear], atol=lr * 1e-3), n
    frozen = dict(student.named_parameters())
    assert all(not frozen[n].requires_grad for n in ("model.embed_tokens.weight", "model.norm.weight"))


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_an_identical_teacher_leaves_the_model_unchanged(mode, segments):
    student, teacher = fresh()[0], fresh()[0]
    config = RecoverConfig(mode=mode, steps=4, lr=1e-2, ce_weight=0.0, **SMALL)  # (a large lr: any gradient shows)
    trained, params = prepare_student(student, config)
    state = TrainState()
    assert train(trained, teacher, params, make_optimizer(params, config), segments, config, state) == "steps"
    assert state.step == 4 and all(r["kl"] < 1e-6 for r in state.records)
    model, merge_diff = finished_model(trained, config, segments[:2])
    assert state_max_diff(model, teacher) < 1e-6, state_max_diff(model, teacher)


def test_lora_merged_equals_lora_unmerged(finished_template, segments):
    """Merging changes no logit beyond float rounding: in float64 to 1e-9, in float32 (as it is saved) within 1e-5
    of the logits' scale (the two float32 sums, x W + (x A) B against x (W + B A), differ by about 2e-5 on logits
    of about 12)."""
    import copy

    student, teacher = fresh(finished_template / "model")[0], fresh()[0]
    config = RecoverConfig(mode="lora", steps=3, lora_dropout=0.0, **SMALL)  # (the default lr)
    trained, params = prepare_student(student, config)
    train(trained, teacher, params, make_optimizer(params, config), segments, config, TrainState())
    assert max(float(p.detach().abs().max()) for n, p in params if "lora_B" in n) > 1e-4  # the adapters learned
    trained.eval()
    ids = segments[5:8]
    wide = copy.deepcopy(trained).double()
    with torch.no_grad():
        unmerged, unmerged64 = trained(input_ids=ids).logits, wide(input_ids=ids).logits
    merged, diff = finished_model(trained, config, ids)
    merged64, _ = finished_model(wide, config, ids)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        assert float((merged64(input_ids=ids).logits - unmerged64).abs().max()) < 1e-9
        assert float((merged(input_ids=ids).logits - unmerged).abs().max()) < 1e-5 * float(unmerged.abs().max())
    assert diff < 1e-5 * float(unmerged.abs().max())


# --- the command: resume, export, bad input -----------------------------------------------------------------
def weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model" / "model.safetensors"))


def log_lines(folder):
    return [{k: r.get(k) for k in ("step", "loss", "kl", "ce", "lr")}
            for r in map(json.loads, (folder / "recover_log.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("mode, ce_weight", [("lora", 1.0), ("full", 0.0)])  # (the default CE-LoRA; KL, all weights)
def test_a_stopped_and_resumed_recovery_ends_as_an_uninterrupted_one(mode, ce_weight, finished_template, tmp_path):
    whole = recover(finished_template, tmp_path / "whole", mode=mode, ce_weight=ce_weight, steps=6, log=quiet, **SMALL)
    assert whole.results["steps"] == 6 and whole.results["ended_by"] == "steps"

    stop = threading.Event()  # stopped after step 2 (as the app's Stop would), then resumed to 6
    stopped = recover(finished_template, tmp_path / "parts", mode=mode, ce_weight=ce_weight, steps=6, log=quiet, stop=stop,
                      on_step=lambda r: r["step"] == 2 and stop.set(), **SMALL)
    assert stopped.results["steps"] == 2 and stopped.results["ended_by"] == "stop"
    resumed = recover(finished_template, tmp_path / "parts", resume=True, log=quiet)
    assert resumed.results["steps"] == 6

    def interrupt(record):  # Ctrl-C after step 3: the step is saved, then the interruption propagates
        if record["step"] == 3:
            raise KeyboardInterrupt
    with pytest.raises(RecoverInterrupted) as e:
        recover(finished_template, tmp_path / "ctrl-c", mode=mode, ce_weight=ce_weight, steps=6, log=quiet,
                on_step=interrupt, **SMALL)
    assert e.value.step == 3 and not (tmp_path / "ctrl-c" / "model").exists()
    recover(finished_template, tmp_path / "ctrl-c", resume=True, log=quiet)

    want = weights(tmp_path / "whole")
    for name in ("parts", "ctrl-c"):
        got = weights(tmp_path / name)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name
        assert log_lines(tmp_path / name) == log_lines(tmp_path / "whole"), name
    with pytest.raises(engine.errors.UserError, match="has run its 6 steps"):
        recover(finished_template, tmp_path / "whole", resume=True, log=quiet)
    with pytest.raises(engine.errors.UserError, match="saved settings"):
        recover(finished_template, tmp_path / "whole", resume=True, steps=8, seqlen=64, log=quiet)


def test_the_default_ce_recovery_reads_no_teacher(finished_template, segments, tmp_path, monkeypatch):
    """--ce-weight 1, the default: one step's loss is the text's cross-entropy written out by hand, the teacher is
    never run (None will do), and a recovery whose run's base model cannot be loaded still runs: no teacher is
    loaded, and its log and results carry no KL."""
    from engine.tools.recover import backward_losses

    student = fresh(finished_template / "model")[0]
    config = RecoverConfig(mode="full", lr=1e-3, **SMALL)
    assert config.ce_weight == 1.0 and not config.distils
    trained, params = prepare_student(student, config)
    batch = segments[:2]
    losses = backward_losses(trained, None, batch, make_optimizer(params, config), config.ce_weight)
    with torch.no_grad():
        logp = fresh(finished_template / "model")[0].double()(input_ids=batch).logits.log_softmax(-1)
    hand = -logp[:, :-1].gather(-1, batch[:, 1:, None]).mean()
    assert "kl" not in losses and losses["loss"] == losses["ce"] == pytest.approx(float(hand), rel=1e-5)

    run = tmp_path / "run"
    shutil.copytree(finished_template, run)
    config_file = run / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "model": str(tmp_path / "gone")}))
    res = recover(run, tmp_path / "out", steps=2, log=quiet, **SMALL).results
    assert res["steps"] == 2 and res["teacher"] is None and res["kl_last"] is None and res["ce_weight"] == 1.0
    assert all("kl" not in json.loads(ln) for ln in (tmp_path / "out" / "recover_log.jsonl").read_text().splitlines())


def test_the_recovered_export_reloads_and_converts_to_gguf(finished_template, tmp_path, capfd):
    from transformers import AutoModelForCausalLM

    from engine.cli import main

    assert engine.recover is recover
    out = tmp_path / "rec"
    result = recover(finished_template, out, steps=3, lr=1e-2, ce_weight=0.5, log=quiet, seqlen=32, batch_size=2)
    r = json.loads((out / "recover_results.json").read_text())
    assert r == result.results and result.model == out / "model"
    assert {"ppl_before", "ppl_after", "loss_first", "loss_last", "steps", "train_seconds", "mode"} <= r.keys()
    assert r["ppl_before"] == pytest.approx(r["ppl_pruned"])  # the run's own evaluation settings
    assert len((out / "recover_log.jsonl").read_text().splitlines()) == 3
    assert json.loads((out / "recover_config.json").read_text())["teacher"] == str(TINY_MODEL)

    ids = torch.tensor([list(range(10, 40))])
    ours = fresh(out / "model")[0]
    plain = AutoModelForCausalLM.from_pretrained(out / "model", trust_remote_code=True).eval()
    pruned = fresh(finished_template / "model")[0]
    with torch.no_grad():
        want = ours(input_ids=ids).logits[0]
        assert float((plain(input_ids=ids).logits[0] - want).abs().max()) < 1e-5
        assert float((pruned(input_ids=ids).logits[0] - want).abs().max()) > 1e-4  # recovery changed the weights
    assert json.loads((out / "model" / "config.json").read_text())["model_type"] == \
        json.loads((finished_template / "model" / "config.json").read_text())["model_type"]

    dest = tmp_path / "rec.gguf"
    assert main(["export", str(out), "--format", "gguf", "--out", str(dest), "--outtype", "f32"]) == 0
    llama_cpp = pytest.importorskip("llama_cpp")
    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(dest), n_ctx=64, logits_all=True, verbose=False, n_threads=1,
                          type_k=f32, type_v=f32)
    llm.eval(ids[0].tolist())
    got = torch.tensor(llm.scores[: ids.shape[1]]).float()
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-3


@pytest.fixture(scope="module")
def other_vocab_teacher(tiny, tmp_path_factory):
    """A small LLaMA with 52 more tokens than the tiny model (its tokenizer plus added tokens)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(TINY_MODEL))
    tok.add_tokens([f"<extra{i}>" for i in range(52)])
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    dest = tmp_path_factory.mktemp("teacher") / "other"
    LlamaForCausalLM(config).save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def test_bad_input_is_one_error_line_from_the_command(finished_template, other_vocab_teacher, tmp_path):
    no_model = tmp_path / "no-model"
    shutil.copytree(finished_template, no_model)
    shutil.rmtree(no_model / "model")
    other = tmp_path / "other-teacher"
    shutil.copytree(finished_template, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model": str(other_vocab_teacher)}))
    for run, extra, message in ((no_model, [], "no model/"), (other, ["--ce-weight", "0"], "another vocabulary"),
                                (finished_template, ["--time-budget", "0"], "time budget must be above 0")):
        res = run_engine("recover", str(run), "--out", str(tmp_path / "out"), "--skip-eval", *extra)
        errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
        assert res.returncode == 2 and len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert message in errors[0], errors[0]
        assert not (tmp_path / "out").exists()  # nothing was left behind


@pytest.mark.parametrize("args,message", [
    (["--steps", "0"], "steps must be at least 1"),
    (["--time-budget", "-1"], "time budget must be above 0"),
    (["--ce-weight", "1.5"], "ce weight must be at most 1"),
    (["--teacher", str(TINY_MODEL)], "--teacher is read only by a recovery with a KL term"),
    (["--mode", "half"], "invalid choice"),
    (["--resume"], "holds no recovery to continue"),
])
def test_bad_settings_are_one_error_line(args, message, finished_template, tmp_path, capfd):
    assert_cli_fails_with_one_line(["recover", str(finished_template), "--out", str(tmp_path / "o"), *args],
                                   message, capfd)


def test_an_evaluation_text_is_never_training_text(finished_template, eval_file, tmp_path, capfd):
    from engine.cli import main

    assert main(["recover", str(finished_template), "--out", str(tmp_path / "o"), "--calib", str(eval_file)]) == 2
    one_error(capfd, "is the evaluation text")
    assert main(["recover", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    one_error(capfd, "not a prune run folder")


def test_a_time_budget_stops_when_the_next_step_would_not_fit_and_bfloat16_is_said(finished_template, tmp_path):
    """A budget shorter than one step: the first step runs (nothing is timed before it), the second would not fit.
    --dtype bfloat16 runs the forwards under autocast (the weights stay float32) and results.json says so."""
    r = recover(finished_template, tmp_path / "t", time_budget=1e-5, dtype="bfloat16", log=quiet, **SMALL).results
    assert r["steps"] == 1 and r["ended_by"] == "time budget" and r["precision"] == "bfloat16"
    saved = fresh(tmp_path / "t" / "model")[0]
    assert all(p.dtype == torch.float32 for p in saved.parameters())
    auto = recover(finished_template, tmp_path / "a", steps=1, log=quiet, **SMALL).results
    assert auto["precision"] == "float32"  # (the suite runs as on a CPU without native bfloat16: PG_PRUNE_NATIVE_BF16=0)


def test_a_cpu_clock_budget_counts_this_process_cpu_not_the_wait(finished_template, tmp_path):
    """--budget-clock cpu: time the process spends off the CPU (here a sleep after every step, as when other jobs
    hold the cores) does not count against the budget; the wall clock counts it and stops after the first step."""
    def nap(record):
        time.sleep(0.6)

    wall = recover(finished_template, tmp_path / "w", steps=3, time_budget=0.5 / 60, on_step=nap, log=quiet,
                   **SMALL).results
    cpu = recover(finished_template, tmp_path / "c", steps=3, time_budget=0.5 / 60, budget_clock="cpu", on_step=nap,
                  log=quiet, **SMALL).results
    assert wall["steps"] == 1 and wall["ended_by"] == "time budget"
    assert cpu["steps"] == 3 and cpu["ended_by"] == "steps"
    saved = json.loads((tmp_path / "c" / "recover_config.json").read_text())
    assert saved["budget_clock"] == "cpu"


# --- prune --recover MINUTES: the chain ------------------------------------------------------------------------
def test_the_checkpoint_keeps_every_sessions_cpu_seconds_of_training(finished_template, tmp_path):
    """A recovery's checkpoint holds the CPU seconds of its training summed over its sessions (what a ladder of CPU
    budgets that resumes subtracts, since --time-budget counts one session's minutes: bench/recover_study.py);
    trained_so_far reads them, (0, 0.0) without a checkpoint, and None for CPU where an older checkpoint lacks them."""
    from engine.tools.recover import CHECKPOINT_FILE, trained_so_far

    out = tmp_path / "r"
    assert trained_so_far(out) == (0, 0.0)
    first = recover(finished_template, out, steps=2, log=quiet, **SMALL).results
    steps, cpu = trained_so_far(out)
    assert steps == 2 and 0 < cpu <= time.process_time() and cpu == pytest.approx(first["train_cpu_seconds"])
    second = recover(finished_template, out, resume=True, steps=4, log=quiet).results
    steps, more = trained_so_far(out)
    assert steps == 4 and more == pytest.approx(second["train_cpu_seconds"]) and more > cpu
    ckpt = torch.load(out / CHECKPOINT_FILE, weights_only=True)
    del ckpt["cpu_seconds"]  # (a checkpoint from before they were kept)
    torch.save(ckpt, out / CHECKPOINT_FILE)
    assert trained_so_far(out) == (4, None)
    assert recover(finished_template, out, resume=True, steps=5, log=quiet).results["train_cpu_seconds"] is None


def chain_argv(out, *extra):
    return ["prune", "--model", str(TINY_MODEL), "--out", str(out), "--steps", "1", "--max-windows", "2",
            "--init-batches", "1", "--batch-size", "2", "--preset", "fast", *extra]


def test_prune_recover_chains_a_recovery_into_the_run_folder(tmp_path, capfd):
    """prune --recover MINUTES: the run finishes as without it, then its export is distilled into RUN/recover for
    that many minutes (recover's own files, a model that reloads); --resume of the finished run with --recover
    continues that recovery from its checkpoint."""
    from engine.cli import main

    out = tmp_path / "run"
    assert main(chain_argv(out, "--recover", "0.002")) == 0
    err = capfd.readouterr().err
    assert (f"recovery: {out / 'model'} fine-tuned on the text (CE), LoRA, for 0.002 min into {out / 'recover'}"
            in err)
    res = json.loads((out / "recover" / "recover_results.json").read_text())
    assert res["ended_by"] == "time budget" and res["steps"] >= 1
    assert (out / "results.json").is_file() and fresh(out / "recover" / "model")[0] is not None
    saved = json.loads((out / "recover" / "recover_config.json").read_text())
    assert saved["time_budget"] == 0.002 and saved["run"] == str(out)
    assert main(["prune", "--out", str(out), "--resume", "--recover", "0.002"]) == 0
    assert "(continued from its checkpoint)" in capfd.readouterr().err
    assert json.loads((out / "recover" / "recover_results.json").read_text())["steps"] > res["steps"]


@pytest.mark.parametrize("minutes, message", [("0", "time budget must be above 0"), ("nan", "time budget"),
                                              ("-2", "time budget must be above 0")])
def test_a_bad_recover_budget_is_one_line_before_the_run(tmp_path, capfd, minutes, message):
    from engine.cli import main

    capfd.readouterr()
    assert main(chain_argv(tmp_path / "run", "--recover", minutes)) == 2
    one_error(capfd, message)
    assert not (tmp_path / "run").exists()


def test_recovery_words_name_the_loss_and_what_trained_and_default_to_recovers_own():
    """recovery_words: CE, KL or their mixture, LoRA or every decoder weight; with nothing given, RecoverConfig()'s
    (the label the CLI's chain and the app's panel show before a recovery has its own recover_config.json)."""
    from engine.tools.recover import RecoverConfig, recovery_words

    assert recovery_words(1.0, "lora") == "fine-tuned on the text (CE), LoRA"
    assert recovery_words(0.0, "full") == "distilled from the dense model (KL), all decoder weights"
    assert recovery_words(0.5, "lora") == "distilled from the dense model (KL + 0.5 CE), LoRA"
    defaults = RecoverConfig()
    assert recovery_words() == recovery_words(defaults.ce_weight, defaults.mode)
    assert recovery_words(mode="full") == recovery_words(defaults.ce_weight, "full")
