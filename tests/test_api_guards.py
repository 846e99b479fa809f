"""The Python API's guards (issue 63): `engine.prune(..., out=FOLDER)` refuses what the command line refuses for
--out, through the one check (engine/run/folder.py's check_out_dir), and leaves a refused folder byte for byte as it
was; wrong objects (model, tokenizer, config, out) are one UserError naming the argument, before any work. Each
test failed on the code before the change."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from engine import PruneConfig, prune
from engine.errors import UserError

from conftest import SMALL_CALIB, TINY_MODEL, engine_in_process

CHEAP = dict(init_batches=1, reconstruct_batches=1, batch_size=2, seqlen=32, eval_seqlen=32, max_windows=2,
             layer_init_batches=1, mix_batches=1)  # (the default run, one-shot, on the fewest batches)


@pytest.fixture(scope="module")
def texts():
    from engine.data.text import load_calibration_texts

    return load_calibration_texts(str(SMALL_CALIB))[0][:20]


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` (links as their target's name) by its sha256: what "byte-identical" compares."""
    out = {}
    for p in sorted(folder.rglob("*")):
        key = str(p.relative_to(folder))
        if p.is_symlink():
            out[key] = "link to " + str(p.readlink())
        elif p.is_file():
            out[key] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[key] = "folder"
    return out


def _model_folder(root: Path) -> Path:
    dest = root / "my-model"
    shutil.copytree(TINY_MODEL, dest)
    for p in dest.iterdir():
        p.chmod(0o644)  # (the shared copy is read-only: the run would fail to write, not be refused)
    return dest


def _user_folder(root: Path) -> Path:
    dest = root / "mine"
    (dest / "sub").mkdir(parents=True)
    (dest / "notes.txt").write_text("my notes\n")
    (dest / "sub" / "data.bin").write_bytes(bytes(range(256)))
    return dest


def _link_to_user_folder(root: Path) -> Path:
    link = root / "link"
    link.symlink_to(_user_folder(root), target_is_directory=True)
    return link


def _a_file(root: Path) -> Path:
    path = root / "results.txt"
    path.write_text("a file of the user's\n")
    return path


FOLDERS = {"model folder": (_model_folder, "already holds files and no run (config.json"),
           "user folder": (_user_folder, "already holds files and no run (notes.txt, sub/)"),
           "link to a user folder": (_link_to_user_folder, "already holds files and no run (notes.txt, sub/)"),
           "existing file": (_a_file, "exists and is not a folder")}


@pytest.mark.parametrize("case", list(FOLDERS))
def test_prune_into_a_folder_the_cli_refuses_is_one_user_error_and_the_folder_stays_byte_identical(
        case, tiny, texts, small_eval_file, tmp_path, monkeypatch):
    """A Hugging Face model folder (config.json, model.safetensors, the tokenizer), a non-empty folder of the user's
    (directly or through a link), an existing file: `prune(out=...)` raises one UserError naming `out`, before any
    model work (no PruneRun is made), and every file there is as it was, byte for byte; the command line refuses the
    same --out (before: the API ran and replaced a model folder's config.json, or wrote a whole run among the user's
    files; a file raised FileExistsError)."""
    make, said = FOLDERS[case]
    out = make(tmp_path)
    root = out.parent
    before = tree_digest(root)
    monkeypatch.setattr("engine.run.loop.PruneRun.__init__", lambda *a, **k: pytest.fail("a run was started"))
    config = PruneConfig(**CHEAP, eval_data=str(small_eval_file))
    with pytest.raises(UserError) as e:
        prune(tiny[0], tiny[1], config, calib=texts, out=out)
    assert str(e.value).startswith(f"out {out} ") and said in str(e.value), e.value
    assert tree_digest(root) == before
    monkeypatch.undo()
    ran = engine_in_process("prune", "--model", str(TINY_MODEL), "--out", str(out), "--steps", "1")  # the CLI's --out
    assert ran.returncode == 2 and said in ran.stderr and f"--out {out} " in ran.stderr, ran.stderr
    assert tree_digest(root) == before


def test_prune_with_overwrite_replaces_an_earlier_run_as_the_cli_does(tiny, texts, small_eval_file, tmp_path):
    """An earlier run's folder is refused without overwrite=True (naming it, as --overwrite), and replaced with it;
    a user's own file beside the run stays, as under --overwrite."""
    config = PruneConfig(**CHEAP, eval_data=str(small_eval_file))
    out = tmp_path / "run"
    prune(tiny[0], tiny[1], config, calib=texts, out=out)
    (out / "notes.txt").write_text("mine\n")
    first = (out / "results.json").stat().st_mtime_ns
    with pytest.raises(UserError, match=r"already holds files of another run; use the command line's --resume, "
                                        r"overwrite=True or another out"):
        prune(tiny[0], tiny[1], config, calib=texts, out=out)
    assert (out / "results.json").stat().st_mtime_ns == first
    result = prune(tiny[0], tiny[1], config, calib=texts, out=str(out), overwrite=True)
    assert result.report["status"] == "done" and (out / "results.json").stat().st_mtime_ns != first
    assert (out / "notes.txt").read_text() == "mine\n"
    with pytest.raises(UserError, match=r"^overwrite=True refused: .* holds no run"):
        prune(tiny[0], tiny[1], config, calib=texts, out=_user_folder(tmp_path), overwrite=True)


