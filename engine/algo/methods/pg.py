"""Policy gradient (the paper's method): forward passes only.

Each step samples N_s Bernoulli masks m_j ~ s, measures the calibration loss L_j of each masked
model, and estimates d E[L] / d s = mean_j (L_j - baseline) (m_j - s) / (s (1 - s)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import UserError
from ...settings.fields import setting
from ..policy import (block_means, fit_control_coefficients, leave_one_out_baselines, metric_feature,
                      policy_gradient, rank_blocks, sample_masks, update_baseline)
from ...model.unit_types import UNIT_TYPES
from .registry import register_method
from .base import Method, StepGradient


def _moving_average(state, target, options):
    state.baseline = update_baseline(state.baseline, float(target.mean()), options.baseline_window)
    return state.baseline, state.baseline


# baseline name -> (state, this step's losses, options) -> (the baseline subtracted: a float or one per sample,
# the value reported); the moving average's running value lives in the run state (checkpointed)
BASELINE_FNS = {
    "moving-average": _moving_average,
    "leave-one-out": lambda state, target, options: (leave_one_out_baselines(target), float(target.mean())),
    "none": lambda state, target, options: (0.0, 0.0),
}
BASELINES = tuple(BASELINE_FNS)
ESTIMATORS = ("paper", "sqrt")
MASK_SAMPLINGS = ("independent", "antithetic")
CONTROL_VARIATES = ("none", "init-metric")


@dataclass
class PGOptions:
    """Policy gradient's own settings (their CLI flags keep the short names they always had)."""

    baseline: str = setting("leave-one-out", choices=BASELINES, flag="--baseline", label="Baseline",
                            help="variance-reducing baseline: moving-average (window T), leave-one-out (mean loss of "
                                 "the other samples of the batch), none")
    baseline_window: int = setting(5, minimum=1, flag="--baseline-window", label="Baseline window T",
                                   help="T of the moving-average baseline")
    estimator: str = setting("paper", choices=ESTIMATORS, flag="--estimator", label="Estimator",
                             help="paper: (m-s)/(s(1-s)); sqrt: the reference code's (m-s)/sqrt(s(1-s))/(N_s-1)")
    estimator_clamp: float = setting(0.01, flag="--estimator-clamp", label="Estimator clamp",
                                     help="s clamped to [c, 1-c] in the estimator's denominator only")
    mask_sampling: str = setting("independent", choices=MASK_SAMPLINGS, flag="--mask-sampling", label="Mask sampling",
                                 help="independent, or antithetic pairs (u, 1 - u) (needs an even N_s)")
    control_variate: str = setting("none", choices=CONTROL_VARIATES, flag="--control-variate", label="Control variate",
                                   help="init-metric: subtract a linear loss model of the init metric, fitted online, "
                                        "from the losses and add its exact gradient back (unbiased)")
    unit_block: int = setting(1, minimum=1, flag="--unit-block", label="Unit block", help=(
        "B > 1: the units of a type with at least 2B per layer (MLP channels) are sampled and learned in blocks of B "
        "neighbours in the init's ranking within their layer (kept and dropped apart), one keep probability a block: "
        "fewer, larger units for the estimate; 1: every unit alone"))

    def validate(self, config=None) -> None:
        n = getattr(config, "num_mask_samples", None)
        if not 0.0 < self.estimator_clamp < 0.5:
            raise UserError(f"estimator clamp must be in (0, 0.5), got {self.estimator_clamp}")
        if n is None:
            return
        if self.estimator == "sqrt" and n < 2:
            raise UserError("the sqrt estimator needs at least 2 mask samples per step")
        if self.baseline == "leave-one-out" and n < 2:
            raise UserError("the leave-one-out baseline needs at least 2 mask samples per step")
        if self.unit_block > 1 and self.control_variate != "none":
            raise UserError("the init-metric control variate works on single units: use --unit-block 1 with it")
        if self.mask_sampling == "antithetic" and n % 2:
            raise UserError(f"antithetic mask sampling draws pairs: num mask samples must be even, got {n}")


