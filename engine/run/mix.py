"""The joint method's starting mix chosen on the run's model: each candidate count of whole layers out (the pure
kernels: engine/algo/joint.py) scored by the run's reward under its hard mask, as the run would export it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from ..algo.context import KEEP
from ..algo.joint import MIX_FINALISTS, candidate_scores, layer_counts, mix_reward_name, search_counts

if TYPE_CHECKING:  # annotations only
    from .resources import RunResources


def hard_mask_loss(res: "RunResources", masks: dict[str, torch.Tensor], batch: torch.Tensor, comp_means=KEEP,
                   refit: bool = True, reward=None) -> float:
    """The run's reward (--reward: the calibration loss, or the KL to the dense model), or `reward`, of its model
    under one hard mask (with the run's compensation, if any, or with `comp_means`'s means; under --step-refit, refit
    unless refit=False: the model as it is)."""
    return float(res.ctx.rewards({u: m[None] for u, m in masks.items()}, batch, comp_means, refit, reward)[0])


def mix_reward(res: "RunResources"):
    """The reward the joint mix scores its candidates by: the run's own object (its dense targets shared), or
    another reward's."""
    from ..algo.rewards import REWARDS

    name = mix_reward_name(res.config)
    return res.ctx.reward if name == res.config.reward else REWARDS[name]()


def choose_mix(res: "RunResources", z: dict[str, torch.Tensor], batches: list[torch.Tensor], keep: float,
               loss: Callable[[dict[str, torch.Tensor], torch.Tensor], float] | None = None,
               comparable: frozenset[str] = frozenset(), more: list[torch.Tensor] = ()
               ) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """(the initial scores of the mix whose hard mask loses least on `batches`, one line per candidate). With
    `more` batches, the MIX_FINALISTS mixes that lose least on `batches` are compared again on every batch, and
    the one with the lowest mean over `batches` + `more` is chosen (its line gets "loss_refined")."""
    c, budget = res.config, res.budget

    def mean_loss(masks, on: list[torch.Tensor]) -> float:
        if loss is not None:
            return sum(loss(masks, b) for b in on) / len(on)
        if not c.mix_refit:  # (the compensation alone, never --step-refit's refit; the chosen mask is refit at the end)
            return sum(hard_mask_loss(res, masks, b, refit=False, reward=reward) for b in on) / len(on)
        with res.masks.weights(masks) as comp_means:  # (the model the run would export with this mask: one refit a candidate)
            return sum(hard_mask_loss(res, masks, b, comp_means, refit=False, reward=reward) for b in on) / len(on)

    reward = mix_reward(res) if loss is None else None
    if loss is None:  # (kl: the dense model's part on every batch, before a refit edits the weights)
        reward.prepare(res.model, [*batches, *more])
    made: dict[int, tuple] = {}

    def score(k: int) -> float:
        scores = candidate_scores(budget, z, res.layout, k, keep, c, comparable)
        masks = res.masks.hard_masks(scores, keep)
        value = mean_loss(masks, batches)
        removed = int((masks[budget.layer_type] <= 0.5).sum())
        res.log(f"joint mix: {removed} layers removed, the widths of the others cut to the budget: calibration loss {value:.4f}")
        made[k] = (value, removed, scores, masks)
        return value

    counts = layer_counts(budget.layer_params, budget.decoder - budget.kept_target(keep))
    search_counts(counts, score, c.mix_search, MIX_FINALISTS if more else 1)
    res.log(f"joint mix: {len(made)} of {len(counts)} layer counts scored (--mix-search {c.mix_search})")
    candidates, lines = [], []
    for k in sorted(made):  # (one line per count scored, from none up; ties go to the fewer layers out, as before)
        value, removed, scores, masks = made[k]
        lines.append({"layers_removed": removed, "loss": value})
        candidates.append((value, len(lines) - 1, scores, masks))
    candidates.sort(key=lambda cand: (cand[0], cand[1]))
    if more:
        refined = []
        for value, i, scores, masks in candidates[:MIX_FINALISTS]:
            mean = (value * len(batches) + mean_loss(masks, more) * len(more)) / (len(batches) + len(more))
            lines[i]["loss_refined"] = mean
            res.log(f"joint mix: {lines[i]['layers_removed']} layers removed: calibration loss {mean:.4f} on "
                    f"{len(batches) + len(more)} batches")
            refined.append((mean, i, scores, masks))
        candidates = sorted(refined, key=lambda cand: (cand[0], cand[1]))
    return candidates[0][2], lines
