"""`python -m engine prune|eval` end to end, and bad input: one `error:` line, non-zero exit, no traceback."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import main
from engine.settings.config import PruneConfig

from conftest import write_llama_gguf, REPO, SMALL_CALIB, WIKI_RAW, clean_env, engine_in_process, run_engine


@pytest.fixture(scope="module")
def real_processes(tiny_path, tmp_path_factory):
    """`python -m engine prune` on the tiny model in a fresh interpreter, data found automatically; and,
    started alongside to share the wait, one with a model path that does not exist."""
    tmp = tmp_path_factory.mktemp("cli")
    out = tmp / "run"
    missing = subprocess.Popen([sys.executable, "-m", "engine", "prune", "--model", str(tmp / "no-such-model"),
                                "--out", str(tmp / "o1")], cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        proc = run_engine("prune", "--model", str(tiny_path), "--steps", "3", "--max-windows", "4", "--init-batches",
                          "2", "--batch-size", "4", "--out", str(out))
        stdout, stderr = missing.communicate(timeout=300)
    finally:
        missing.kill()
    return dict(out=out, prune=proc, tmp=tmp,
                missing=subprocess.CompletedProcess(missing.args, missing.returncode, stdout, stderr))


@pytest.fixture(scope="module")
def cli_run(real_processes):
    return real_processes["out"], real_processes["prune"]


@pytest.fixture(scope="module")
def gpt2_folder(tiny, tmp_path_factory) -> Path:
    """A complete, loadable GPT-2 model folder: an architecture the engine does not support."""
    from transformers import AutoModelForCausalLM, GPT2Config

    d = tmp_path_factory.mktemp("gpt2") / "model"
    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=2048, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    model.save_pretrained(d)
    tiny[1].save_pretrained(d)
    return d


def assert_one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


# --- end to end --------------------------------------------------------------------------------------
def test_prune_cli_end_to_end(cli_run):
    out, proc = cli_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    results = json.loads((out / "results.json").read_text())
    config = PruneConfig.load(out / "config.json")
    assert config.units == ["layers", "kv_groups", "channels"]  # (no --units, no preset: the default preset, the joint)
    m = re.search(r"dense ([\d.]+) \| init \(layers layerwise-ppl \+ flap\) ([\d.]+) \| pruned ([\d.]+)", proc.stdout)
    assert m, proc.stdout
    assert m.groups() == tuple(f"{results[k]:.2f}" for k in ("ppl_dense", "ppl_init", "ppl_pruned"))
    assert f"{results['params_dense']:,} -> {results['params_pruned']:,}" in proc.stdout
    assert results["steps"] == 3 and results["eval_windows"] == 4
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    assert (out / "model" / "model.safetensors").is_file()


def test_eval_cli_json_matches_run(cli_run, capfd):
    """(The command in this process: the prune run above is the fresh interpreter.)"""
    out, proc = cli_run
    assert proc.returncode == 0
    results = json.loads((out / "results.json").read_text())
    capfd.readouterr()
    ev = engine_in_process("eval", "--model", str(out / "model"), "--json", "--max-windows", "4")
    assert ev.returncode == 0, ev.stderr[-3000:]
    lines = [ln for ln in capfd.readouterr().out.splitlines() if ln.strip()]
    assert len(lines) == 1
    data = json.loads(lines[0])
    assert data["ppl"] == pytest.approx(results["ppl_pruned"], rel=1e-5)
    assert data["eval_windows"] == 4 and data["seqlen"] == 128
    assert data["params"] == results["params_pruned"]


def test_cli_error_in_a_real_process(real_processes):
    """The process itself: non-zero exit status, one `error:` line, no traceback. (Every other bad input
    is checked below through the same main() in this process, which saves a slow interpreter start each.)"""
    missing = real_processes["missing"]
    assert missing.returncode == 2
    assert "no-such-model" in assert_one_error_line(missing.stderr)
    assert missing.stdout == ""
    assert not (real_processes["tmp"] / "o1").exists()


# --- bad input, in process (the same main() that `python -m engine` runs) -------------------------------
def run_main(capfd, argv: list[str]) -> tuple[int, str]:
    capfd.readouterr()
    rc = main([str(a) for a in argv])
    captured = capfd.readouterr()
    return rc, captured.err


def prune_args(tiny_path, out, *extra):
    return ["prune", "--model", tiny_path, "--out", out, "--steps", "1", "--max-windows", "1", "--init-batches", "1",
            "--batch-size", "2", *extra]


def small_eval_text() -> str:
    return WIKI_RAW.read_text(encoding="utf-8")[:6000]


def saved_run(folder: Path, tiny_path: Path, tmp: Path) -> Path:
    """A run folder as a run leaves it after its start: marker, config, empty metrics, a checkpoint."""
    from engine.settings.config import PruneConfig
    from engine.run.folder import write_run_marker

    eval_file = tmp / "eval-small.txt"
    eval_file.write_text(small_eval_text())
    folder.mkdir()
    write_run_marker(folder)
    PruneConfig(model=str(tiny_path), steps=2, max_windows=1, init_batches=1, batch_size=2, seqlen=32, eval_seqlen=32,
                calib=str(SMALL_CALIB), eval_data=str(eval_file)).save(folder / "config.json")
    (folder / "metrics.jsonl").write_text("")
    (folder / "checkpoint.pt").write_bytes(b"")
    return folder


def write_mismatched_gguf(path: Path) -> None:
    """A llama GGUF that declares hidden size 128 but holds 64-wide tensors."""
    import numpy as np

    h = 64
    tensors = {"token_embd.weight": np.zeros((32, h), dtype=np.float32), "output_norm.weight": np.zeros(h, dtype=np.float32)}
    for name, shape in (("attn_q", (h, h)), ("attn_k", (h // 2, h)), ("attn_v", (h // 2, h)), ("attn_output", (h, h)),
                        ("ffn_gate", (384, h)), ("ffn_up", (384, h)), ("ffn_down", (h, 384)), ("attn_norm", (h,)),
                        ("ffn_norm", (h,))):
        tensors[f"blk.0.{name}.weight"] = np.zeros(shape, dtype=np.float32)
    write_llama_gguf(path, 128, tensors, feed_forward_length=384, head_count_kv=4, layer_norm_rms_eps=1e-6,
                     rope_dimension_count=16, vocab_size=32, tokenizer_model="llama",
                     token_list=[f"t{i}" for i in range(32)], token_scores=[0.0] * 32, token_types=[1] * 32)


def make_bad_inputs(tmp: Path, tiny_path: Path, gpt2_folder: Path) -> dict[str, tuple[list, str]]:
    """name -> (argv, a fragment the error line must contain)."""
    empty_dir = tmp / "empty_dir"
    empty_dir.mkdir()
    bad_config = tmp / "bad_config"
    bad_config.mkdir()
    (bad_config / "config.json").write_text("{ not json")
    no_weights = tmp / "no_weights"
    no_weights.mkdir()
    shutil.copy(tiny_path / "config.json", no_weights)
    no_tokenizer = tmp / "no_tokenizer"
    no_tokenizer.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny_path / f, no_tokenizer)
    empty = tmp / "empty.jsonl"
    empty.write_text("")
    blank = tmp / "blank.txt"
    blank.write_text("\n \n")
    binary = tmp / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00\x81garbage\n" * 10)
    not_gzip = tmp / "fake.json.gz"
    not_gzip.write_bytes(b'{"text": "not compressed"}\n')
    no_text_field = tmp / "notext.jsonl"
    no_text_field.write_text('{"content": "hello"}\n')
    short_docs = tmp / "short.jsonl"
    short_docs.write_text('{"text": "Once upon a time."}\n{"text": "The end."}\n')
    calib_dir = tmp / "calib_dir"
    calib_dir.mkdir()
    (calib_dir / "readme.md").write_text("no json here")
    not_a_run = tmp / "not_a_run"
    not_a_run.mkdir()
    (not_a_run / "notes.txt").write_text("mine")
    int_text = tmp / "int_text.jsonl"
    int_text.write_text('{"text": "Once upon a time there was a cat."}\n{"text": 123}\n')
    null_text = tmp / "null_text.jsonl"
    null_text.write_text('{"text": null}\n')
    truncated = tmp / "truncated"
    shutil.copytree(tiny_path, truncated)
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    bad_gguf = tmp / "mismatch.gguf"
    write_mismatched_gguf(bad_gguf)
    read_only = tmp / "read_only"
    read_only.mkdir()
    read_only.chmod(0o555)
    if os.access(read_only, os.W_OK):  # root writes anywhere: a path where even root cannot create a folder
        read_only = Path("/sys/pg-prune-test-out")
    ambiguous = tmp / "wikitext"
    ambiguous.mkdir()
    for split in ("train", "valid"):
        (ambiguous / f"wiki.{split}.raw").write_text(small_eval_text())
    garbage_ckpt = saved_run(tmp / "garbage_ckpt", tiny_path, tmp)
    (garbage_ckpt / "checkpoint.pt").write_bytes(b"\x80\x04 this is not a pickle" * 3)
    string_steps = saved_run(tmp / "string_steps", tiny_path, tmp)
    cfg = json.loads((string_steps / "config.json").read_text())
    (string_steps / "config.json").write_text(json.dumps({**cfg, "steps": "2"}))
    bad_json = tmp / "run_config.json"
    bad_json.write_text('{"steps": 3, "prune_ratio": ')
    unknown_field = tmp / "unknown.json"
    unknown_field.write_text(json.dumps({"steps": 3, "learning_rate": 0.1}))
    out = tmp / "out"
    small = ["--calib", SMALL_CALIB]
    return {
        "missing model": (prune_args(tmp / "nope", out), "nope"),
        "folder without config.json": (prune_args(empty_dir, out), "config.json"),
        "unreadable config.json": (prune_args(bad_config, out), "bad_config"),
        "config without weights": (prune_args(no_weights, out), "no_weights"),
        "model without tokenizer": (prune_args(no_tokenizer, out), "tokenizer"),
        "missing gguf": (prune_args(tmp / "m.gguf", out), "m.gguf"),
        "unsupported architecture": (prune_args(gpt2_folder, out), "gpt2"),
        "prune ratio 0": (prune_args(tiny_path, out, "--prune-ratio", "0"), "prune ratio"),
        "prune ratio 1": (prune_args(tiny_path, out, "--prune-ratio", "1"), "prune ratio"),
        "prune ratio 1.5": (prune_args(tiny_path, out, "--prune-ratio", "1.5"), "prune ratio"),
        "unknown unit": (prune_args(tiny_path, out, "--units", "heads,neurons"), "units"),
        "zero steps": (prune_args(tiny_path, out, "--steps", "0"), "steps"),
        "seqlen beyond positions": (prune_args(tiny_path, out, "--seqlen", "600"), "512"),
        "prune eval seqlen beyond positions": (prune_args(tiny_path, out, "--eval-seqlen", "513"), "512"),
        "calib empty file": (prune_args(tiny_path, out, "--calib", empty), "empty.jsonl"),
        "calib missing file": (prune_args(tiny_path, out, "--calib", tmp / "gone.jsonl"), "gone.jsonl"),
        "calib binary file": (prune_args(tiny_path, out, "--calib", binary), "binary.jsonl"),
        "calib not gzip": (prune_args(tiny_path, out, "--calib", not_gzip), "fake.json.gz"),
        "calib without text field": (prune_args(tiny_path, out, "--calib", no_text_field), "text"),
        "calib folder without json": (prune_args(tiny_path, out, "--calib", calib_dir), "calib_dir"),
        "calib longer than every document": (prune_args(tiny_path, out, "--calib", short_docs), "seqlen"),
        "validation without enough documents": (prune_args(tiny_path, out, "--val-every", "1", "--calib", short_docs,
                                                           "--seqlen", "2"),
                                                "10 calibration documents"),
        "best-val without validation": (prune_args(tiny_path, out, "--val-every", "0", "--final-mask", "best-val"), "val"),
        "eval data empty file": (prune_args(tiny_path, out, "--eval-data", blank, *small), "empty"),
        "eval data missing": (prune_args(tiny_path, out, "--eval-data", tmp / "gone.txt", *small), "gone.txt"),
        "eval data too short": (prune_args(tiny_path, out, "--eval-data", no_text_field, *small), "window"),
        "resume without a run": (prune_args(tiny_path, empty_dir, "--resume"), "config.json"),
        "resume in a missing folder": (prune_args(tiny_path, tmp / "never", "--resume"), "never"),
        "resume in a folder of other files": (prune_args(tiny_path, not_a_run, "--resume"), "no run"),
        "overwrite a folder that is not a run": (prune_args(tiny_path, not_a_run, "--overwrite"), "not_a_run"),
        "out is a file": (prune_args(tiny_path, empty), "not a folder"),
        "no cuda": (prune_args(tiny_path, out, "--device", "cuda"), "cuda"),
        "eval missing model": (["eval", "--model", tmp / "nope"], "nope"),
        "eval empty data": (["eval", "--model", tiny_path, "--eval-data", blank], "empty"),
        "eval seqlen beyond positions": (["eval", "--model", tiny_path, "--eval-seqlen", "1000"], "512"),
        "eval negative windows": (["eval", "--model", tiny_path, "--max-windows", "-1"], "max windows must be 0 (all) or more"),
        "prune negative windows": (prune_args(tiny_path, out, "--max-windows", "-1"), "max windows"),
        # issue 15
        "calib text is a number": (prune_args(tiny_path, out, "--calib", int_text), "int_text.jsonl line 2"),
        "calib text is null": (prune_args(tiny_path, out, "--calib", null_text), "must be a string, got null"),
        "truncated model.safetensors": (prune_args(truncated, out), "could not load model"),
        "gguf tensors do not match": (prune_args(bad_gguf, out), "do not match its declared architecture"),
        "eval gguf tensors do not match": (["eval", "--model", bad_gguf], "do not match"),
        "out under a file": (prune_args(tiny_path, empty / "sub"), "cannot create --out"),
        "out not writable": (prune_args(tiny_path, read_only / "run"), "--out"),
        "resume with a garbage checkpoint": (prune_args(tiny_path, garbage_ckpt, "--resume"), "checkpoint"),
        "resume with steps a string": (prune_args(tiny_path, string_steps, "--resume"), "steps must be an integer"),
        "seed beyond 64 bits": (prune_args(tiny_path, out, "--seed", "99999999999999999999"), "seed"),
        "seed negative": (prune_args(tiny_path, out, "--seed", "-1"), "seed"),
        "lr nan": (prune_args(tiny_path, out, "--lr", "nan"), "lr must be a finite number"),
        "lr inf": (prune_args(tiny_path, out, "--lr", "inf"), "lr must be a finite number"),
        "prune ratio nan": (prune_args(tiny_path, out, "--prune-ratio", "nan"), "prune ratio"),
        "seqlen 1": (prune_args(tiny_path, out, "--seqlen", "1"), "seqlen must be at least 2"),
        "prune eval seqlen 1": (prune_args(tiny_path, out, "--eval-seqlen", "1"), "eval seqlen must be at least 2"),
        "eval seqlen 1": (["eval", "--model", tiny_path, "--eval-seqlen", "1"], "eval seqlen must be at least 2"),
        "eval folder with two splits": (["eval", "--model", tiny_path, "--eval-data", ambiguous],
                                        "wiki.train.raw, wiki.valid.raw"),
        "finetune lr nan": (["finetune", "--model", tiny_path, "--out", out, "--lr", "nan"], "lr must be a finite"),
        "finetune seqlen 1": (["finetune", "--model", tiny_path, "--out", out, "--seqlen", "1"], "at least 2"),
        # issue 12
        "antithetic pairs with an odd N_s": (prune_args(tiny_path, out, "--method", "pg", "--mask-sampling",
                                                        "antithetic", "--num-mask-samples", "3"), "must be even"),
        # issue 16
        "config file missing": (prune_args(tiny_path, out, "--config", tmp / "gone.json"), "gone.json"),
        "config file not json": (prune_args(tiny_path, out, "--config", bad_json), "run_config.json"),
        "config file with an unknown field": (prune_args(tiny_path, out, "--config", unknown_field), "learning_rate"),
        "method option of another method": (prune_args(tiny_path, out, "--gumbel-temperature", "2"),
                                            "--gumbel-temperature applies to --method gumbel"),
        "bad method option": (prune_args(tiny_path, out, "--method", "gumbel", "--gumbel-final-temperature", "5"),
                              "gumbel temperatures"),
        # issue 14
        "unit multiple not a number": (prune_args(tiny_path, out, "--unit-multiple", "channels=x"), "UNIT=N"),
        "unit multiple of whole layers": (prune_args(tiny_path, out, "--units", "heads,layers", "--unit-multiple",
                                                     "layers=2"), "not 'layers'"),
        "unit multiple of an unpruned type": (prune_args(tiny_path, out, "--units", "kv_groups", "--unit-multiple",
                                                         "channels=8"), "not 'channels'"),
        "unit multiple 0": (prune_args(tiny_path, out, "--unit-multiple", "channels=0"), "at least 1"),
    }


BAD_INPUT_NAMES = [
    "missing model", "folder without config.json", "unreadable config.json", "config without weights",
    "model without tokenizer", "missing gguf", "unsupported architecture", "prune ratio 0", "prune ratio 1",
    "prune ratio 1.5", "unknown unit", "zero steps", "seqlen beyond positions", "prune eval seqlen beyond positions",
    "calib empty file", "calib missing file", "calib binary file", "calib not gzip", "calib without text field",
    "calib folder without json", "calib longer than every document", "validation without enough documents",
    "best-val without validation", "eval data empty file", "eval data missing",
    "eval data too short", "resume without a run", "resume in a missing folder", "resume in a folder of other files",
    "overwrite a folder that is not a run", "out is a file", "no cuda", "eval missing model", "eval empty data",
    "eval seqlen beyond positions", "eval negative windows", "prune negative windows",
    "calib text is a number", "calib text is null", "truncated model.safetensors", "gguf tensors do not match",
    "eval gguf tensors do not match", "out under a file", "out not writable", "resume with a garbage checkpoint",
    "resume with steps a string", "seed beyond 64 bits", "seed negative", "lr nan", "lr inf", "prune ratio nan",
    "seqlen 1", "prune eval seqlen 1", "eval seqlen 1", "eval folder with two splits", "finetune lr nan",
    "finetune seqlen 1", "antithetic pairs with an odd N_s",
    "config file missing", "config file not json", "config file with an unknown field", "method option of another method",
    "bad method option",
    "unit multiple not a number", "unit multiple of whole layers", "unit multiple of an unpruned type", "unit multiple 0",
]


@pytest.mark.parametrize("name", BAD_INPUT_NAMES)
def test_bad_input_is_one_error_line(name, tmp_path, tiny_path, gpt2_folder, capfd):
    cases = make_bad_inputs(tmp_path, tiny_path, gpt2_folder)
    assert sorted(cases) == sorted(BAD_INPUT_NAMES)
    argv, fragment = cases[name]
    rc, err = run_main(capfd, argv)
    assert rc == 2
    line = assert_one_error_line(err)
    assert fragment in line, line
    out = tmp_path / "out"
    assert not out.exists() or not any(out.iterdir())  # nothing half-made was left behind
    assert (tmp_path / "not_a_run" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "empty.jsonl" / "sub").exists() and (tmp_path / "empty.jsonl").read_text() == ""
    if (tmp_path / "read_only").exists():
        (tmp_path / "read_only").chmod(0o755)  # so that pytest can clean it up
        assert not any((tmp_path / "read_only").iterdir())


def test_unit_multiple_rounds_every_layer_of_the_export(tiny_path, tmp_path, capfd):
    out = tmp_path / "run"
    rc, err = run_main(capfd, ["prune", "--model", str(tiny_path), "--steps", "2", "--max-windows", "2", "--init-batches",
                               "1", "--batch-size", "2", "--calib", str(SMALL_CALIB), "--eval-data", str(WIKI_RAW),
                               "--unit-multiple", "channels=16", "--out", str(out)])
    assert rc == 0, err
    config = json.loads((out / "model" / "config.json").read_text())
    widths = config["intermediate_size_per_layer"]
    assert all(w % 16 == 0 and w > 0 for w in widths), widths
    assert json.loads((out / "config.json").read_text())["unit_multiple"] == {"channels": 16}


def test_config_file_starts_a_run_and_flags_override_it(tmp_path):
    from engine.cli import parse_args
    from engine.settings.config import PruneConfig

    saved = PruneConfig(model="m", units=["kv_groups", "layers"], steps=7, lr=0.05, method="gumbel", seed=4,
                        method_options={"temperature": 2.0, "straight_through": True})
    saved.save(tmp_path / "run.json")
    args = parse_args(["prune", "--config", str(tmp_path / "run.json"), "--preset", "paper", "--steps", "9", "--out", "x"])
    assert (args.model, args.units, args.steps, args.seed) == ("m", ["kv_groups", "layers"], 9, 4)  # the flag beats the file
    assert args.lr == 0.05 and args.num_mask_samples == PruneConfig().num_mask_samples  # the file beats the preset
    # the saved options, written out whole
    assert (args.gumbel_temperature, args.gumbel_straight_through, args.gumbel_final_temperature) == (2.0, True, 0.1)


def test_joint_preset_sets_the_joint_and_a_flag_still_overrides_it():
    from engine.cli import _config_from_args, parse_args
    from engine.settings.config import PRESETS, PruneConfig

    config = _config_from_args(parse_args(["prune", "--preset", "joint", "--time-budget", "10", "--out", "x"])).resolved()
    for field, value in PRESETS["joint"].items():
        assert getattr(config, field) == value, field
    assert config.fixed_layers and config.time_budget == 10.0 and config.lr == PruneConfig().lr
    narrowed = _config_from_args(parse_args(["prune", "--preset", "joint", "--units", "heads,layers", "--init-batches",
                                             "4", "--out", "x"])).validate()
    assert (narrowed.units, narrowed.init_batches, narrowed.layer_init) == (["kv_groups", "layers"], 4, "layerwise-ppl")


def test_a_run_that_names_no_preset_starts_from_the_joint_where_the_joint_applies():
    from engine.cli import _config_from_args, parse_args
    from engine.settings.config import DEFAULT_PRESET, FAST, PRESETS, default_preset

    def config(*flags):
        args = parse_args(["prune", *flags, "--out", "x"])
        return args.default_preset, _config_from_args(args).resolved()

    name, plain = config("--prune-ratio", "0.3", "--time-budget", "10")
    assert name == DEFAULT_PRESET == "joint"
    for field, value in PRESETS["joint"].items():  # (but its steps: the default takes none, STEP_VERDICTS)
        assert getattr(plain, field) == (value if field != "method" else "flap"), field
    assert config("--prune-ratio", "0.3", "--steps", "24")[1].method == PRESETS["joint"]["method"]
    assert plain.fixed_layers and plain.lr == PruneConfig().lr and plain.time_budget == 10.0
    assert config("--init-batches", "4", "--method", "flap")[1].init_batches == 4  # a flag given still overrides it
    fast = PruneConfig(**FAST)  # where the joint does not apply: the fast preset, in every spelling of the flag
    for flags, units, name_ in ((["--units", "heads,channels"], ["kv_groups", "channels"], "fast"),
                                (["--units=layers"], ["layers"], "fast"), (["--scope", "uniform"], fast.units, "fast"),
                                (["--budget", "units"], fast.units, "fast"), (["--preset", "fast"], fast.units, None)):
        name, c = config(*flags)
        assert name == name_, flags
        assert (c.units, c.method, c.layer_init, c.layer_score_const, c.init_batches, c.reward, c.step_refit,
                c.calib_source) == (units, "pg", "sleb", None, 64, "ce", False, "data"), flags
        assert c.method_options["baseline"] == "leave-one-out", flags  # (the preset's options, under its method)
    assert config("--units", "kv_groups", "--method", "flap")[1].method == "flap"  # a method given beats the preset's
    assert [default_preset(*a) for a in [(False, "global", "params"), (True, "global", "params"),
                                         (False, "uniform", "params"), (False, "global", "units")]] == [
        "joint", "fast", "fast", "fast"]


def test_a_config_file_or_a_resume_is_not_moved_onto_the_default_preset(tmp_path):
    """A --config file is read as written, and a setting it lacks is the fast preset's (what a config saved before
    the settings' defaults became the default run's meant by it), never the default preset's."""
    import json

    from engine.cli import parse_args
    from engine.settings.config import FAST

    PruneConfig(**{**FAST, "model": "m", "steps": 7, "init_batches": 8}).save(tmp_path / "run.json")
    args = parse_args(["prune", "--config", str(tmp_path / "run.json"), "--out", "x"])
    assert args.default_preset is None and (args.units, args.init_batches, args.method) == (FAST["units"], 8, "pg")
    (tmp_path / "part.json").write_text(json.dumps({"model": "m", "steps": 7}))
    args = parse_args(["prune", "--config", str(tmp_path / "part.json"), "--out", "x"])
    assert args.default_preset is None and all(getattr(args, k) == v for k, v in FAST.items())


