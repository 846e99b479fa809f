"""Exports check what they write, and a full disk is one line (issue 48, items 6 and 8's full disk): the hf copy's
weights must match its config (a copy transformers would refuse, or comp_means with random weights, is never called
written); the space a write needs is checked before it starts; what a killed export left is cleaned by the next
write to the same path, whichever exporter wrote it; a full disk while appending metrics.jsonl is one line.
Each test failed on the code before its change."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from engine.cli import main
from engine.errors import UserError
from engine.run.loop import PruneRun

from conftest import SMALL_CALIB, TINY_MODEL, one_error, quiet, tiny_config


def leftovers(folder: Path, name: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(f".{name}."))


def dead_pid() -> int:
    """The id of a process that has ended."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# --- the hf copy's weights match its config -------------------------------------------------------------------
def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    for key, fn in changes.items():
        config[key] = fn(config[key])
    (folder / "config.json").write_text(json.dumps(config, indent=2))


@pytest.mark.parametrize("edit, said", [
    ("widths", "shape"),  # another pruning's MLP widths
    ("more layers", "lacks"),  # transformers would comp_means the missing layer with random weights
    ("fewer layers", "holds"),  # ... and drop a layer's weights without a word
])
def test_export_hf_refuses_weights_that_do_not_match_the_config(edit, said, finished, tmp_path, capfd):
    config_file = finished / "model" / "config.json"
    config = json.loads(config_file.read_text())
    per_layer = ("intermediate_size_per_layer", "kv_heads_per_layer")
    if edit == "widths":
        config["intermediate_size_per_layer"][0] += 6
    elif edit == "more layers":  # (the per-layer lists follow the layer count: only the weights disagree)
        config["num_hidden_layers"] += 1
        for k in per_layer:
            config[k].append(config[k][-1])
    else:
        config["num_hidden_layers"] -= 1
        for k in per_layer:
            config[k].pop()
    config_file.write_text(json.dumps(config, indent=2))
    dest = tmp_path / "copy"
    capfd.readouterr()
    assert main(["export", str(finished), "--format", "hf", "--out", str(dest)]) == 2
    one_error(capfd, "would not load", "model.safetensors", said, "nothing was written")
    assert not dest.exists() and leftovers(tmp_path, "copy") == []


def test_export_hf_checks_the_copys_shapes_before_it_says_wrote(finished, tmp_path, monkeypatch, capfd):
    """A copy whose headers parse and cover their files but whose tensors are another model's is not written."""
    from safetensors.torch import load_file, save_file

    from engine.export import hf

    real = shutil.copytree

    def wrong_copy(src, dst, **kw):
        real(src, dst, **kw)
        w = Path(dst) / "model.safetensors"
        tensors = load_file(str(w))
        name = next(k for k in tensors if k.endswith("mlp.down_proj.weight"))
        tensors[name] = tensors[name][:, :-1].contiguous()
        save_file(tensors, str(w), metadata={"format": "pt"})

    monkeypatch.setattr(hf.shutil, "copytree", wrong_copy)
    dest = tmp_path / "copy"
    capfd.readouterr()
    assert main(["export", str(finished), "--format", "hf", "--out", str(dest)]) == 2
    one_error(capfd, "the copy of", "does not load", "shape", "nothing was written")
    assert not dest.exists() and leftovers(tmp_path, "copy") == []


def test_the_model_folder_check_passes_a_good_export_and_a_plain_model(finished):
    from engine.export.checks import model_folder_problem

    assert model_folder_problem(finished / "model") is None
    assert model_folder_problem(TINY_MODEL) is None  # (a plain llama folder with tied embeddings)


# --- the space a write needs is checked before it starts ------------------------------------------------------
Usage = namedtuple("Usage", "total used free")


def little_free(monkeypatch, free: int = 1000):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 ** 12, 10 ** 12 - free, free))


def test_export_hf_with_too_little_space_is_refused_before_anything_is_written(finished, tmp_path, monkeypatch,
                                                                              capfd):
    from engine.export import hf

    copies = []
    monkeypatch.setattr(hf.shutil, "copytree", lambda *a, **kw: copies.append(a))
    little_free(monkeypatch)
    dest = tmp_path / "copy"
    capfd.readouterr()
    assert main(["export", str(finished), "--format", "hf", "--out", str(dest)]) == 2
    line = one_error(capfd, f"no space left on the device of {tmp_path} while writing copy/", "needs about",
                     "1000 bytes free")
    need = sum(f.stat().st_size for f in (finished / "model").rglob("*") if f.is_file())
    assert f"{need / 2 ** 20:.1f} MiB" in line, (need, line)
    assert copies == [] and not dest.exists() and leftovers(tmp_path, "copy") == []


def test_export_gguf_with_too_little_space_is_refused_before_anything_is_written(finished, tmp_path, monkeypatch,
                                                                                capfd):
    pytest.importorskip("gguf")
    import gguf

    opened = []
    monkeypatch.setattr(gguf.GGUFWriter, "write_header_to_file", lambda self, *a, **kw: opened.append(1))
    little_free(monkeypatch)
    dest = tmp_path / "out.gguf"
    capfd.readouterr()
    assert main(["export", str(finished), "--format", "gguf", "--out", str(dest)]) == 2
    one_error(capfd, f"no space left on the device of {tmp_path} while writing out.gguf", "needs about",
              "1000 bytes free")
    assert opened == [] and not dest.exists() and leftovers(tmp_path, "out.gguf") == []


def _model_bytes(finished: Path) -> int:
    return sum(f.stat().st_size for f in (finished / "model").rglob("*") if f.is_file())


