"""A pruned run in llama.cpp: WikiText-2 perplexity and tokens/s of its GGUF exports next to the dense model's.

    python bench/gguf_table.py RUN_DIR [--max-windows 64] [--threads 2] [--new-tokens 64] [--out bench/results/gguf]

Writes, with `python -m engine export`'s code (engine/export/gguf.py), the run's pruned model as GGUF f16 and
q8_0, and the dense base model as GGUF f16 and q8_0 (the same deci writer, every layer whole). Perplexity: the
first --max-windows windows of 128 tokens of WikiText-2 raw test, the windows `engine eval` uses, scored by
llama.cpp (f32 KV cache), beside the transformers figures of the run (results.json). Speed: llama.cpp prompt
processing of one 128-token window and greedy generation of --new-tokens tokens after it, median of --repeats,
with --threads threads, after a warm-up; dense and pruned alternate, so they see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from cli_common import ROOT, positive, run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--max-windows", type=positive(int), default=64)
    p.add_argument("--threads", type=positive(int), default=2)
    p.add_argument("--new-tokens", type=positive(int), default=64)
    p.add_argument("--repeats", type=positive(int), default=3)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "gguf"))
    args = p.parse_args()

    import torch

    from engine.settings.config import PruneConfig
    from engine.data.text import eval_windows, load_eval_text
    from engine.export import export_run
    from engine.export.gguf import write_model_gguf
    from engine.model.loading import load_model, resolve_model
    from engine.tools import llamacpp

    run_dir = Path(args.run_dir)
    results = json.loads((run_dir / "results.json").read_text())
    config = PruneConfig.load(run_dir / "config.json")
    work = Path(tempfile.mkdtemp(prefix="gguf-table-"))
    files = {}
    for outtype in ("f16", "q8_0"):
        files[("pruned", outtype)] = Path(export_run(run_dir, "gguf", work / f"pruned-{outtype}.gguf", outtype)["path"])
    for outtype in ("f16", "q8_0"):
        files[("dense", outtype)] = Path(write_model_gguf(config.model, work / f"dense-{outtype}.gguf", outtype)["path"])
    _, tok = load_model(resolve_model(config.model))
    text, _ = load_eval_text(config.eval_data)
    windows = eval_windows(tok, text, 128, args.max_windows)
    torch.set_num_threads(args.threads)

    ppl = {k: llamacpp.perplexity(f, windows, args.threads, kv_f32=True) for k, f in files.items()}
    prompt = windows[0].tolist()
    load_before = os.getloadavg()[0]
    tps = dict(zip(files, llamacpp.alternating_speeds(list(files.values()), prompt, args.new_tokens, args.repeats,
                                                      args.threads)))

    lines = [f"Run {run_dir.name}: {config.model}, {config.prune_ratio:.0%} of {' + '.join(config.units)}, {config.scope}, "
             f"{config.steps} steps, seed {config.seed}. WikiText-2 raw test, first {windows.shape[0]} windows x 128 "
             f"tokens; llama.cpp (llama-cpp-python) with {args.threads} threads, f32 KV cache; speed: one 128-token "
             f"prompt, then {args.new_tokens} greedy tokens, median of {args.repeats}; load average {load_before:.1f}.",
             "", "| model | file | size (MB) | perplexity in llama.cpp | perplexity in transformers | prompt tok/s | generation tok/s |",
             "|---|---|---|---|---|---|---|"]
    for (which, outtype), f in files.items():
        hf = results["ppl_dense"] if which == "dense" else results["ppl_pruned"]
        lines.append(f"| {which} | {outtype} | {f.stat().st_size / 1e6:.1f} | {ppl[(which, outtype)]:.2f} | "
                     f"{hf:.2f} (float32) | {tps[(which, outtype)][0]:.0f} | {tps[(which, outtype)][1]:.1f} |")
    for outtype in ("f16", "q8_0"):
        d, q = tps[("dense", outtype)], tps[("pruned", outtype)]
        lines.append(f"\nSpeed-up of the pruned {outtype} file: prompt {q[0] / d[0]:.2f} x, generation {q[1] / d[1]:.2f} x.")
    f16_gap = ppl[("pruned", "f16")] / results["ppl_pruned"] - 1
    lines.append(f"The pruned f16 file's perplexity is {f16_gap:+.2%} from the transformers export's.")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{run_dir.name}.md").write_text(table + "\n")
    (out / f"{run_dir.name}.json").write_text(json.dumps({
        "run": str(run_dir), "perplexity_llama_cpp": {f"{a}-{b}": v for (a, b), v in ppl.items()},
        "tokens_per_s": {f"{a}-{b}": v for (a, b), v in tps.items()}, "ppl_transformers": {
            "dense": results["ppl_dense"], "pruned": results["ppl_pruned"]}, "eval_windows": int(windows.shape[0]),
        "sizes_mb": {f"{a}-{b}": f.stat().st_size / 1e6 for (a, b), f in files.items()},
        "load_average": load_before, "threads": args.threads}, indent=1) + "\n")


if __name__ == "__main__":
    run(main)
