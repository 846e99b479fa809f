"""Deployment figures of models side by side: parameters, memory, prefill latency, generation speed.

    python -m engine measure --model smollm2-135m-instruct --compare runs/pg30/model [--compare ...] \
        [--batch-size 1 --seqlen 128 --new-tokens 32 --repeats 5 --out DIR]

Per model:
- params: distinct parameters (tied embeddings once); weights memory: bytes of parameters and buffers.
- peak memory of inference: on CPU, in a fresh subprocess per model, the rise of the peak resident
  set (VmHWM) over the resident set after loading, while it runs one prefill and one generation
  (the peak counter is reset after loading through /proc/self/clear_refs, so loading does not
  count; before that every weight page is touched and freed heap is returned with malloc_trim, so
  memory-mapped safetensors and a GGUF load's freed buffers do not distort the baseline); on CUDA,
  torch.cuda.max_memory_allocated during the same work, minus the memory allocated after loading.
- prefill: seconds of one forward pass of batch x seqlen tokens (random token ids, seeded) with the
  KV cache on, as generation's first step does.
- generation: greedy decoding of exactly new_tokens tokens per row after that prompt
  (min_new_tokens = max_new_tokens, so end-of-text cannot stop it early); tokens/s = batch x
  new_tokens / seconds of the whole generate call (which includes its one prefill).
Timings are medians over `repeats`, after one warm-up, with the models interleaved in one process
so that all see the same machine load.
- llama.cpp (with llama_cpp=OUTTYPE): every model is also written as a GGUF of that type (the deci writer of
  `engine export --format gguf`) and timed in llama.cpp: prompt tokens/s of the first row of the same prompt
  in one batch, and generation tokens/s of exactly new_tokens greedy tokens after it; the files alternate,
  median of `repeats` after a warm-up. This is the speed a user gets from the deployed file on a CPU.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError
from ..storage.outdir import OutputKind, output_folder

CONFIG_FILE, RESULTS_FILE, TABLE_FILE = "measure_config.json", "measure.json", "measure.md"


@dataclass
class MeasureConfig:
    models: list[str] = field(default_factory=list)  # first: the reference (dense); then the compared models
    batch_size: int = 1
    seqlen: int = 128  # prompt tokens (prefill and generation prompt)
    new_tokens: int = 32
    repeats: int = 5
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None  # torch threads (None: torch's default)
    seed: int = 0
    memory: bool = True  # peak memory in a fresh subprocess per model
    llama_cpp: str | None = None  # also time each model as a GGUF of this type in llama.cpp (f32, f16, q8_0)

    def validate(self) -> "MeasureConfig":
        from ..model.loading import DTYPES

        if not self.models:
            raise UserError("give at least one model")
        for name in ("batch_size", "seqlen", "new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise UserError(f"{name.replace('_', ' ')} must be at least 1, got {getattr(self, name)}")
        if self.threads is not None and self.threads < 1:
            raise UserError(f"threads must be at least 1, got {self.threads}")
        if self.dtype not in DTYPES:
            raise UserError(f"unknown dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise UserError(f"unknown device {self.device!r}; use cpu or cuda[:N]")
        if self.llama_cpp is not None:
            from ..export import EXPORT_FORMATS

            if self.llama_cpp not in EXPORT_FORMATS["gguf"].outtypes:
                raise UserError(f"llama_cpp takes a GGUF type ({', '.join(EXPORT_FORMATS['gguf'].outtypes)}), "
                                f"got {self.llama_cpp!r}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --- memory ---------------------------------------------------------------------------------
def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no {key} in /proc/self/status")


def _settle(model) -> None:
    """Make the loaded state comparable across loaders before the baseline is read: every weight page
    resident (safetensors weights are memory-mapped and would otherwise count as inference memory on
    first touch), and freed heap returned to the system (a GGUF load frees much memory that glibc keeps,
    which inference would reuse unseen)."""
    import ctypes
    import gc

    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.sum()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def weights_bytes(model) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


# --- work -----------------------------------------------------------------------------------
def _inputs(model, config: MeasureConfig) -> torch.Tensor:
    g = torch.Generator().manual_seed(config.seed)
    vocab = model.config.vocab_size
    return torch.randint(vocab, (config.batch_size, config.seqlen), generator=g).to(next(model.parameters()).device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def prefill(model, ids: torch.Tensor) -> None:
    model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)


@torch.no_grad()
def generate(model, ids: torch.Tensor, new_tokens: int, pad_id: int) -> int:
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, pad_token_id=pad_id)
    return (out.shape[1] - ids.shape[1]) * ids.shape[0]


def _lengths(config: MeasureConfig) -> dict[str, int]:
    """check_positions' lengths: generation appends new_tokens to the seqlen-token prompt."""
    return {f"seqlen {config.seqlen} + new tokens {config.new_tokens} =": config.seqlen + config.new_tokens}