def test_prune_with_too_little_space_for_the_model_is_refused_before_it_is_written(finished, tiny, eval_file,
                                                                                  tmp_path, monkeypatch):
    """Room for the checkpoint and the masks, not for model/: the run ends in one line before model/ is written."""
    from transformers import PreTrainedModel

    from engine.storage import io

    saved = []
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", lambda *a, **kw: saved.append(a))
    real, out = io.free_space, tmp_path / "run2"
    monkeypatch.setattr(io, "free_space", lambda folder: 100_000 if folder == out else real(folder))
    with pytest.raises(UserError, match=rf"no space left on the device of {out} while writing model/ \(nothing was "
                                        r"written\): it needs about [\d.]+ MiB, 97\.7 KiB free"):
        PruneRun(tiny_config(eval_file), out, model=tiny[0], tokenizer=tiny[1], log=quiet).run(progress=False)
    assert saved == [] and not (out / "model").exists() and leftovers(out, "model") == []
    assert (out / "masks.safetensors").is_file()


def test_the_sliced_models_space_is_not_overestimated(finished, tiny, eval_file, tmp_path, monkeypatch):
    """The space model/ needs counts a tied embedding once (save_pretrained writes it once): a folder with room
    for the model is not refused."""
    from engine.storage import io

    real, out, room = io.free_space, tmp_path / "run2", _model_bytes(finished) + 4096
    monkeypatch.setattr(io, "free_space", lambda folder: room if folder == out else real(folder))
    PruneRun(tiny_config(eval_file), out, model=tiny[0], tokenizer=tiny[1], log=quiet).run(progress=False)
    assert _model_bytes(out) == _model_bytes(finished)


def test_atomic_writes_check_the_space_before_they_start(tmp_path, monkeypatch):
    from engine.storage.io import atomic_dir, atomic_file

    little_free(monkeypatch, 10)
    ran = []
    for writer, name in ((atomic_file, "f.bin"), (atomic_dir, "d")):
        with pytest.raises(UserError, match=rf"device of {tmp_path} while writing {name}/? \(nothing was written\): "
                                            r"it needs about 1\.0 KiB, 10 bytes free"):
            with writer(tmp_path / name, 1024):
                ran.append(name)
    assert ran == [] and sorted(p.name for p in tmp_path.iterdir()) == []
    with atomic_file(tmp_path / "small.bin", 5) as tmp:  # what fits is written
        tmp.write_bytes(b"12345")
    assert (tmp_path / "small.bin").read_bytes() == b"12345"


# --- a killed export's temporary file is cleaned by the next write, whichever exporter ---------------------------
def test_a_killed_gguf_writes_temporary_file_is_cleaned_by_the_next_write(tmp_path):
    """write_model_gguf (the dense model's GGUF beside the runs, measure's GGUFs) leaves .NAME.pidPID.*.tmp when
    killed; the next write to that path removes it (a live process's stays)."""
    pytest.importorskip("gguf")
    from engine.export.gguf import write_model_gguf

    dest = tmp_path / "dense.f16.gguf"
    stale = tmp_path / f".dense.f16.gguf.pid{dead_pid()}.k2j4x.tmp"
    live = tmp_path / ".dense.f16.gguf.pid1.abcd.tmp"  # (pid 1 is alive)
    stale.write_bytes(b"GGUF" + b"\0" * 100)
    live.write_bytes(b"GGUF")
    write_model_gguf(str(TINY_MODEL), dest, "f16")
    assert dest.is_file() and not stale.exists() and live.exists()


def test_a_killed_app_gguf_exports_temporary_file_is_cleaned_by_the_next_export(finished):
    """The app's GGUF of a run (deploy.ensure_run_gguf) writes through a temporary file of its own: what a killed
    export left of it is removed by the next one."""
    pytest.importorskip("gguf")
    from engine.ui.deploy import ensure_run_gguf

    pid = dead_pid()
    stale = [finished / f".model.q8_0.gguf.pid{pid}.export.tmp",
             finished / f"..model.q8_0.gguf.pid{pid}.export.tmp.pid{pid}.x1y2.tmp"]
    for p in stale:
        p.write_bytes(b"GGUF")
    path = ensure_run_gguf(finished, "q8_0")
    assert path.is_file() and [p for p in stale if p.exists()] == []
    assert [p.name for p in finished.iterdir() if p.name.endswith(".tmp")] == []


# --- a full disk while appending metrics.jsonl ----------------------------------------------------------------
def test_a_full_disk_while_appending_metrics_is_one_line(eval_file, tmp_path, monkeypatch, capfd):
    """metrics.jsonl is appended step by step: a full disk there was three chained ENOSPC tracebacks."""
    import engine.run.loop as pruner

    real_open = open

    class FullFile:
        def __init__(self, f):
            self.f = f

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    def fake_open(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        return FullFile(f) if str(path).endswith("metrics.jsonl") and "a" in mode else f

    monkeypatch.setattr(pruner, "open", fake_open, raising=False)
    out = tmp_path / "run"
    flags = ["--model", str(TINY_MODEL), "--steps", "3", "--batch-size", "2", "--seqlen", "32", "--eval-seqlen", "32",
             "--max-windows", "2", "--init-batches", "1", "--num-mask-samples", "2", "--calib", str(SMALL_CALIB),
             "--eval-data", str(eval_file), "--out", str(out)]
    capfd.readouterr()
    assert main(["prune", *flags]) == 2
    one_error(capfd, f"no space left on the device of {out} while writing metrics.jsonl")
