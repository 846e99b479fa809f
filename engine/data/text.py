"""Calibration text (C4 JSON lines) and evaluation text (WikiText-2 raw test), found offline.

Where the data come from when no path is given: the folder named by $PG_PRUNE_DATA_DIR, else a
`shared/data` folder beside the repository (../shared/data from its root), else the hub
(allenai/c4, wikitext) for users who have it and the `datasets` package.
"""

from __future__ import annotations

import copy

import gzip
import json
import os
import sys
import zlib
from pathlib import Path

import torch

from ..errors import UserError

DATA_DIR_ENV = "PG_PRUNE_DATA_DIR"
_REPO_ROOT = Path(__file__).resolve().parents[2]
_CALIB_SUBDIR = "c4"
_EVAL_SUBDIR = "wikitext-2-raw-v1"
_TEXT_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
# the default data folder's C4 documents that the results' held-out C4 perplexity reads (docs/results.md, "Two
# sets"): the default calibration leaves them out, so that no default run calibrates on its own judge (a --calib
# that names the file, or a folder given by the user, still reads it)
HELDOUT_C4_FILES = ("c4-en.llamafactory-c4_demo.300.text-only.json.gz",)


def default_data_dir() -> Path | None:
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        if not Path(env).is_dir():
            raise UserError(f"${DATA_DIR_ENV} points to {env}, which is not a folder")
        return Path(env)
    for candidate in (_REPO_ROOT.parent / "shared" / "data", _REPO_ROOT / "shared" / "data"):
        if candidate.is_dir():
            return candidate
    return None


def _files_in(path: Path, suffixes: tuple[str, ...]) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(suffixes))
    raise UserError(f"data path not found: {path}")


def _open_text(path: Path):
    """UTF-8 text; a byte-order mark at the start (as Windows editors write it) is skipped (utf-8-sig)."""
    return gzip.open(path, "rt", encoding="utf-8-sig") if path.name.endswith(".gz") else open(path, encoding="utf-8-sig")


def _read_failure(path: Path, e: BaseException) -> str:
    """Why a file could not be read, for one error line: a gzip file's corrupt or cut-short data, or the OS's reason."""
    if path.name.endswith(".gz") and isinstance(e, (EOFError, zlib.error, gzip.BadGzipFile)):
        detail = " ".join(str(e).split()) or type(e).__name__
        return f"corrupt or truncated gzip data ({detail}); download or write the file again"
    return f"cannot be read ({e.strerror or e})" if isinstance(e, OSError) else f"cannot be read ({type(e).__name__})"


# --- calibration ------------------------------------------------------------------------------
def load_calibration_texts(path: str | None = None) -> tuple[list[str], str]:
    """Documents for calibration and where they came from. A file or folder of JSON lines with `text`. The
    default (no path): the default data folder's c4/, less the held-out C4 judge's file (HELDOUT_C4_FILES)."""
    default = path is None
    if default:
        base = default_data_dir()
        if base is not None and (base / _CALIB_SUBDIR).is_dir():
            path = str(base / _CALIB_SUBDIR)
        else:
            return _hub_texts("allenai/c4", "en", "train", data_files="en/c4-train.00000-of-01024.json.gz"), "hub:allenai/c4"
    files = _files_in(Path(path), _TEXT_SUFFIXES)
    if default:
        files = [f for f in files if f.name not in HELDOUT_C4_FILES] or files
    texts: list[str] = []
    for f in files:
        try:
            with _open_text(f) as fh:
                for n, line in enumerate(fh, 1):
                    if line.strip():
                        text = json.loads(line)["text"]
                        if not isinstance(text, str):
                            raise UserError(f"{f} line {n}: 'text' must be a string, got "
                                            f"{'null' if text is None else type(text).__name__}")
                        texts.append(text)
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{f} line {n}: not JSON lines with a 'text' field ({type(e).__name__})") from e
        except (OSError, EOFError, zlib.error) as e:  # raised while reading: no line to name
            raise UserError(f"{f}: {_read_failure(f, e)}") from e
        except UnicodeDecodeError as e:
            raise UserError(f"{f}: cannot be read as UTF-8 (or gzipped UTF-8) text ({type(e).__name__})") from e
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise UserError(f"no calibration text found in {path} (expected JSON lines with a 'text' field)")
    return texts, str(path)


def _hub_texts(name, config, split, data_files=None) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise UserError(
            "no local data found and the `datasets` package is missing for the hub; "
            f"pass --calib/--eval-data or set ${DATA_DIR_ENV}"
        ) from None
    try:
        ds = datasets.load_dataset(name, config, split=split, data_files=data_files)
    except Exception as e:  # any hub failure is the user's environment, not a bug here
        raise UserError(f"could not load {name} from the hub ({type(e).__name__}); pass a local path") from e
    return [t for t in ds["text"]]


