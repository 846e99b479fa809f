"""The masks a page shows, read from what the run wrote: no mask is derived here.

A run has up to three masks to show, each with the keep probabilities that go with it (the heatmap's colour):

- current: the hard mask of the last step, as that step computed it under the run's own budget (StepReport.masks:
  the job's last report, or metrics.jsonl's last line);
- final: the saved mask (masks.safetensors), with the scores it was taken from; results.json says from which step
  (final_mask, mask_step);
- init: the mask the init perplexity measured (masks.safetensors' init_masks; a live job's PruneRun.start_masks).

    views = saved_views(run_dir, results) + live ones     # MaskView per name, in VIEW_ORDER
    kept_units(view.masks)                                 # the "Masks (JSON)" download: kept indices per layer
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..run.state import report_masks
from ..model.unit_types import UNIT_TYPES

CURRENT, FINAL, INIT = "current", "final", "init"
VIEW_ORDER = (FINAL, CURRENT, INIT)  # the first one a run has is shown first


@dataclass
class MaskView:
    name: str  # CURRENT, FINAL or INIT
    label: str  # what the toggle and the download say ("final: best-val, from step 3")
    masks: dict[str, list[list[int]]]  # unit type -> per layer 0/1
    scores: dict[str, list[list[float]]]  # unit type -> per layer keep probability (those the run reports in detail)
    mean_score: dict[str, list[float]]  # unit type -> mean keep probability per layer

    @property
    def head_scores(self) -> list[list[float]] | None:
        """The scores of the unit type the heatmap draws (the first that reports its scores: KV groups)."""
        return next((s for u, s in self.scores.items() if u in UNIT_TYPES and UNIT_TYPES[u].report_scores), None)

    @property
    def head_masks(self) -> list[list[int]] | None:
        return next((m for u, m in self.masks.items() if u in UNIT_TYPES and UNIT_TYPES[u].report_scores), None)


def kept_fractions(masks: dict[str, list[list[int]]]) -> dict[str, list[float]]:
    """Unit type -> fraction of each layer's units the mask keeps."""
    return {u: [sum(row) / len(row) if row else 0.0 for row in rows] for u, rows in masks.items()}


def kept_units(masks: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
    """Unit type -> per layer the indices of the units the mask keeps (whole layers: [0] kept, [] removed)."""
    return {u: [[j for j, k in enumerate(row) if k] for row in rows] for u, rows in masks.items()}


def masks_json(view: MaskView, run_name: str) -> str:
    """The "Masks (JSON)" download: which mask, and the kept units of each unit type, per layer."""
    return json.dumps({"run": run_name, "mask": view.label, "kept_units": kept_units(view.masks),
                       "units_per_layer": {u: [len(r) for r in rows] for u, rows in view.masks.items()}}, indent=1) + "\n"


def mask_source(results: dict | None) -> str | None:
    """Where a finished run's final mask comes from, in words (results.json's final_mask and mask_step)."""
    if not results or "mask_step" not in results:
        return None
    step, how, steps = results.get("mask_step"), results.get("final_mask"), results.get("steps")
    where = "the init mask (step 0)" if step == 0 else f"step {step}" + (f" of {steps}" if steps else "")
    why = {"best-val": "the best held-out perplexity", "last": "the last step"}.get(how, how)
    return f"The final mask is from {where}" + (f" (final mask: {how}, {why})" if how else "") + "."


def _rows(flat, sizes: list[int], cast) -> list[list]:
    out, i = [], 0
    values = flat.tolist()
    for n in sizes:
        out.append([cast(x) for x in values[i:i + n]])
        i += n
    return out


def _detailed(scores: dict[str, list[list[float]]]) -> dict[str, list[list[float]]]:
    return {u: rows for u, rows in scores.items() if u in UNIT_TYPES and UNIT_TYPES[u].report_scores}


def _means(scores: dict[str, list[list[float]]]) -> dict[str, list[float]]:
    return {u: [sum(r) / len(r) if r else 0.0 for r in rows] for u, rows in scores.items()}


def scores_view(name: str, label: str, masks: dict[str, list[list[int]]], scores: dict[str, list[list[float]]]) -> MaskView:
    """A view of masks with their scores per layer (all unit types')."""
    return MaskView(name, label, masks, _detailed(scores), _means(scores))


def saved_views(run_dir: str | Path, results: dict | None = None) -> list[MaskView]:
    """The final and init masks a finished run saved (masks.safetensors and masks.json); none when unreadable."""
    from ..export.artifacts import saved_mask_tensors
    from ..model.unit_types import renamed_units
    from ..run.files import MASKS_FILE, MASKS_META_FILE

    run_dir = Path(run_dir)
    try:
        meta = renamed_units(json.loads((run_dir / MASKS_META_FILE).read_text()))
        tensors = saved_mask_tensors(run_dir / MASKS_FILE)
        sizes = {u: [int(n) for n in meta["units_per_layer"][u]] for u in meta["unit_types"]}
    except Exception:  # a missing, damaged or foreign file: nothing saved to show
        return []
    views = []
    step = (results or {}).get("mask_step")
    for name, mask_key, score_key, label in (
            (FINAL, "masks", "scores", f"final ({(results or {}).get('final_mask') or 'saved'}"
                                       + (f", from step {step})" if step is not None else ")")),
            (INIT, "init_masks", "init_scores", "init (step 0)")):
        try:
            masks = {u: _rows(tensors[f"{mask_key}.{u}"] > 0.5, sizes[u], int) for u in sizes}
            all_scores = {u: _rows(tensors[f"{score_key}.{u}"], sizes[u], float) for u in sizes}
        except (KeyError, ValueError):
            continue  # (a run from before init masks were saved)
        views.append(MaskView(name, label, masks, _detailed(all_scores), _means(all_scores)))
    return views


def current_view(report: dict | None, masks: dict[str, list[list[int]]] | None = None) -> MaskView | None:
    """The last step's hard masks (given, or the report's own), with its KV-group scores; None for a report from
    before reports carried masks."""
    if report is None:
        return None
    masks = masks if masks is not None else report_masks(report)
    if not masks:
        return None
    heads = report.get("head_scores")
    scores = {u: heads for u in masks if heads and u in UNIT_TYPES and UNIT_TYPES[u].report_scores}
    return MaskView(CURRENT, f"current (step {report.get('step')})", masks, scores, dict(report.get("mean_score") or {}))


def ordered(views: list[MaskView | None]) -> list[MaskView]:
    """The views that exist, in VIEW_ORDER, one per name."""
    by_name = {v.name: v for v in views if v is not None}
    return [by_name[n] for n in VIEW_ORDER if n in by_name]
