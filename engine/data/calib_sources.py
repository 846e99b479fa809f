"""Calibration sources: which text the run's masks are scored and measured on (`--calib-source NAME`).

    data  the calibration documents as given (--calib; C4 by default)
    self  the dense model's own text: continuations sampled from the model at --self-temperature, each from the
          first PROMPT_TOKENS tokens of a calibration document drawn with the run's seed (self-generated
          calibration data, as Ji et al., ICLR 2025, and Williams & Aletras, 2024, propose for pruning and
          quantisation). Sampled once per model, seed and setting, and cached as JSON lines; the documents come
          in seeded batches, so a cached generation serves a smaller --self-docs that is a whole number of
          batches (its first documents are that run's) and goes on for a larger one.
    mix   both: as many calibration documents as generated ones, interleaved (data, self, data, self, ...)
    auto  self from --prune-ratio SELF_FROM up, data below (the joint preset's: what was measured best at each rate)

Each source returns the documents and a line saying what they are, which results.json keeps.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import torch

from ..errors import UserError
from ..storage.io import atomic_file
from ..model.loading import model_device
from ..settings.registry import add_entry

CALIB_SOURCES: dict[str, Callable] = {}
CACHE_ENV = "PG_PRUNE_SELF_CALIB_CACHE"
PROMPT_TOKENS = 8  # the prompt of each generated document: the first tokens of a calibration document
# continuations sampled at once unless --self-batch says otherwise (its default), in bfloat16 where the CPU runs it
# natively (--self-dtype auto): 3.3x the float32 sampler's 32 a batch. At 50 % the one-shot init moves 10-40 % with
# any redraw of the text, whichever sampler draws it; this one's text was no worse than a redraw of the float32
# sampler's on the tuning or the confirmation seeds (docs/results.md, "The own text's sampler")
GENERATE_BATCH = 128
KEYLESS_BATCH = 32  # the one sampler before --self-batch and --self-dtype (32 a batch in the weights' dtype): the
#                    names of the texts it cached carry neither setting


PHASE = "calibration text"  # the phase a run's generated text is timed in (results.json's seconds_by_phase)


def register_calib_source(name: str, generates: bool = False, resolve: Callable | None = None):
    """A source: fn(texts, model, tokenizer, config, fingerprint, log, before_sampling=None) -> (documents, what
    they are). before_sampling(left): called with the documents left to sample, before a generating source samples
    them (the run says its plan there: engine.plan.forecast.say_text_plan).
    generates: it samples text from the dense model (self_docs x self_tokens, cached), a phase of the run's own.
    resolve: config -> the name of the source it reads for that run (a source that picks another, as auto)."""
    def add(fn):
        fn.generates, fn.resolve = generates, resolve
        add_entry(CALIB_SOURCES, name, fn, "calibration source")
        return fn

    return add


def source_of(config) -> str:
    """The source a run reads: --calib-source's, a picking one (auto) resolved for this run."""
    fn = CALIB_SOURCES.get(config.calib_source)
    return fn.resolve(config) if fn is not None and fn.resolve is not None else config.calib_source


def step_source_of(config) -> str:
    """The source the steps and their held-out check read: --step-calib-source's, resolved as source_of resolves
    one, or the init's (same: source_of's)."""
    name = getattr(config, "step_calib_source", "same")
    fn = CALIB_SOURCES.get(name)
    if fn is None:  # (same)
        return source_of(config)
    return fn.resolve(config) if fn.resolve is not None else name


def run_sources(config) -> tuple[str, ...]:
    """The sources a run reads: the init's (its metric, the joint mix, the refit's statistics), then the steps' where
    it is another."""
    return tuple(dict.fromkeys((source_of(config), step_source_of(config))))


def run_generates(config) -> bool:
    """Does any source the run reads sample text from the dense model? (self and mix sample the same own text, once.)"""
    return any(getattr(CALIB_SOURCES.get(s), "generates", False) for s in run_sources(config))


def generated_tokens(config) -> int:
    """Tokens a run's calibration sources put through the dense model when their text is not cached (each
    document's prompt and its continuation; self and mix share it); 0 where no source generates."""
    if not run_generates(config):
        return 0
    return config.self_docs * (PROMPT_TOKENS + config.self_tokens)


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pg-prune" / "self-calib")


def check_cache_dir() -> None:
    """A $PG_PRUNE_SELF_CALIB_CACHE that names a file: one line when a run that generates its text starts (the
    generation's minutes would otherwise be spent again by every run, with a "not cached" line)."""
    from ..storage.ppl_cache import check_folder

    if os.environ.get(CACHE_ENV):
        check_folder(CACHE_ENV, cache_dir())


