"""Streaming generation for the dense model, the masked base model, a run's sliced export, and the run's
GGUF in llama.cpp.

    base = load_base(run.config["model"])                 # one copy of the base weights
    pruned = MaskedModel.from_run(base, run_dir)           # masks as hooks on those weights
    gen = stream(base, "Hello", GenerationSettings())     # dense
    for piece in gen: ...                                  # text pieces as they are generated
    gen.stats                                             # tokens, seconds, tokens/s
    gen = stream(pruned, "Hello", settings)                # pruned
    gguf = load_gguf(run_dir)                              # RUN/model.gguf in llama.cpp (written if missing)

Masks are applied through forward hooks, and hooks act on the model object, so a dense and a
masked generation on the same base weights must not overlap. Every generation on a base model
holds that model's lock for its whole duration: callers (the app) generate the dense answer and
then the pruned one, sequentially; a second browser session waits for the lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError
from ..model.loading import count_parameters
from ..run.files import GGUF_FILE, MODEL_DIR, RECOVER_DIR, RESULTS_FILE, has_recover_marker
from ..model.unit_types import unit_sizes

_locks: dict[int, threading.Lock] = {}
_locks_guard = threading.Lock()


def model_lock(model) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(id(model), threading.Lock())


@dataclass
class GenerationSettings:
    max_new_tokens: int = 64
    temperature: float = 0.7
    greedy: bool = True
    top_p: float = 0.95
    seed: int = 0

    def generate_kwargs(self) -> dict:
        if self.greedy or self.temperature <= 0:
            return {"do_sample": False, "max_new_tokens": self.max_new_tokens}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p,
                "max_new_tokens": self.max_new_tokens}


@dataclass
class ChatModel:
    """A model ready to chat: the dense base, or something derived from it."""

    model: object
    tokenizer: object
    label: str
    params: int
    layer_masks: dict[str, list[torch.Tensor]] | None = None  # set: masks applied as hooks on `model`
    info: dict = field(default_factory=dict)
    backend: str = "transformers float32"  # what runs it: its tokens/s compare only with the same backend's


PROMPTS_FILE = Path(__file__).resolve().parents[2] / "assets" / "prompts.json"  # the Chat page's saved prompt set


def saved_prompts(path: Path = PROMPTS_FILE) -> list[str]:
    """The saved prompt set's prompts ({"prompts": [...]}): the non-empty strings, in order; none when the file is
    missing or not that shape (the page then offers no set)."""
    import json

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    prompts = data.get("prompts") if isinstance(data, dict) else None
    return [p for p in prompts if isinstance(p, str) and p.strip()] if isinstance(prompts, list) else []


def load_base(model_name: str, dtype: str = "float32", device: str = "cpu") -> ChatModel:
    from ..model.arch import ModelAdapter
    from ..model.loading import load_model, resolve_model

    model, tok = load_model(resolve_model(model_name), dtype, device)
    ModelAdapter.for_model(model)  # unsupported architectures fail here, with a message
    return ChatModel(model, tok, f"dense {Path(model_name).name}", count_parameters(model),
                     backend=f"transformers {dtype}")


def masked_from_run(base: ChatModel, run_dir: str | Path) -> ChatModel:
    """The base model with a finished run's masks applied as hooks (shares the base weights)."""
    from ..export.artifacts import load_mask_artifact
    from ..model.units import UnitLayout

    meta, masks, _ = load_mask_artifact(run_dir)
    layout = UnitLayout({u: meta["units_per_layer"][u] for u in meta["unit_types"]})
    from ..model.arch import ModelAdapter

    adapter = ModelAdapter.for_model(base.model)
    sizes = unit_sizes(adapter)
    for u in layout.unit_types:
        if layout.sizes[u] != sizes[u]:
            raise UserError(f"the masks of {Path(run_dir).name} do not fit this model ({u}: {layout.sizes[u]} vs {sizes[u]})")
    params = recorded_params(run_dir) or _effective_params(base.model, layout, masks)
    return ChatModel(base.model, base.tokenizer, f"pruned (masks on base): {Path(run_dir).name}", params,
                     layer_masks={u: layout.split(u, m) for u, m in masks.items()}, info={"meta": meta},
                     backend=base.backend)


def recorded_params(run_dir: str | Path) -> int | None:
    """The pruned model's parameters as the run's results.json records them; None when it does not (no file, not
    JSON, not an object, not a count): they are then counted."""
    import json

    try:
        value = json.loads((Path(run_dir) / RESULTS_FILE).read_text())["params_pruned"]
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _effective_params(model, layout, masks) -> int:
    from ..export.artifacts import build_pruned_model

    return count_parameters(build_pruned_model(model, layout, masks))


