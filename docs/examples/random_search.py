"""A whole pruning method in one file, written outside the engine: random search.

Each step samples N_s masks around the current keep probabilities, measures each masked model's loss on the
calibration batch, and pulls the probabilities toward the mask that did best. Forward passes only, like policy
gradient, but with no estimator: a toy for the "add a method" walkthrough (docs/architecture.md).

Register it by running this file before the engine parses its flags, from the repository root:

    python -c "import runpy, sys; runpy.run_path('docs/examples/random_search.py'); from engine.cli import main; \\
               sys.exit(main())" prune --method random-search --random-search-pull 0.5 --out runs/rs
"""

from dataclasses import dataclass

import torch

from engine.settings.fields import setting
from engine.algo.methods import Method, StepGradient, register_method
from engine.algo.policy import sample_masks


@dataclass
class RandomSearchOptions:  # every field becomes a flag --random-search-FIELD and a widget in the app
    pull: float = setting(1.0, minimum=0.0, label="Pull toward the best mask",
                          help="how far one step moves s toward the best sampled mask (times the learning rate)")


@register_method("random-search")
class RandomSearch(Method):
    Options = RandomSearchOptions

    def gradient(self, state, batch):
        ctx = self.ctx  # a StepContext: the model's layout, the executor, the mask rng, N_s; never the run
        samples = {u: sample_masks(s, ctx.num_samples, ctx.rng) for u, s in state.scores.items()}
        losses = ctx.losses(samples, batch)  # (N_s,) one masked forward each
        best = int(torch.argmin(losses))
        # the run takes s <- proj(s - lr * g): g = -(best - s) * pull moves s toward the best mask
        grads = {u: -self.options.pull * (samples[u][best].double() - s.double()) for u, s in state.scores.items()}
        return StepGradient(losses, grads, float(losses.mean()))