@register_calib_source("data")
def data_documents(texts, model, tokenizer, config, fingerprint, log=print, before_sampling=None):
    return texts, "the calibration documents"


def prompts(tokenizer, texts: list[str], n: int, seed: int) -> torch.Tensor:
    """(n, PROMPT_TOKENS) prompts: the first tokens of n calibration documents drawn with the seed (documents
    shorter than a prompt are skipped; drawn with replacement when there are fewer than n)."""
    g = torch.Generator().manual_seed(seed + 7)
    order = torch.randperm(len(texts), generator=g).tolist()
    out = []
    while len(out) < n:
        for i in order:
            ids = tokenizer(texts[i][:400], add_special_tokens=False)["input_ids"][:PROMPT_TOKENS]
            if len(ids) == PROMPT_TOKENS:
                out.append(ids)
                if len(out) == n:
                    break
        if not out:
            raise UserError(f"self-generated calibration: no calibration document has {PROMPT_TOKENS} tokens for a prompt")
    return torch.tensor(out, dtype=torch.long)


def generation_dtype(config, model=None) -> str:
    """The dtype the sampling's matrix products run in (--self-dtype, resolved on the run's device)."""
    from ..model.precision import resolve_pass_dtype, run_device_type

    return resolve_pass_dtype(config.self_dtype, config.dtype, run_device_type(config, model))


@torch.no_grad()
def sample_documents(model, tokenizer, prompt_ids: torch.Tensor, new_tokens: int, temperature: float, seed: int,
                     log=print, done: list[str] = (), keep: Callable[[list[str]], None] | None = None,
                     batch_size: int = GENERATE_BATCH, dtype: str = "float32") -> list[str]:
    """The model's continuations of each prompt (ancestral sampling at `temperature`, no top-k or top-p), decoded
    with their prompts. Sampled batch_size prompts at a time, each batch from its own seed, so that the same
    model and settings give the same documents, and a generation stopped after some batches (`done`, the documents
    of the batches finished) goes on with the next batch; `keep(docs)` is told of each finished batch. dtype
    float32: transformers' generate, in the weights' dtype; bfloat16: decode_bfloat16 with bfloat16 copies of the
    linear weights (bfloat16_linears), 1.8x faster at 32 a batch and 3.3x at 128 on a CPU with native bfloat16
    (bench/self_text_speed.py, one thread under load)."""
    docs, device = list(done), model_device(model)
    first = len(docs) - len(docs) % batch_size
    docs = docs[:first]
    bfloat16 = dtype == "bfloat16"

    def sample(batch):
        if bfloat16:
            return decode_bfloat16(model, batch, new_tokens, temperature)
        return model.generate(input_ids=batch, attention_mask=torch.ones_like(batch), do_sample=True,
                              temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, pad_token_id=tokenizer.eos_token_id or 0)

    with (bfloat16_linears(model) if bfloat16 else contextlib.nullcontext()):
        for i in range(first, prompt_ids.shape[0], batch_size):
            batch = prompt_ids[i:i + batch_size].to(device)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed * 100_003 + i)
                out = sample(batch)
            docs += tokenizer.batch_decode(out.cpu(), skip_special_tokens=True)
            if keep is not None:
                keep(docs)
            log(f"self-generated calibration: {len(docs)}/{prompt_ids.shape[0]} documents")
    return docs