def recovered_folder(run_dir: str | Path) -> Path | None:
    """The recovered model of a run (`prune --recover`, or `recover RUN --out RUN/recover`): RUN/recover/model when
    that folder is a recovery's output holding a model, else None."""
    out = Path(run_dir) / RECOVER_DIR
    return out / MODEL_DIR if has_recover_marker(out) and (out / MODEL_DIR / "config.json").is_file() else None


def load_recovered(run_dir: str | Path) -> ChatModel:
    """A run's recovered model (RUN/recover/model: the sliced export after recovery), as the sliced export is."""
    folder = recovered_folder(run_dir)
    if folder is None:
        raise UserError(f"{Path(run_dir).name} has no recovered model (python -m engine prune ... --recover MINUTES, "
                        f"or recover RUN --out RUN/{RECOVER_DIR})")
    chat = _load_export(folder)
    chat.label = f"recovered: {Path(run_dir).name}"
    return chat


def load_sliced(run_dir: str | Path) -> ChatModel:
    """A run's physically sliced export (model/), for real speed."""
    folder = Path(run_dir) / MODEL_DIR
    if not (folder / "config.json").is_file():
        raise UserError(f"{Path(run_dir).name} has no sliced export (finish the run first)")
    chat = _load_export(folder)
    chat.label = f"pruned (sliced export): {Path(run_dir).name}"
    return chat


def _load_export(folder: Path) -> ChatModel:
    from transformers import AutoModelForCausalLM

    from .. import register_pruned_classes
    from ..model.loading import check_before_load, load_tokenizer, ModelSource

    register_pruned_classes()
    check_before_load(ModelSource(str(folder), str(folder)))  # (its own code, e.g. a run folder from elsewhere: one line)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, trust_remote_code=False)
    model.eval().requires_grad_(False)
    tok = load_tokenizer(ModelSource(str(folder), str(folder)))
    return ChatModel(model, tok, folder.name, count_parameters(model), backend="transformers float32")


class LlamaCppGenerator:
    """A GGUF file in llama.cpp behind the part of transformers' generate() that `stream` uses, so the same
    tokenizer, chat template, streamer and token count serve every backend."""

    def __init__(self, llm, stop_ids: set[int]):
        self.llm, self.stop_ids = llm, stop_ids

    def generate(self, input_ids: torch.Tensor, streamer, max_new_tokens: int, do_sample: bool = False,
                 temperature: float = 0.7, top_p: float = 0.95, **_ignored) -> None:
        from . import llamacpp

        streamer.put(input_ids)  # the prompt, which the streamer skips
        for token in llamacpp.generate(self.llm, input_ids[0].tolist(), max_new_tokens, self.stop_ids,
                                       greedy=not do_sample, temperature=temperature, top_p=top_p,
                                       seed=torch.initial_seed()):
            streamer.put(torch.tensor([token]))
        streamer.end()


def load_gguf(run_dir: str | Path, outtype: str = "f16", threads: int | None = None) -> ChatModel:
    """A run's GGUF (RUN/model.gguf, as `prune --export-gguf` writes it; exported there first if missing)
    in llama.cpp, with the tokenizer of the run's sliced export."""
    from ..export import export_run

    run_dir = Path(run_dir)
    path = run_dir / GGUF_FILE
    _sliced_folder(run_dir)
    if not path.is_file():
        export_run(run_dir, "gguf", path, outtype)
    return gguf_chat(path, run_dir, _results(run_dir).get("params_pruned", 0),
                     f"pruned (GGUF in llama.cpp): {run_dir.name}", threads)