def _load(name: str, config: MeasureConfig):
    from ..model.loading import check_positions, load_model, resolve_model

    model, tok = load_model(resolve_model(name), config.dtype, config.device)
    check_positions(model.config, _lengths(config))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model.generation_config.temperature = None  # greedy: silence sampling settings shipped with the model
    model.generation_config.top_p = None
    model.generation_config.top_k = None
    return model, pad


def memory_worker(name: str, config: MeasureConfig) -> dict:
    """Runs in a fresh process: load, reset the peak, one prefill and one generation, read the peak."""
    if config.threads:
        torch.set_num_threads(config.threads)
    model, pad = _load(name, config)
    ids = _inputs(model, config)
    if config.device.startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        prefill(model, ids)
        generate(model, ids, config.new_tokens, pad)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return {"peak_mb": peak / 2**20, "peak_delta_mb": (peak - base) / 2**20, "kind": "cuda max_memory_allocated"}
    _settle(model)
    base = _status_mb("VmRSS")
    _reset_peak_rss()
    prefill(model, ids)
    generate(model, ids, config.new_tokens, pad)
    peak = _status_mb("VmHWM")
    return {"peak_mb": peak, "peak_delta_mb": peak - base, "kind": "cpu VmHWM"}


def _memory_in_subprocess(name: str, config: MeasureConfig) -> dict:
    if Path(name).expanduser().exists():  # the worker runs from the repository root
        name = str(Path(name).expanduser().resolve())
    cmd = [sys.executable, "-m", "engine.tools.measure", "--memory-worker", name, json.dumps(config.to_dict())]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    if res.returncode != 0:
        raise UserError(f"memory measurement of {name} failed: {(res.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def measure(config: MeasureConfig, log=lambda m: print(m, file=sys.stderr)) -> dict:
    from ..model.loading import check_before_load, count_parameters, resolve_model

    config.validate()
    for name in config.models:  # every model's declared config, before any model is loaded
        check_before_load(resolve_model(name), _lengths(config))
    if config.threads:
        torch.set_num_threads(config.threads)
    loaded = []
    rows: list[dict] = []
    for name in config.models:
        log(f"loading {name}")
        model, pad = _load(name, config)
        loaded.append((model, pad, _inputs(model, config)))
        rows.append({"model": name, "params": count_parameters(model), "weights_mb": weights_bytes(model) / 2**20,
                     "config_type": model.config.model_type})
    times = [{"prefill": [], "generate": []} for _ in loaded]
    for r in range(config.repeats + 1):  # the first round warms up and is dropped
        for (model, pad, ids), t in zip(loaded, times):
            _sync(config.device)
            t0 = time.perf_counter()
            prefill(model, ids)
            _sync(config.device)
            t1 = time.perf_counter()
            n = generate(model, ids, config.new_tokens, pad)
            _sync(config.device)
            t2 = time.perf_counter()
            if n != config.batch_size * config.new_tokens:
                raise RuntimeError(f"generated {n} tokens, expected {config.batch_size * config.new_tokens}")
            if r:
                t["prefill"].append(t1 - t0)
                t["generate"].append(t2 - t1)
        if r:
            log(f"timing round {r}/{config.repeats}")
    for row, t in zip(rows, times):
        row["prefill_s"] = statistics.median(t["prefill"])
        row["prefill_tokens_per_s"] = config.batch_size * config.seqlen / row["prefill_s"]
        row["generate_s"] = statistics.median(t["generate"])
        row["gen_tokens_per_s"] = config.batch_size * config.new_tokens / row["generate_s"]
    prompt = loaded[0][2][0].tolist()
    del loaded
    if config.llama_cpp:
        for row, speeds in zip(rows, llama_cpp_speeds(config, prompt, log)):
            row.update(speeds)
    if config.memory:
        for row in rows:
            log(f"peak memory of {row['model']} (fresh process)")
            row.update(_memory_in_subprocess(row["model"], config))
    ref = rows[0]
    for row in rows:
        row["params_ratio"] = row["params"] / ref["params"]
        row["speedup_prefill"] = ref["prefill_s"] / row["prefill_s"]
        row["speedup_gen"] = row["gen_tokens_per_s"] / ref["gen_tokens_per_s"]
        if config.llama_cpp:
            row["llama_cpp_speedup_prompt"] = row["llama_cpp_prompt_tokens_per_s"] / ref["llama_cpp_prompt_tokens_per_s"]
            row["llama_cpp_speedup_gen"] = row["llama_cpp_gen_tokens_per_s"] / ref["llama_cpp_gen_tokens_per_s"]
    return {"config": config.to_dict(), "torch_threads": torch.get_num_threads(), "rows": rows}


def llama_cpp_speeds(config: MeasureConfig, prompt: list[int], log) -> list[dict]:
    """Each model as a GGUF of type config.llama_cpp, timed in llama.cpp, the files alternating."""
    import tempfile

    from ..export.gguf import write_model_gguf
    from . import llamacpp

    threads = config.threads or torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="measure-gguf-") as tmp:
        paths = []
        for i, name in enumerate(config.models):
            log(f"writing {name} as GGUF {config.llama_cpp}")
            paths.append(Path(tmp) / f"{i}.gguf")
            write_model_gguf(name, paths[-1], config.llama_cpp)
        speeds = llamacpp.alternating_speeds(paths, prompt, config.new_tokens, config.repeats, threads)
        return [{"llama_cpp_prompt_tokens_per_s": prompt_tps, "llama_cpp_gen_tokens_per_s": gen_tps,
                 "llama_cpp_file_mb": path.stat().st_size / 2**20, "llama_cpp_threads": threads}
                for path, (prompt_tps, gen_tps) in zip(paths, speeds)]