# --- an existing run in --out ------------------------------------------------------------------------
@pytest.fixture
def run_copy(cli_run, tmp_path) -> Path:
    out, proc = cli_run
    assert proc.returncode == 0
    dest = tmp_path / "run"
    shutil.copytree(out, dest)
    return dest


def test_out_holding_a_run_needs_resume_or_overwrite(run_copy, tiny_path, capfd):
    before = sorted(p.name for p in run_copy.iterdir())
    rc, err = run_main(capfd, prune_args(tiny_path, run_copy))
    assert rc == 2
    assert "--resume" in assert_one_error_line(err)
    assert sorted(p.name for p in run_copy.iterdir()) == before


def test_overwrite_with_bad_arguments_keeps_the_old_run(run_copy, tiny_path, capfd):
    results = (run_copy / "results.json").read_text()
    for extra in (["--prune-ratio", "1.5"], ["--seqlen", "600"], ["--calib", str(run_copy / "missing.jsonl")]):
        rc, err = run_main(capfd, prune_args(tiny_path, run_copy, "--overwrite", *extra))
        assert rc == 2
        assert_one_error_line(err)
        assert (run_copy / "results.json").read_text() == results


def test_overwrite_replaces_the_run(run_copy, tiny_path, capfd, small_eval_file):
    old = json.loads((run_copy / "results.json").read_text())
    assert old["steps"] == 3
    rc, err = run_main(capfd, prune_args(tiny_path, run_copy, "--overwrite", "--steps", "2", "--calib", SMALL_CALIB,
                                         "--eval-data", small_eval_file))
    assert rc == 0, err
    assert "Traceback" not in err
    new = json.loads((run_copy / "results.json").read_text())
    assert new["steps"] == 2 and new["eval_windows"] == 1
    assert new["calib_data"] == str(SMALL_CALIB)
    assert len((run_copy / "metrics.jsonl").read_text().splitlines()) == 2
    assert json.loads((run_copy / "config.json").read_text())["steps"] == 2


