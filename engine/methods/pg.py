"""Policy gradient (the paper's method): forward passes only.

Each step samples N_s Bernoulli masks m_j ~ s, measures the calibration loss L_j of each masked
model, and estimates d E[L] / d s = mean_j (L_j - baseline) (m_j - s) / (s (1 - s)).
"""

from __future__ import annotations

import torch

from ..masking import MaskHooks
from ..policy import fit_control_coefficients, leave_one_out_baselines, metric_feature, policy_gradient, sample_masks, update_baseline
from . import register_method
from .base import Method, StepGradient


@register_method("pg")
class PolicyGradient(Method):
    def gradient(self, state, batch):
        run, c = self.run, self.run.config
        antithetic = c.mask_sampling == "antithetic"
        samples = {u: sample_masks(s, c.num_mask_samples, run.mask_rng, antithetic) for u, s in state.scores.items()}
        with MaskHooks(run.adapter) as hooks:
            losses = run.sample_losses(hooks, run.layout, batch, samples, run.fill)

        beta, features = None, None
        target = losses
        if c.control_variate == "init-metric":  # subtract the metric's linear loss model (fitted on past steps)
            features = torch.stack([metric_feature(state.init_metric[u].double(), s.double(), samples[u].double())
                                    for u, s in state.scores.items()], 1)  # (N_s, unit types)
            beta = self._control_coefficients(state)
            target = losses - features @ beta

        if c.baseline == "moving-average":
            state.baseline = update_baseline(state.baseline, float(target.mean()), c.baseline_window)
            baseline, shown = state.baseline, state.baseline
        elif c.baseline == "leave-one-out":
            baseline, shown = leave_one_out_baselines(target), float(target.mean())
        else:
            baseline, shown = 0.0, 0.0

        grads = {u: policy_gradient(s.double(), samples[u].double(), target, baseline, c.estimator, c.estimator_clamp)
                 for u, s in state.scores.items()}
        if beta is not None:
            for k, u in enumerate(state.scores):  # + beta dE[h]/ds, h(m) = -sum z m: keeps the estimate unbiased
                grads[u] = grads[u] - beta[k] * state.init_metric[u].double()
            self._update_control_moments(state, features, losses)
        return StepGradient(losses, grads, shown)

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
