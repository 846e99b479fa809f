"""`--reconstruct`: a hard mask's kept columns refit by least squares (engine/reconstruction.py) wherever the run
evaluates a mask it would export: the joint mix's candidates (so the mix is the one that loses least once refit),
the final mask's evaluation and its export; the final mask is also evaluated without the refit, for results.json.
The statistics are the dense model's, from a calibration stream of their own (seed + 5), taken once a run
(a resumed one takes them again, from the same stream)."""

from __future__ import annotations

from contextlib import contextmanager

from ..reconstruction import available_memory, input_moments, moments_bytes, reconstructed
from ..unit_types import UNIT_TYPES, layer_unit_types
from .base import RunHook, register_hook

STREAM = 5  # the statistics' batches: the calibration documents, seeded seed + STREAM


@register_hook
class Reconstruction(RunHook):
    final_evaluations = 1  # the final mask before the refit, for results.json

    @staticmethod
    def applies(config) -> bool:
        return config.reconstruct and any(not UNIT_TYPES[u].whole_layer for u in config.units)

    def on_setup(self) -> None:
        r = self.run
        need, free = moments_bytes(r.adapter, r.layout.unit_types), available_memory()
        self.moments, self.skipped = None, None
        offloaded = any(t.output_proj(r.adapter, i).weight.device.type == "meta" for t in layer_unit_types()
                        for i in range(r.adapter.num_layers))
        if offloaded:  # (accelerate's offload: the weights live elsewhere and cannot be edited in place)
            self.skipped = "the model is offloaded (--device auto), and its weights cannot be refit in place"
        elif free is not None and need > free // 2:  # (a 7B model's MLP moments alone are about 15 GiB)
            self.skipped = (f"its input statistics need {need / 2**30:.1f} GiB, more than half of the "
                            f"{free / 2**30:.1f} GiB available")
        if self.skipped:
            r.log(f"reconstruction skipped: {self.skipped} (--no-reconstruct silences this)")

    def statistics(self):
        """The moments of the output projections' inputs on the dense model, taken at the first need (the joint
        mix's candidates, or the start of the steps, so that --time-budget counts them before it plans)."""
        if self.moments is None and self.skipped is None:
            r, c = self.run, self.run.config
            sampler = r.sampler.reseeded(c.seed + STREAM)
            batches = [sampler.next_batch() for _ in range(c.reconstruct_batches)]
            r.log(f"reconstruction: input statistics of the output projections on {len(batches)} calibration batches")
            self.moments = input_moments(r.adapter, batches, r.layout.unit_types, log=r.log)
        return self.moments

    def before_scores(self, batches) -> None:
        self.statistics()  # (on the dense model: before anything is masked)

    def on_start(self, state) -> None:
        self.statistics()

    def final_masks(self, masks, metric):
        if self.skipped is None:
            self.before = self.run.masked_perplexity(masks, "pruned, before reconstruction")
        return masks

    @contextmanager
    def weights_for(self, masks, fill):
        r, c = self.run, self.run.config
        if self.skipped is not None:
            yield fill
            return
        try:
            with reconstructed(r.adapter, r.layout, masks, self.statistics(), c.reconstruct_ridge,
                               c.bias_compensation) as refit:
                r.masks.measured.clear()  # (perplexities measured before are of other weights)
                yield refit
        finally:
            r.masks.measured.clear()

    def results(self) -> dict:
        c = self.run.config
        if self.skipped is not None:
            return {"reconstruction": {"skipped": self.skipped}}
        return {"reconstruction": {"ppl_before": self.before, "batches": c.reconstruct_batches,
                                   "ridge": c.reconstruct_ridge, "intercept": c.bias_compensation}}