def test_the_summary_names_the_metrics_the_init_came_from():
    from engine.cli import _init_label

    assert _init_label(PruneConfig(units=["kv_groups", "channels"], init="taylor")) == "taylor"
    assert _init_label(PruneConfig(units=["layers"], layer_init="sleb")) == "layers sleb"  # not the widths' metric
    assert _init_label(PruneConfig(units=["layers", "channels"], layer_init="layerwise-ppl")) == "layers layerwise-ppl + flap"


def test_the_installed_command_names_itself_in_help_and_errors(monkeypatch):
    """`pg-prune` (pyproject's script) says `pg-prune` in its usage and its error lines; `python -m engine` says that."""
    from engine.cli import build_parser

    monkeypatch.setattr(sys, "argv", ["/venv/bin/pg-prune", "prune"])
    assert build_parser().prog == "pg-prune"
    monkeypatch.setattr(sys, "argv", ["/repo/engine/__main__.py", "prune"])
    assert build_parser().prog == "python -m engine"


@pytest.mark.parametrize("argv, method", [
    (["--prune-ratio", "0.3"], "flap"),  # the default preset: the init alone, at every rate
    (["--prune-ratio", "0.5"], "flap"),
    (["--prune-ratio", "0.6"], "flap"),
    (["--prune-ratio", "0.3", "--steps", "8"], "pg-alloc"),  # steps asked for: bought
    (["--prune-ratio", "0.5", "--method", "pg-alloc"], "pg-alloc"),
    (["--prune-ratio", "0.5", "--units", "heads,channels"], "pg"),  # no default preset: the settings' own method
])
def test_the_default_preset_takes_no_steps_unless_asked(argv, method, tmp_path):
    """Issue 64's rule (docs/results.md): no rate passed it on the confirmation set, so the default run exports its
    one-shot init; --steps or --method buy the steps."""
    from engine.cli import parse_args

    args = parse_args(["prune", *argv, "--out", str(tmp_path / "r")])
    assert args.method == method and args.no_steps == (method == "flap")