@contextlib.contextmanager
def bfloat16_linears(model):
    """Every linear layer's weight (the LM head's too) as a bfloat16 copy while the block runs, the originals put
    back after it (a tied LM head is tied again): under autocast a float32 weight is cast anew at every forward,
    which in a decoding loop of one token a sequence cost as much as the products themselves (profiled on the
    default model). The norms, the embedding and the residual stream stay in the weights' dtype."""
    saved = [(m, m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        for m, w in saved:
            m.weight = torch.nn.Parameter(w.detach().to(torch.bfloat16), requires_grad=False)
        yield
    finally:
        for m, w in saved:
            m.weight = w


@torch.no_grad()
def decode_bfloat16(model, prompt_ids: torch.Tensor, new_tokens: int, temperature: float) -> torch.Tensor:
    """Ancestral sampling at `temperature` with a KV cache, the forwards under bfloat16 autocast, the next-token
    distribution in float32 and sampled by inverse transform (one uniform a sequence against the cumulative
    probabilities: the same distribution as torch.multinomial, whose exponential draws over the whole vocabulary
    took a quarter of HF generate's time). The keys and values go into buffers of the whole length, allocated once
    (preallocated_cache): the same tensors a growing cache would hand to attention, without copying the cache at
    every token. Prompt and continuations, as generate returns them."""
    cache = preallocated_cache(prompt_ids.shape[1] + new_tokens)
    x, out = prompt_ids, [prompt_ids]
    for _ in range(new_tokens):
        with torch.autocast(prompt_ids.device.type, dtype=torch.bfloat16):
            logits = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        cdf = probs.cumsum(dim=-1)
        u = torch.rand(probs.shape[0], 1, device=probs.device) * cdf[:, -1:]
        x = torch.searchsorted(cdf, u).clamp_(max=probs.shape[1] - 1)
        out.append(x)
    return torch.cat(out, dim=1)


def preallocated_cache(capacity: int):
    """A transformers cache whose every layer keeps its keys and values in buffers of `capacity` positions, filled
    in place: attention reads the same values, in the same shapes, as from DynamicCache, which concatenates the
    whole cache anew at each token (O(length^2) copying over a generation; at 128 sequences of 264 positions, 20 %
    of the sampling's time on 2 cores). bench/self_text_speed.py times it; tests/test_rewards.py checks the
    tokens against DynamicCache's."""
    from transformers.cache_utils import Cache, DynamicLayer

    class FilledLayer(DynamicLayer):
        def lazy_initialization(self, key_states, value_states):
            super().lazy_initialization(key_states, value_states)
            b, h, _, d = key_states.shape
            self._bufs = [torch.empty(b, h, capacity, d, dtype=key_states.dtype, device=key_states.device)
                          for _ in range(2)]
            self._length = 0

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self._length + key_states.shape[-2]
            if end > capacity:
                raise ValueError(f"the cache holds {capacity} positions; {end} asked")
            for buf, new in zip(self._bufs, (key_states, value_states)):
                buf[:, :, self._length:end] = new
            self._length = end
            self.keys, self.values = (buf[:, :, :end] for buf in self._bufs)
            return self.keys, self.values

    return Cache(layer_class_to_replicate=FilledLayer)


def self_key(fingerprint: str, config, texts_digest: str, docs: int | None = None) -> str:
    """The cache's name for a model, setting and calibration documents: the count of documents is not in it (a
    cached generation's first documents are a smaller one's: `usable`); `docs` names the file a generation of
    that many was cached in before (a cache written by an earlier version, read once and renamed)."""
    what = [fingerprint, config.dtype, config.seed, *([docs] if docs is not None else []), config.self_tokens,
            config.self_temperature, PROMPT_TOKENS, texts_digest]
    how = (config.self_batch, generation_dtype(config))
    if how != (KEYLESS_BATCH, config.dtype):  # (another batch or dtype samples other text; the float32 sampler's key
        what.append(list(how))             # is what it was before they were settings: its caches still serve)
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:20]


def cache_files(config, fingerprint: str | None, digest: str) -> tuple[Path, Path] | None:
    """Where the generated text of this model (fingerprint: None for a model in memory, never cached), setting
    and calibration documents (their digest) is cached, and the file an earlier version wrote for this run's count
    of documents (its name held the count)."""
    if not fingerprint:
        return None
    return (cache_dir() / f"{self_key(fingerprint, config, digest)}.jsonl.gz",
            cache_dir() / f"{self_key(fingerprint, config, digest, config.self_docs)}.jsonl.gz")


def cache_path(config, fingerprint: str | None, digest: str) -> Path | None:
    """cache_files' cache, for the run that reads or writes it: an earlier version's file is moved there first."""
    files = cache_files(config, fingerprint, digest)
    if files is None:
        return None
    path, legacy = files
    if not path.is_file() and legacy.is_file():
        try:
            legacy.replace(path)
        except OSError:
            return legacy
    return path


def usable(stored: list[str], n: int, batch_size: int = GENERATE_BATCH) -> list[str] | None:
    """The first n of a cached generation's documents, where they are what a generation of n gives: all of it, or
    the whole batches of a larger one (n a multiple of batch_size: each batch is sampled from its own seed, so
    batch k is the same in both; a shorter last batch would not be). None otherwise."""
    if len(stored) == n or (len(stored) > n and n % batch_size == 0):
        return stored[:n]
    return None


def text_cached(config, fingerprint: str | None, calib_digest: Callable[[], str]) -> bool:
    """Does the cache hold the text this run's source would generate (False for a source that generates none)?
    calib_digest: the calibration documents' digest, computed only when it is needed."""
    if not generated_tokens(config):
        return False
    files = cache_files(config, fingerprint, calib_digest())  # (a look only: nothing is moved)
    path = next((f for f in files or () if f.is_file()), None)
    return bool(path is not None and usable(read_documents(path), config.self_docs, config.self_batch) is not None)


def config_text_cached(config) -> bool:
    """text_cached for a config before any run reads its model or data (the app's plan): the model's files and
    the calibration documents as the run would read them (their digest kept per path and modification time).
    False wherever that cannot be told cheaply (a hub model or hub data, a path that does not read)."""
    if not generated_tokens(config):
        return False
    from ..storage import ppl_cache
    from .text import _CALIB_SUBDIR, default_data_dir
    from ..model.loading import resolve_model

    try:
        fingerprint = ppl_cache.files_key(resolve_model(config.model), config.dtype)
        calib = config.calib or (str(default_data_dir() / _CALIB_SUBDIR) if default_data_dir() else None)
        if not fingerprint or not calib or not Path(calib).exists():
            return False
        stamp = tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in sorted(Path(calib).rglob("*"))
                      if f.is_file()) if Path(calib).is_dir() else ((calib, Path(calib).stat().st_mtime_ns),)
        return text_cached(config, fingerprint, lambda: _calib_digest(calib, stamp))
    except (UserError, OSError):
        return False


