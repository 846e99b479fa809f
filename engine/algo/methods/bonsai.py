"""Bonsai (Dery et al., 2024, "Everybody prune now"), written from the paper: forward passes only, like policy
gradient, and on the same footing (the run's calibration stream, its executor, N_s masked forwards a step), so
the two compare at equal compute.

The run's steps are split into rounds. In a round, every step samples N_s sub-models: each unit still alive is
kept with probability q, the share of the alive units' count the target keeps (sub-models at the target
sparsity), pruned units never. At the end of the round a ridge regression of the sampled losses on the masks
gives every alive unit an importance (how much the loss falls when it is kept), and the least important are
pruned, so that the alive units shrink from all of them to the target over the rounds. The method's scores
are q for alive units and 0 for pruned ones, so the run's projection leaves them on the budget, and the final
hard mask keeps the alive units.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import UserError
from ...settings.fields import setting
from ..policy import sample_masks
from .base import Method, StepGradient
from .registry import register_method


def regression_importance(masks: torch.Tensor, losses: torch.Tensor, ridge: float) -> torch.Tensor:
    """(samples, units) 0/1 masks and their losses -> each unit's importance, -beta of the ridge regression
    loss ~ masks @ beta + c (centred; solved in the dual, (samples x samples), since units may far outnumber
    samples): higher = keeping the unit lowers the loss more."""
    x = masks.double() - masks.double().mean(0)
    y = losses.double() - losses.double().mean()
    gram = x @ x.T + ridge * torch.eye(x.shape[0], dtype=torch.float64)
    beta = x.T @ torch.linalg.solve(gram, y)
    return -beta


def alive_targets(totals: dict[str, int], keep: float, rounds: int) -> list[dict[str, int]]:
    """Per round, the units each type keeps alive after it: from all of them down to the target, evenly."""
    out = []
    for r in range(1, rounds + 1):
        out.append({u: max(1, round(n - (n - n * keep) * r / rounds)) for u, n in totals.items()})
    return out


@dataclass
class BonsaiOptions:
    rounds: int = setting(5, minimum=1, label="Rounds",
                          help="rounds of sampling, regression and pruning; the run's steps are split evenly between them")
    ridge: float = setting(1.0, label="Ridge",
                           help="the regression's L2 regularisation (on 0/1 masks, centred)")

    def validate(self, config=None) -> None:
        if not self.ridge > 0:
            raise UserError(f"bonsai ridge must be positive, got {self.ridge}")
        steps = getattr(config, "steps", None)
        if steps is not None and steps < self.rounds:
            raise UserError(f"bonsai needs at least one step per round: steps {steps} < rounds {self.rounds}")


@register_method("bonsai")
class Bonsai(Method):
    Options = BonsaiOptions
    # forward passes only (its init mask, a Wanda-sp one, is a reference, not its start); the last round's mask
    # is its result (a mid-round hard mask is a tie among alive units, so validating it means nothing)
    implies = {"init": "wanda-sp", "final_mask": "last", "val_every": 0}

    def gradient(self, state, batch):
        ctx, m = self.ctx, state.method_state
        if "alive" not in m:  # the first step: every unit alive
            m.update(alive={u: torch.ones_like(s, dtype=torch.bool) for u, s in state.scores.items()}, round=0,
                     masks=[], losses=[])
        probs = self._probabilities(state)
        samples = {u: sample_masks(p, ctx.num_samples, ctx.rng) for u, p in probs.items()}
        losses = ctx.rewards(samples, batch)
        m["masks"].append({u: x.to(torch.bool) for u, x in samples.items()})
        m["losses"].append(losses.detach().double())
        if self._round_ends(state.step + 1):
            self._prune(state)
        return StepGradient(losses, {u: torch.zeros_like(s, dtype=torch.float64) for u, s in state.scores.items()},
                            float(losses.mean()))

    @classmethod
    def progress(cls, config: dict, step: int) -> str | None:
        """"round r of R, n sub-models sampled in it" (the app's progress line)."""
        rounds = int((config.get("method_options") or {}).get("rounds", BonsaiOptions.rounds))
        steps, n_s = int(config.get("steps", 1)), int(config.get("num_mask_samples", 1))
        ends = [(r * steps) // rounds for r in range(1, rounds + 1)]
        r = next((k for k, end in enumerate(ends) if step < end), rounds - 1)
        start = ends[r - 1] if r else 0
        return f"round {r + 1} of {rounds}: {(step - start) * n_s} sub-models sampled in it"

    def next_scores(self, state, grads, lr):
        return self._probabilities(state)

    # --- rounds --------------------------------------------------------------------------------------
    def _round_ends(self, step: int) -> bool:
        rounds, steps = self.options.rounds, self.ctx.steps
        return any(step == (r * steps) // rounds for r in range(1, rounds + 1))

    def _targets(self, state) -> list[dict[str, int]]:
        keep = state.method_state.get("keep", None)
        totals = {u: s.numel() for u, s in state.scores.items()}
        return alive_targets(totals, keep if keep is not None else self._keep(state), self.options.rounds)

    def _keep(self, state) -> float:
        """The target's keep share of each type's count: what the run's initial scores keep in expectation."""
        keep = float(sum(float(s.sum()) for s in state.init_scores.values()) /
                     sum(s.numel() for s in state.init_scores.values()))
        state.method_state["keep"] = keep
        return keep

    def _probabilities(self, state) -> dict[str, torch.Tensor]:
        """q for every alive unit (the target's share of the alive count), 0 for the pruned."""
        m, out = state.method_state, {}
        keep = m.get("keep") if m.get("keep") is not None else self._keep(state)
        for u, alive in m["alive"].items():
            q = min(1.0, keep * alive.numel() / max(int(alive.sum()), 1))
            out[u] = torch.where(alive, torch.full(alive.shape, q), torch.zeros(alive.shape)).to(state.scores[u].dtype)
        return out

    def _prune(self, state) -> None:
        m = state.method_state
        target = self._targets(state)[min(m["round"], self.options.rounds - 1)]
        losses = torch.cat(m["losses"])
        for u, alive in m["alive"].items():
            masks = torch.cat([x[u] for x in m["masks"]]).double()
            idx = torch.nonzero(alive).flatten()
            importance = regression_importance(masks[:, idx], losses, self.options.ridge)
            drop = int(alive.sum()) - target[u]
            if drop > 0:
                alive[idx[torch.argsort(importance, stable=True)[:drop]]] = False
        m.update(round=m["round"] + 1, masks=[], losses=[])