def test_the_no_steps_line_gives_the_verdict_of_the_nearest_rate_measured_below():
    from engine.settings.config import STEP_VERDICTS, no_steps_line, step_verdict

    assert step_verdict(0.3) == step_verdict(0.45) == STEP_VERDICTS[0.3]
    assert step_verdict(0.5) == step_verdict(0.7) == STEP_VERDICTS[0.5]
    assert step_verdict(0.1) == STEP_VERDICTS[min(STEP_VERDICTS)]  # below every measured rate: the lowest's
    assert "4.6 %" in no_steps_line(0.4) and "5.0 % worse" in no_steps_line(0.5)
    assert "--steps N or --method pg-alloc" in no_steps_line(0.3)


def test_readme_command_1s_run_is_the_joint_preset_without_steps_from_python():
    """docs/api.md and README's Python line: `default_run(prune_ratio=0.3)` (= `PruneConfig(prune_ratio=0.3)` =
    `PruneConfig(**{**PRESETS["joint"], "method": "flap"})`) is the run `prune --prune-ratio 0.3` makes (the default
    preset, no steps: STEP_VERDICTS), field for field, and what engine.prune runs with no config; `PruneConfig()` is
    `prune --out x`'s."""
    import engine
    from engine.api import check_config
    from engine.cli import _config_from_args, parse_args
    from engine.settings.config import PRESETS

    cli = _config_from_args(parse_args(["prune", "--prune-ratio", "0.3", "--out", "x"])).resolved().to_dict()
    assert engine.default_run(prune_ratio=0.3).resolved().to_dict() == cli
    assert PruneConfig(**{**PRESETS["joint"], "method": "flap"}).resolved().to_dict() == cli
    assert PruneConfig(prune_ratio=0.3).resolved().to_dict() == cli
    assert check_config(None).resolved().to_dict() == cli
    bare = _config_from_args(parse_args(["prune", "--out", "x"])).resolved()
    assert PruneConfig().resolved() == bare and PruneConfig() == _config_from_args(parse_args(["prune", "--out", "x"]))
    assert "PruneConfig(prune_ratio=0.3)" in (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_a_default_run_that_buys_steps_is_told_what_they_bought(eval_file, tmp_path, capfd):
    """--steps on the default preset: the log says before the steps what 24 of them did on the confirmation set at
    the nearest rate measured (STEP_VERDICTS), as the no-steps line says why none are taken."""
    from conftest import SMALL_CALIB, TINY_MODEL
    from engine.settings.config import step_verdict

    flags = ["--model", str(TINY_MODEL), "--batch-size", "2", "--seqlen", "32", "--eval-seqlen", "32",
             "--max-windows", "2", "--init-batches", "1", "--num-mask-samples", "2", "--calib", str(SMALL_CALIB),
             "--eval-data", str(eval_file), "--reconstruct-batches", "2"]
    capfd.readouterr()
    assert main(["prune", *flags, "--steps", "1", "--out", str(tmp_path / "r")]) == 0
    said = capfd.readouterr()
    lines = [ln for ln in (said.out + said.err).splitlines() if ln.startswith("steps: 1, bought")]
    assert len(lines) == 1 and step_verdict(0.3) in lines[0], lines
    assert main(["prune", *flags, "--out", str(tmp_path / "n")]) == 0  # (no steps: the other line, not this one)
    said = capfd.readouterr()
    assert "bought with --steps" not in said.out + said.err and "no steps at --prune-ratio 0.3" in said.out + said.err
