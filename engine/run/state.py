"""The state of a run that a checkpoint holds, the report of one step, and the finiteness check both pass."""

from __future__ import annotations

import math
import resource
from dataclasses import asdict, dataclass, field

import torch

from ..errors import UserError
from ..storage.io import dumps_json


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@dataclass
class StepReport:
    """What one optimisation step did; sent to observers and written to metrics.jsonl."""

    step: int  # 1-based count of steps done
    total_steps: int
    losses: list[float]  # L_j of each mask sample: its reward's value (`reward` says which: kl, a mean KL in nats)
    baseline: float  # delta after this step's update (0 when the baseline is off), in the same reward
    lr: float
    mean_score: dict[str, list[float]]  # unit type -> mean s per layer
    kept_fraction: dict[str, list[float]]  # unit type -> fraction kept per layer by the current hard mask
    head_scores: list[list[float]] | None  # s of every KV group, per layer (small; for heatmaps)
    seconds: float  # wall time of this step
    eta_seconds: float
    val_ppl: float | None = None  # held-out perplexity of the current hard mask, on validation steps
    keep_ratio: float | None = None  # the budget this step (rises in stages under random-progressive)
    val_reward: float | None = None  # the reward's held-out value on validation steps, when it is not ce (kl: mean KL)
    # the hard masks this step computed under the run's own budget (this step's keep ratio, every hook's rounding):
    # unit type -> per layer a 0/1 list; metrics.jsonl holds them as encode_mask_rows' compact strings
    masks: dict[str, list[list[int]]] | None = None
    reward: str | None = None  # what losses and baseline hold: the run's --reward (ce, kl; None: a line from before)

    def to_json(self) -> str:
        data = asdict(self)
        if self.masks is not None:
            data["masks"] = {u: encode_mask_rows(rows) for u, rows in self.masks.items()}
        return dumps_json(data, what=f"step {self.step}")


def mask_rows(layout, masks: dict[str, torch.Tensor]) -> dict[str, list[list[int]]]:
    """Flat hard masks (unit type -> 0/1 tensor over all layers) as per-layer 0/1 lists."""
    return {u: [[int(x) for x in (m > 0.5).tolist()] for m in layout.split(u, flat)] for u, flat in masks.items()}


def encode_mask_rows(rows: list[list[int]]) -> list[str]:
    """Per-layer 0/1 lists as compact strings, one per layer: "N:HEX", N units, the bits in hex, unit 0 the
    first nibble's high bit ([1,1,0,1] -> "4:d"; 1,536 MLP channels take 389 characters)."""
    out = []
    for row in rows:
        bits = "".join("1" if x else "0" for x in row)
        bits += "0" * (-len(bits) % 4)
        out.append(f"{len(row)}:" + "".join(format(int(bits[i:i + 4], 2), "x") for i in range(0, len(bits), 4)))
    return out


def decode_mask_rows(encoded: list) -> list[list[int]]:
    """encode_mask_rows' strings back to per-layer 0/1 lists (lists pass through as they are)."""
    rows = []
    for layer in encoded:
        if isinstance(layer, list):
            rows.append([int(x) for x in layer])
            continue
        n, _, hexits = str(layer).partition(":")
        bits = "".join(format(int(h, 16), "04b") for h in hexits)
        rows.append([int(b) for b in bits[:int(n)]])
    return rows


def report_masks(report: dict) -> dict[str, list[list[int]]] | None:
    """The hard masks of a StepReport dict (a metrics.jsonl line or a live report), per unit type and layer;
    None for a line written before reports carried them."""
    masks = report.get("masks")
    if not isinstance(masks, dict):
        return None
    return {u: decode_mask_rows(rows) for u, rows in masks.items()}


@dataclass
class RunState:
    step: int
    scores: dict[str, torch.Tensor]
    baseline: float | None
    sampler_state: dict
    mask_rng_state: torch.Tensor
    ppl_dense: float
    ppl_init: float | None  # None: not evaluated (PruneConfig.evaluates_init)
    init_scores: dict[str, torch.Tensor]
    seconds_in_steps: float = 0.0
    init_metric: dict[str, torch.Tensor] | None = None  # the standardized init metric (method metric ranks it)
    # what the init mask is cut from: the init metric (None), or under --budget params the initial probabilities
    # (z-scores of different unit types are not on one scale; the probabilities hold each type's share)
    init_mask_scores: dict[str, torch.Tensor] | None = None
    init_mix: list[dict] | None = None  # the joint method: each candidate mix of layers and widths and its loss
    method_state: dict = field(default_factory=dict)  # what a method carries from step to step (pg: control moments)
    config: dict | None = None  # the run's config when saved: --resume refuses a config.json edited since
    last_report: str | None = None  # metrics.jsonl's line of this step, restored on resume if that line was lost
    # each hook's own data, {hook name: {key: value}}: the one part of the state a hook writes (RunHook.own), read
    # elsewhere through the read-only properties below (HOOK_DATA says which hook owns a key)
    hooks: dict = field(default_factory=dict)

    def hook_data(self, key: str):
        """A hook's datum, None when its hook did not run or wrote nothing."""
        return self.hooks.get(HOOK_DATA[key], {}).get(key)

    best_val = property(lambda self: self.hook_data("best_val"))  # best-val's best held-out value so far (the
    # reward's: a perplexity under ce, the mean KL under kl; results.json names which), its step and scores
    best_step = property(lambda self: self.hook_data("best_step"))
    best_scores = property(lambda self: self.hook_data("best_scores"))
    val_ppl_init = property(lambda self: self.hook_data("val_ppl_init"))  # held-out perplexity of the init mask
    input_means = property(lambda self: self.hook_data("input_means"))  # bias compensation: each column's mean input
    stopped_early = property(lambda self: self.hook_data("stopped_early"))  # --early-stop: the step it stopped at
    worlds = property(lambda self: self.hook_data("worlds"))  # data-parallel runs: [{from_step, world_size}]
    time_used = property(lambda self: self.hook_data("time_used"))  # --time-budget: wall seconds at the last step


# the hooks' data the rest of the run reads: key -> the hook (its module's name) that owns and writes it. A
# checkpoint written before RunState.hooks holds these keys at its top level; Checkpoints.load moves them in.
HOOK_DATA = {"best_val": "validation", "best_step": "validation", "best_scores": "validation",
             "val_ppl_init": "validation", "input_means": "compensation", "stopped_early": "early_stop",
             "worlds": "ranks", "time_used": "time_budget"}


def check_finite(where: str, scores: dict[str, torch.Tensor], values: dict[str, float]) -> None:
    """Raise UserError naming `where` and the first non-finite value or score."""
    for name, x in values.items():
        if not math.isfinite(x):
            raise UserError(f"{where}: the {name} is {x}; stopped (the checkpoint holds the last finite state; "
                            "a lower --lr or another --seqlen/--dtype may help)")
    for u, t in scores.items():
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            raise UserError(f"{where}: {int(bad.sum())} {u} scores are not finite (first at index "
                            f"{int(bad.nonzero()[0])}); stopped (a lower --lr may help)")