@register_method("pg")
class PolicyGradient(Method):
    Options = PGOptions

    def gradient(self, state, batch):
        ctx, c = self.ctx, self.options
        antithetic = c.mask_sampling == "antithetic"
        blocks = self._blocks(state)  # unit type -> (units,) block ids, for the types sampled in blocks
        policy = {u: block_means(s.double(), blocks[u]).to(s.dtype) if u in blocks else s for u, s in state.scores.items()}
        drawn = {u: sample_masks(s, ctx.num_samples, ctx.rng, antithetic) for u, s in policy.items()}
        samples = {u: m[:, blocks[u]] if u in blocks else m for u, m in drawn.items()}
        losses = ctx.rewards(samples, batch)

        beta, features = None, None
        target = losses
        if c.control_variate == "init-metric":  # subtract the metric's linear loss model (fitted on past steps)
            features = torch.stack([metric_feature(state.init_metric[u].double(), s.double(), samples[u].double())
                                    for u, s in state.scores.items()], 1)  # (N_s, unit types)
            beta = self._control_coefficients(state)
            target = losses - features @ beta

        baseline, shown = BASELINE_FNS[c.baseline](state, target, c)

        grads = {u: policy_gradient(s.double(), drawn[u].double(), target, baseline, c.estimator, c.estimator_clamp)
                 for u, s in policy.items()}
        grads = {u: g[blocks[u]] if u in blocks else g for u, g in grads.items()}  # a block's estimate, to each unit
        if beta is not None:
            for k, u in enumerate(state.scores):  # + beta dE[h]/ds, h(m) = -sum z m: keeps the estimate unbiased
                grads[u] = grads[u] - beta[k] * state.init_metric[u].double()
            self._update_control_moments(state, features, losses)
        return StepGradient(losses, grads, shown)

    def _blocks(self, state) -> dict[str, torch.Tensor]:
        """--unit-block B: each wide unit type's blocks (engine.algo.policy.rank_blocks), made at the first step from the
        scores and hard mask it starts from, when every unit's score becomes its block's mean (the projection moves
        a block's units together from then on) plus a spread of 1e-4 in the init's order inside the block, which
        only breaks the final mask's ties. Kept in the run state (checkpointed)."""
        if self.options.unit_block <= 1:
            return {}
        if "blocks" not in state.method_state:
            layout, b = self.ctx.layout, self.options.unit_block
            wide = [u for u in state.scores if not UNIT_TYPES[u].whole_layer and max(layout.sizes[u]) >= 2 * b]
            hard, blocks = self.ctx.hard_masks(state.scores), {}
            for u in wide:
                s = state.scores[u].double()
                ids = rank_blocks(s, hard[u], layout.sizes[u], b)
                rank = torch.empty_like(s)  # each unit's place in its block, from -0.5 (lowest score) to 0.5
                for k in range(int(ids.max()) + 1):
                    members = torch.nonzero(ids == k).flatten()
                    order = members[torch.sort(s[members], stable=True).indices]
                    rank[order] = torch.linspace(-0.5, 0.5, order.numel(), dtype=s.dtype) if order.numel() > 1 else 0.0
                state.scores[u] = (block_means(s, ids)[ids] + 1e-4 * rank).clamp(0.0, 1.0).to(state.scores[u].dtype)
                blocks[u] = ids
            state.method_state["blocks"] = blocks
        return state.method_state["blocks"]

    # --- the control variate's running moments (kept in the checkpoint with the run state) ---------
    def _control_coefficients(self, state) -> torch.Tensor:
        m = state.method_state.get("control_moments")
        if m is None or m["count"] < 2:
            return torch.zeros(len(state.scores), dtype=torch.float64)
        return fit_control_coefficients(m["ff"], m["fa"])

    def _update_control_moments(self, state, features: torch.Tensor, losses: torch.Tensor, decay: float = 0.95) -> None:
        """Running second moments of (feature, loss centred in its batch), for the next step's beta."""
        a = losses - losses.mean()
        ff = features.T @ features / features.shape[0]
        fa = features.T @ a / features.shape[0]
        m = state.method_state.get("control_moments")
        if m is not None:
            ff, fa = decay * m["ff"] + (1 - decay) * ff, decay * m["fa"] + (1 - decay) * fa
        state.method_state["control_moments"] = {"ff": ff, "fa": fa, "count": 1 if m is None else m["count"] + 1}
