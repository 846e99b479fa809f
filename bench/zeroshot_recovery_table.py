"""Print the zero-shot, recovery and deployment table (docs/results.md) from the run folders that
bench/zeroshot_recovery.sh fills (missing figures: "n/a").

    python bench/zeroshot_recovery_table.py [--runs runs]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TASKS = ("piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge")


def load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", default="runs")
    runs = Path(p.parse_args().runs)
    z = runs / "zeroshot_recovery"
    rows = []
    prune = {r: load(runs / f"pg{r}" / "results.json") for r in (30, 50)}
    ft = {r: load(runs / f"pg{r}-ft" / "finetune_results.json") for r in (30, 50)}
    dense_ppl = next((v["ppl_dense"] for v in prune.values() if v), None)
    dense_params = next((v["params_dense"] for v in prune.values() if v), None)
    rows.append(("dense", "0 %", dense_ppl, load(z / "zs-dense" / "zeroshot.json"), dense_params))
    for r in (30, 50):
        rows.append((f"PG {r} %", "no", prune[r] and prune[r]["ppl_pruned"], load(z / f"zs-pg{r}" / "zeroshot.json"),
                     prune[r] and prune[r]["params_pruned"]))
        rows.append((f"PG {r} % + LoRA", "yes", ft[r] and ft[r].get("ppl_after"), load(z / f"zs-pg{r}-ft" / "zeroshot.json"),
                     ft[r] and ft[r]["params"]))
    limit = next((row[3]["limit"] for row in rows if row[3]), None)
    metric = {t: "acc_norm" if t in ("hellaswag", "arc_challenge") else "acc" for t in TASKS}
    head = ["model", "recovery", "params", "WikiText-2 ppl (64x128)"] + [f"{t} ({metric[t]})" for t in TASKS] + ["average"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, rec, ppl, zs, params in rows:
        cells = [name, "-" if name == "dense" else rec, f"{params / 1e6:.1f} M" if params else "n/a", f"{ppl:.2f}" if ppl else "n/a"]
        cells += [f"{100 * zs['tasks'][t]['score']:.1f}" if zs else "n/a" for t in TASKS]
        cells.append(f"{100 * zs['average']:.1f}" if zs else "n/a")
        print("| " + " | ".join(cells) + " |")
    print(f"\nZero-shot: first {limit} documents of each task (lm-eval --limit {limit}).")
    m = load(z / "measure" / "measure.json")
    if m:
        print()
        print((z / "measure" / "measure.md").read_text(), end="")


if __name__ == "__main__":
    main()