def split_holdout(texts: list, every: int = 10) -> tuple[list, list]:
    """(calibration, held-out): every `every`-th document (a text, or its tokens) is held out, deterministically."""
    return ([t for i, t in enumerate(texts) if i % every != every - 1],
            [t for i, t in enumerate(texts) if i % every == every - 1])


class CalibrationSampler:
    """Random seqlen-token segments of random documents (documents longer than seqlen), seeded.

    Its state is one torch.Generator, saved with a run's checkpoint so that a resumed run sees
    the same batches as an uninterrupted one.
    """

    def __init__(self, tokenizer, texts: list[str] | None, seqlen: int, batch_size: int, seed: int,
                 ids: list[list[int]] | None = None):  # ids: the texts already tokenized
        self.seqlen, self.batch_size = seqlen, batch_size
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if ids is None else ids
        self.docs = [torch.tensor(d, dtype=torch.long) for d in ids if len(d) > seqlen]
        if not self.docs:
            raise UserError(f"no calibration document is longer than seqlen={seqlen} tokens")
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self) -> torch.Tensor:
        rows = []
        for _ in range(self.batch_size):
            doc = self.docs[int(torch.randint(len(self.docs), (1,), generator=self.generator))]
            start = int(torch.randint(len(doc) - self.seqlen, (1,), generator=self.generator))
            rows.append(doc[start : start + self.seqlen])
        return torch.stack(rows)

    def reseeded(self, seed: int) -> "CalibrationSampler":
        """A sampler over the same documents with a stream of its own."""
        other = copy.copy(self)
        other.generator = torch.Generator().manual_seed(seed)
        return other

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


# --- evaluation -------------------------------------------------------------------------------
def load_eval_text(path: str | None = None) -> tuple[str, str]:
    """WikiText-2 raw test as one string, rows joined with blank lines, and where it came from.

    Accepts a parquet file (column `text`, one row per line, the HF layout), a plain text file
    (read whole), or a folder holding either (parquet preferred).
    """
    if path is None:
        base = default_data_dir()
        if base is not None and (base / _EVAL_SUBDIR).is_dir():
            path = str(base / _EVAL_SUBDIR)
        else:
            return "\n\n".join(_hub_texts("wikitext", "wikitext-2-raw-v1", "test")), "hub:wikitext-2-raw-v1"
    p = Path(path)
    if p.is_dir():
        found = ([f for f in sorted(p.glob("*.parquet")) if f.is_file()] or [f for f in sorted(p.glob("*.raw")) if f.is_file()]
                 or [f for f in sorted(p.glob("*.txt")) if f.is_file()])
        if not found:
            raise UserError(f"no .parquet, .raw or .txt evaluation file in {path}")
        if len(found) > 1:  # e.g. train and validation splits side by side: never guess which one
            raise UserError(f"{path} holds {len(found)} candidate evaluation files ({', '.join(f.name for f in found)}); "
                            "pass the one to use as --eval-data")
        p = found[0]
    if not p.is_file():
        raise UserError(f"evaluation data not found: {path}")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            text = "\n\n".join(pq.read_table(p, columns=["text"]).column("text").to_pylist())
        except Exception as e:
            raise UserError(f"{p}: not a parquet file with a 'text' column ({type(e).__name__})") from e
    else:
        try:
            text = p.read_text(encoding="utf-8-sig")  # (a byte-order mark, as Windows editors write one: skipped)
        except UnicodeDecodeError as e:
            raise UserError(f"{p}: not UTF-8 text") from e
        except OSError as e:
            raise UserError(f"{p}: {_read_failure(p, e)}") from e
    if not text.strip():
        raise UserError(f"evaluation file {p} is empty")
    return text, str(p)


DEFAULT_EVAL_WINDOWS = 256  # the results tables' protocol (32,768 tokens of 128); 0 or None: all of them
# An evaluation text up to this many characters is tokenized whole, as always (WikiText-2's test split: 1.3 M); a
# longer one in pieces (engine/data/tokenize_docs.py), and only until the windows asked for are filled: a fast
# tokenizer holds tens of bytes per character at once (~100x a 200 MB text)
EVAL_WHOLE_CHARS = 1 << 22


def eval_windows(tokenizer, text: str, seqlen: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping seqlen-token windows of the tokenized text, the first `max_windows` of them (0 or None:
    all): (n_windows, seqlen)."""
    if len(text) <= EVAL_WHOLE_CHARS:
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    else:
        from .tokenize_docs import long_document_ids

        cap = max_windows * seqlen if max_windows else sys.maxsize
        ids = torch.tensor(long_document_ids(tokenizer, text, cap=cap), dtype=torch.long)
    n = ids.numel() // seqlen
    if max_windows:
        n = min(n, max_windows)
    if n == 0:
        raise UserError(f"evaluation text has {ids.numel()} tokens, fewer than one window of {seqlen}")
    return ids[: n * seqlen].view(n, seqlen)