def load_dense_gguf(run_dir: str | Path, cache_dir: str | Path, threads: int | None = None) -> ChatModel:
    """The run's dense base model as a GGUF in llama.cpp, of the same weight type as the run's GGUF (RUN/model.gguf,
    which must exist: load_gguf first): the same backend on both sides, so their tokens/s compare. Converted once
    with the project's exporter (engine/ui/deploy.py's dense_gguf) and cached in cache_dir; it talks through the
    run's tokenizer, as the pruned side does."""
    import json

    from ..run.files import CONFIG_FILE
    from .gguf_cache import dense_gguf, gguf_outtype

    run_dir = Path(run_dir)
    pruned = run_dir / GGUF_FILE
    outtype = gguf_outtype(pruned)
    if outtype is None:
        raise UserError(f"{pruned} is missing or not a GGUF this project writes (f16, q8_0, f32)")
    try:
        model = json.loads((run_dir / CONFIG_FILE).read_text())["model"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot read the base model from {run_dir / CONFIG_FILE} ({type(e).__name__})") from e
    path = dense_gguf(model, outtype, cache_dir)
    return gguf_chat(path, run_dir, _results(run_dir).get("params_dense", 0), f"dense {Path(str(model)).name} "
                     "(GGUF in llama.cpp)", threads)


def _sliced_folder(run_dir: Path) -> Path:
    folder = Path(run_dir) / MODEL_DIR
    if not (folder / "config.json").is_file():
        raise UserError(f"{Path(run_dir).name} has no sliced export (finish the run first)")
    return folder


def _results(run_dir: Path) -> dict:
    import json

    try:
        return json.loads((Path(run_dir) / RESULTS_FILE).read_text())
    except (OSError, ValueError):
        return {}


def gguf_chat(path: Path, run_dir: Path, params: int, label: str, threads: int | None = None) -> ChatModel:
    """A GGUF file in llama.cpp, talking through the run's tokenizer and stopping at its end-of-text ids."""
    import json

    from ..model.loading import ModelSource, load_tokenizer
    from .gguf_cache import gguf_outtype
    from . import llamacpp

    folder = _sliced_folder(run_dir)
    tok = load_tokenizer(ModelSource(str(folder), str(folder)))
    config = json.loads((folder / "config.json").read_text())
    eos = config.get("eos_token_id")
    stop = {int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None}
    if tok.eos_token_id is not None:
        stop.add(int(tok.eos_token_id))
    threads = threads or llamacpp.default_threads()
    llm = llamacpp.open_gguf(path, n_ctx=2048, threads=threads)
    trained = config.get("max_position_embeddings")
    context = min(2048, int(trained)) if isinstance(trained, int) and trained > 0 else 2048  # (llama.cpp's window)
    return ChatModel(LlamaCppGenerator(llm, stop), tok, label, int(params or 0),
                     info={"gguf": str(path), "context": context, "threads": threads},
                     backend=f"llama.cpp {gguf_outtype(path) or 'GGUF'}")


def speedup(dense: "GenerationStats", pruned: "GenerationStats") -> float | None:
    """Pruned over dense decoding tokens/s (above 1: the pruned model is faster), or None when either has no
    speed to show (too few tokens)."""
    a, b = dense.decode_tokens_per_s, pruned.decode_tokens_per_s
    return b / a if a and b else None


def warm_up(chat: ChatModel) -> ChatModel:
    """Two greedy tokens generated and thrown away, so that the first answer's speed is not the first call's
    (allocations, lazy initialisation); the model is returned."""
    answer(chat, "Hello", GenerationSettings(max_new_tokens=2, greedy=True))
    return chat


def speed_comparison(dense_backend: str, dense_tps: float | None, pruned_backend: str, pruned_tps: float | None,
                     masked: bool = False) -> str:
    """One sentence for under a chat turn: the measured speed-up (decoding tokens/s) when both ran in the same
    backend, else why there is none. masked: the pruned side is the dense weights with masks as hooks (the same
    compute)."""
    if dense_backend != pruned_backend:
        return (f"No speed-up: dense ran in {dense_backend}, pruned in {pruned_backend}; tokens/s of different "
                "backends do not compare.")
    if min(dense_tps or 0.0, pruned_tps or 0.0) <= 0:  # (None: too few tokens to time)
        return (f"No speed-up: a side generated fewer than {MIN_SPEED_TOKENS} tokens, too few to time "
                f"({dense_backend}).")
    text = (f"Speed-up, same backend ({dense_backend}): {pruned_tps:.1f} / {dense_tps:.1f} tokens/s = "
            f"**{pruned_tps / dense_tps:.2f}×** (pruned over dense, decoding after the first token; one answer each, so noisy).")
    if masked:
        text += " Masks on the base model compute every weight, so no speed-up is expected: choose the sliced " \
                "export or the GGUF for the real one."
    return text


def context_length(chat: ChatModel) -> int | None:
    """The tokens a model can attend to: its config's positions (llama.cpp: its window, at most those)."""
    if chat.info.get("context"):
        return int(chat.info["context"])
    n = getattr(getattr(chat.model, "config", None), "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def prompt_problem(chats: list[ChatModel], prompt: str, max_new_tokens: int) -> str | None:
    """None when every model can take the prompt and its answer; else why not, in one line (an empty prompt, or
    one whose tokens and new tokens are over a model's context)."""
    if not prompt or not prompt.strip():
        return "the prompt is empty: type something to send"
    for chat in chats:
        ctx = context_length(chat)
        if ctx is None:
            continue
        n = int(build_inputs(chat.tokenizer, prompt).shape[-1])
        if n + max_new_tokens > ctx:
            return (f"the prompt is {n:,} tokens; with {max_new_tokens} new tokens that is over the context of "
                    f"{ctx:,} tokens of {chat.label} ({chat.backend}): shorten it, or ask fewer new tokens")
    return None


def build_inputs(tokenizer, prompt: str) -> torch.Tensor:
    """Token ids of the prompt, through the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    return ids


MIN_SPEED_TOKENS = 8  # new tokens an answer needs for its speed to be shown: fewer say little but the prompt's cost


@dataclass
class GenerationStats:
    new_tokens: int = 0
    seconds: float = 0.0
    first_token_seconds: float | None = None  # the prompt's forward and the first token
    done: bool = False
    error: str | None = None

    @property
    def tokens_per_s(self) -> float:
        """The whole answer's tokens over its seconds, the prompt's forward included."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """The speed the page shows: the tokens after the first over their seconds (the prompt's forward left
        out), measured on a warmed-up model (warm_up); None below MIN_SPEED_TOKENS new tokens."""
        if self.new_tokens < MIN_SPEED_TOKENS or self.first_token_seconds is None:
            return None
        rest = self.seconds - self.first_token_seconds
        return (self.new_tokens - 1) / rest if rest > 0 else None


def without_special_text(pieces, specials: list[str]):
    """The text pieces with every special token's text taken out, also when a model spells one with ordinary
    tokens ("<|" "end_story" "|>": skip_special_tokens cannot drop it): a piece's end that could begin one is
    held back until the next piece tells."""
    specials = [s for s in specials if len(s) > 1]
    buf = ""
    for piece in pieces:
        buf += piece
        for s in specials:
            buf = buf.replace(s, "")
        hold = max((k for s in specials for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        out, buf = buf[:len(buf) - hold], buf[len(buf) - hold:]
        if out:
            yield out
    if buf:
        yield buf


class Generation:
    """Iterate for text pieces as they come (special tokens' text taken out); `stats` fills in, final once
    iteration ends."""

    def __init__(self, streamer, stats: GenerationStats, thread: threading.Thread, specials: list[str] = ()):
        self._streamer, self.stats, self._thread, self._specials = streamer, stats, thread, list(specials)
        self.text = ""

    def __iter__(self):
        for piece in without_special_text(self._streamer, self._specials):
            self.text += piece
            yield piece
        self._thread.join()
        if self.stats.error:
            raise UserError(f"generation failed: {self.stats.error}")


def stream(chat: ChatModel, prompt: str, settings: GenerationSettings) -> Generation:
    """Start generating in a thread and return the stream of text pieces."""
    from transformers import TextIteratorStreamer

    tok = chat.tokenizer
    input_ids = build_inputs(tok, prompt)
    stats = GenerationStats()

    class CountingStreamer(TextIteratorStreamer):
        def put(self, value):
            if self.next_tokens_are_prompt:
                return super().put(value)
            n = int(value.numel())
            if stats.new_tokens == 0 and n:
                stats.first_token_seconds = time.perf_counter() - t0
            stats.new_tokens += n
            return super().put(value)

    streamer = CountingStreamer(tok, skip_prompt=True, skip_special_tokens=True, timeout=600)
    kwargs = settings.generate_kwargs()
    t0 = time.perf_counter()

    def work():
        from ..model.masking import MaskHooks

        nonlocal t0
        lock = model_lock(chat.model)
        try:
            with lock:
                torch.manual_seed(settings.seed)
                t0 = time.perf_counter()
                with torch.no_grad():
                    if chat.layer_masks is not None:
                        from ..model.arch import ModelAdapter

                        with MaskHooks(ModelAdapter.for_model(chat.model)) as hooks:
                            hooks.set(chat.layer_masks)
                            _generate(chat, input_ids, streamer, kwargs)
                    else:
                        _generate(chat, input_ids, streamer, kwargs)
                stats.seconds = time.perf_counter() - t0
        except Exception as e:  # shown in the page, not as a traceback
            stats.error = f"{type(e).__name__}: {e}"
            streamer.end()
        finally:
            stats.done = True

    thread = threading.Thread(target=work, name="chat-generate", daemon=True)
    thread.start()
    return Generation(streamer, stats, thread, getattr(tok, "all_special_tokens", []))


def _generate(chat: ChatModel, input_ids: torch.Tensor, streamer, kwargs: dict) -> None:
    tok = chat.tokenizer
    chat.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer,
                        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id, **kwargs)


def answer(chat: ChatModel, prompt: str, settings: GenerationSettings) -> tuple[str, GenerationStats]:
    """Generate without streaming (scripts, tests): (text, stats)."""
    gen = stream(chat, prompt, settings)
    text = "".join(gen)
    return text, gen.stats