def markdown(result: dict, labels: list[str] | None = None) -> str:
    c = result["config"]
    mem = c["memory"]
    head = ["model", "params", "weights MB"] + (["peak MB (inference, over loaded)"] if mem else []) + [
        f"prefill s ({c['batch_size']}x{c['seqlen']})", "prefill speed-up",
        f"generation tok/s ({c['batch_size']}x{c['new_tokens']} new)", "generation speed-up"]
    gguf = c.get("llama_cpp")
    if gguf:
        head += [f"llama.cpp {gguf} MB", f"llama.cpp prompt tok/s (1x{c['seqlen']})", "speed-up",
                 f"llama.cpp generation tok/s (1x{c['new_tokens']} new)", "speed-up"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(result["rows"]):
        cells = [labels[i] if labels else r["model"], f"{r['params'] / 1e6:.1f} M ({100 * r['params_ratio']:.0f} %)",
                 f"{r['weights_mb']:.0f}"] + ([f"{r['peak_delta_mb']:.0f}"] if mem else []) + [
            f"{r['prefill_s']:.3f}", f"{r['speedup_prefill']:.2f}x", f"{r['gen_tokens_per_s']:.1f}", f"{r['speedup_gen']:.2f}x"]
        if gguf:
            cells += [f"{r['llama_cpp_file_mb']:.0f}", f"{r['llama_cpp_prompt_tokens_per_s']:.0f}",
                      f"{r['llama_cpp_speedup_prompt']:.2f}x", f"{r['llama_cpp_gen_tokens_per_s']:.1f}",
                      f"{r['llama_cpp_speedup_gen']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


MEASURE_OUTPUT = OutputKind("measure", "pg-prune-measure", (CONFIG_FILE, RESULTS_FILE, TABLE_FILE))


def run_measure(config: MeasureConfig, out: str | Path | None = None, log=lambda m: print(m, file=sys.stderr),
                overwrite: bool = False) -> dict:
    """Measure; with `out` (a new or empty folder, or with overwrite an earlier measure output: outdir's
    rule), write measure_config.json, measure.json and measure.md there."""
    from contextlib import nullcontext

    with output_folder(Path(out), MEASURE_OUTPUT, overwrite) if out is not None else nullcontext():
        return _run_measure(config, out, log)


def _run_measure(config: MeasureConfig, out: str | Path | None, log) -> dict:
    from ..storage.io import atomic_write_text

    result = measure(config, log)
    result["table"] = markdown(result)
    if out is not None:
        out = Path(out)
        atomic_write_text(out / CONFIG_FILE, json.dumps(config.to_dict(), indent=2) + "\n")
        atomic_write_text(out / RESULTS_FILE, json.dumps(result, indent=2) + "\n")
        atomic_write_text(out / TABLE_FILE, result["table"])
    return result


if __name__ == "__main__":  # the memory worker: python -m engine.tools.measure --memory-worker NAME CONFIG_JSON
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if len(sys.argv) == 4 and sys.argv[1] == "--memory-worker":
        import transformers

        transformers.utils.logging.set_verbosity_error()
        print(json.dumps(memory_worker(sys.argv[2], MeasureConfig(**json.loads(sys.argv[3])))))
    else:
        sys.exit("usage: python -m engine.tools.measure --memory-worker NAME CONFIG_JSON (internal; use python -m engine measure)")