@functools.lru_cache(maxsize=4)
def _calib_digest(calib: str, stamp: tuple) -> str:
    from .text import load_calibration_texts

    return texts_digest(load_calibration_texts(calib)[0])


def texts_digest(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(hashlib.sha256(t.encode()).digest())
    return h.hexdigest()


def check_generation(config, model_config) -> None:
    """What a generation could not give, refused when a run that generates starts (PruneRun, before the data and the
    minutes the sampling takes): documents longer than the model's positions (max_position_embeddings, where its
    config says), or no longer than a calibration window (the sampler takes documents of more than --seqlen tokens:
    none of them could be used)."""
    length = PROMPT_TOKENS + config.self_tokens
    positions = getattr(model_config, "max_position_embeddings", None)
    if isinstance(positions, int) and length > positions:
        raise UserError(f"--self-tokens {config.self_tokens} after the {PROMPT_TOKENS}-token prompt is {length} tokens, "
                        f"beyond the model's {positions} positions: give --self-tokens {positions - PROMPT_TOKENS} or fewer")
    if length <= config.seqlen:
        raise UserError(f"--self-tokens {config.self_tokens} makes documents of {length} tokens (with the {PROMPT_TOKENS}-"
                        f"token prompt), none longer than a --seqlen {config.seqlen} calibration window: give "
                        f"--self-tokens {config.seqlen - PROMPT_TOKENS + 1} or more, or a shorter --seqlen")


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM while the calibration text is sampled: how many documents are saved (whole batches, in the
    cache's .partial file), which the same run started again takes up (a plain rerun: its folder holds no run yet)."""

    def __init__(self, saved: int, total: int, cached: bool, batch: int = GENERATE_BATCH):
        super().__init__(saved, total, cached)
        self.saved, self.total, self.cached, self.batch = saved, total, cached, batch

    def __str__(self) -> str:
        if not self.cached:
            return (f"interrupted while generating the calibration text ({self.total} documents): none is saved (a "
                    "model given in memory is never cached)")
        return (f"interrupted while generating the calibration text: {self.saved} of {self.total} documents are saved"
                + ("" if self.saved else f" (they are saved {self.batch} at a time)"))


@register_calib_source("self", generates=True)
def self_documents(texts, model, tokenizer, config, fingerprint, log=print, before_sampling=None):
    what = (f"{config.self_docs} documents sampled from the dense model at temperature {config.self_temperature}, "
            f"{config.self_tokens} tokens each after a {PROMPT_TOKENS}-token prompt from the calibration documents "
            f"(seed {config.seed})")
    n, path = config.self_docs, cache_path(config, fingerprint, texts_digest(texts))
    stored = _cached(path, log)
    docs = usable(stored, n, config.self_batch)
    if docs is not None:
        log(f"self-generated calibration: {n} documents from the cache ({path}"
            + (f": the first {n} of {len(stored)})" if len(stored) > n else ")"))
        return docs, what
    partial = path.with_name(path.name.replace(".jsonl.gz", ".partial.jsonl.gz")) if path is not None else None
    interrupted = _cached(partial, log)
    done = max(stored, interrupted, key=len)[:n]  # (sample_documents keeps their whole batches)
    if done:
        log(f"self-generated calibration: {len(done)} documents from "
            + ("the cache" if len(stored) >= len(interrupted) else "an interrupted generation") + ", going on")
    saved = [len(done) - len(done) % config.self_batch if path is not None else 0]  # (what a rerun takes up)

    def keep(docs, to=partial):
        if to is not None and len(docs) > len(interrupted) and write_documents(to, docs, log):
            saved[0] = len(docs)

    if before_sampling is not None:
        before_sampling(n - saved[0])
    try:
        docs = sample_documents(model, tokenizer, prompts(tokenizer, texts, n, config.seed),
                                config.self_tokens, config.self_temperature, config.seed, log, done, keep,
                                batch_size=config.self_batch, dtype=generation_dtype(config, model))
    except KeyboardInterrupt:  # (Ctrl-C, or SIGTERM in the CLI: the batches saved so far are said)
        raise GenerationInterrupted(saved[0], n, path is not None, config.self_batch) from None
    # (the cache keeps the longest generation: a shorter one, whose last batch is not the cached one's, is not
    # written over it, nor is a longer interrupted one dropped)
    if path is not None and (len(docs) < len(stored) or write_documents(path, docs, log)) \
            and partial.is_file() and len(docs) >= len(interrupted):
        partial.unlink()
    return docs, what


def read_documents(path: Path) -> list[str]:
    """The documents a cache file holds; [] for one that is missing or damaged (cache_entries says why)."""
    return cache_entries(path)[0]


def cache_entries(path: Path) -> tuple[list[str], str | None]:
    """(the documents a cache file holds, what is wrong with it or None). A file that does not read (cut short,
    not gzip, not JSON lines) or whose entries are not each a non-empty string ({"text": 123}, "") is damaged:
    no documents, and the reason, so that it is generated again (and written over) rather than trusted."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            entries = [json.loads(line) for line in f if line.strip()]
    except (OSError, EOFError, ValueError) as e:
        return [], f"it does not read ({type(e).__name__})"
    for i, entry in enumerate(entries, 1):
        text = entry.get("text") if isinstance(entry, dict) else None
        if not isinstance(text, str) or not text:
            got = f"{type(text).__name__}" if not isinstance(text, str) else "an empty string"
            return [], f"line {i}'s text is {got}, not a document"
    return [entry["text"] for entry in entries], None


def _cached(path: Path | None, log) -> list[str]:
    """cache_entries' documents of a cache file that exists; a damaged one said in a line (it is made again)."""
    if path is None or not path.is_file():
        return []
    docs, problem = cache_entries(path)
    if problem:
        log(f"self-generated calibration: the cache file {path} is damaged ({problem}); generating it again")
    return docs


def write_documents(path: Path, docs: list[str], log) -> bool:
    """JSON lines, gzipped, written whole or not at all; False (and a line said) when it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        body = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
        with atomic_file(path) as tmp:
            Path(tmp).write_bytes(gzip.compress(body, mtime=0))
        return True
    except (OSError, UserError) as e:  # (a cache that cannot be written costs the next run the generation, nothing
        # else; a full disk is atomic_file's UserError: not cached either, the run goes on)
        log(f"self-generated calibration: not cached ({getattr(e, 'strerror', None) or e})")
        return False


@register_calib_source("mix", generates=True)
def mixed_documents(texts, model, tokenizer, config, fingerprint, log=print, before_sampling=None):
    generated, what = self_documents(texts, model, tokenizer, config, fingerprint, log, before_sampling)
    g = torch.Generator().manual_seed(config.seed + 11)
    picked = [texts[i] for i in torch.randperm(len(texts), generator=g)[:len(generated)].tolist()]
    mixed = [d for pair in zip(picked, generated) for d in pair]
    return mixed, f"{len(picked)} calibration documents interleaved with {what}"


# auto: the text measured best at the run's rate (docs/results.md, "Which reward and text transfer"; the joint
# preset's pg-alloc with KL under each sample's refit, 24 steps, 3 seeds a rate): at 50 % of the decoder the own
# text's exports are 31 % lower on WikiText-2 than the C4-calibrated ones, level on held-out C4 and 0.58 points
# higher on the zero-shot mean; at 30 % the C4-calibrated exports are better on all three. Between them nothing is
# measured: the calibration documents below SELF_FROM, as before.
SELF_FROM = 0.5


def _by_rate(config) -> str:
    return "self" if config.prune_ratio >= SELF_FROM - 1e-9 else "data"


@register_calib_source("auto", resolve=_by_rate)
def rate_documents(texts, model, tokenizer, config, fingerprint, log=print, before_sampling=None):
    return CALIB_SOURCES[_by_rate(config)](texts, model, tokenizer, config, fingerprint, log, before_sampling)