def test_a_failed_start_leaves_no_folder_behind(tiny, texts, tmp_path):
    """A run that is refused once the folder was made for it (a setting the config refuses) leaves no trace."""
    out = tmp_path / "new" / "run"
    with pytest.raises(UserError, match="seqlen"):
        prune(tiny[0], tiny[1], PruneConfig(**{**CHEAP, "seqlen": 1}), calib=texts, out=out)
    assert not (tmp_path / "new").exists()


# --- wrong objects ------------------------------------------------------------------------------------------------
def _llama_model_without_head():
    from transformers import LlamaConfig, LlamaModel

    return LlamaModel(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))


def _small_vocabulary_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))


WRONG = {  # what is wrong -> (model, tokenizer, config, out) made from the tiny (model, tokenizer), and the message
    "a Linear as the model": (lambda m, t: (torch.nn.Linear(4, 4), t, None, None),
                              "model must be a transformers causal LM (AutoModelForCausalLM.from_pretrained(...), with "
                              "its LM head), got Linear"),
    "a LlamaModel without its LM head": (lambda m, t: (_llama_model_without_head(), t, None, None),
                                         "model must be a transformers causal LM", "got LlamaModel"),
    "no tokenizer": (lambda m, t: (m, None, None, None), "tokenizer must be the model's transformers tokenizer",
                     "got NoneType"),
    "a path as the tokenizer": (lambda m, t: (m, str(TINY_MODEL), None, None), "tokenizer must be", "got str"),
    "a dict as the config": (lambda m, t: (m, t, {"prune_ratio": 0.3}, None), "config must be an engine.PruneConfig",
                             "got dict"),
    "another model's tokenizer": (lambda m, t: (_small_vocabulary_model(), t, None, None),
                                  "tokenizer has 2,048 tokens, more than the 64 rows of the model's input embedding"),
    "a number as out": (lambda m, t: (m, t, None, 12345), "out must be a folder path", "got 12345 (int)"),
    "an empty out": (lambda m, t: (m, t, None, ""), "out must be a folder path", "got ''"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_a_wrong_object_is_one_user_error_naming_the_argument_before_any_work(case, tiny, texts, tmp_path,
                                                                              monkeypatch):
    """Each wrong argument raises one UserError whose message starts with the argument's name and says what it
    got, before a run is made (before: AttributeError, TypeError, pathlib's TypeError or torch's IndexError from
    deep inside the run)."""
    make, *said = WRONG[case]
    model, tokenizer, config, out = make(*tiny)
    monkeypatch.setattr("engine.run.loop.PruneRun.__init__", lambda *a, **k: pytest.fail("a run was started"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        prune(model, tokenizer, config, calib=texts, out=out)
    for part in said:
        assert part in str(e.value), e.value
    assert "\n" not in str(e.value) and list(tmp_path.iterdir()) == []


def test_the_argument_checks_pass_what_a_run_takes(tiny):
    """The checks themselves: the tiny model, its tokenizer, a PruneConfig (None: the default run, README command
    1's) and paths pass; a tokenizer with fewer tokens than the embedding's rows (a padded embedding) passes too."""
    from engine.api import check_config, check_model, check_tokenizer, check_vocabulary, out_path
    from engine.settings.config import default_run

    model, tokenizer = tiny
    check_model(model)
    check_tokenizer(tokenizer)
    check_vocabulary(model, tokenizer)
    assert check_config(None) == default_run() == PruneConfig()
    assert check_config(PruneConfig(method="pg-alloc", steps=3)).steps == 3
    with pytest.raises(UserError, match=r"^config: steps=3 under method 'flap', which takes no steps") as e:
        check_config(PruneConfig(steps=3))  # (the default method is one-shot: steps given to it would go unread)
    assert "\n" not in str(e.value)
    assert out_path(None) is None and out_path("runs/x") == Path("runs/x") == out_path(Path("runs/x"))

    class Short:  # a tokenizer of 10 tokens for the model's 2,048 rows
        def __call__(self, text):
            return {"input_ids": [1]}

        def __len__(self):
            return 10

    check_vocabulary(model, Short())
    for bad in (True, 1.5, ["runs/x"]):
        with pytest.raises(UserError, match="^out must be a folder path"):
            out_path(bad)


def test_perplexity_checks_its_arguments_too(tiny):
    from engine import perplexity

    with pytest.raises(UserError, match="^model must be"):
        perplexity(torch.nn.Linear(2, 2), tiny[1])
    with pytest.raises(UserError, match="^config must be"):
        perplexity(tiny[0], tiny[1], {"eval_seqlen": 32})
