"""`--reconstruct`: the final mask's kept columns refit by least squares (engine/reconstruction.py) for the final
evaluation and the export. The statistics are taken once the run starts (a fresh run after its init, a resumed
one again, from the same stream), so --time-budget counts them before it plans the steps."""

from __future__ import annotations

from contextlib import contextmanager

from ..reconstruction import input_moments, reconstructed
from ..unit_types import UNIT_TYPES
from .base import RunHook, register_hook

STREAM = 5  # the statistics' batches: the calibration documents, seeded seed + STREAM


@register_hook
class Reconstruction(RunHook):
    final_evaluations = 1  # the final mask before the refit, for results.json

    @staticmethod
    def applies(config) -> bool:
        return config.reconstruct and any(not UNIT_TYPES[u].whole_layer for u in config.units)

    def on_start(self, state) -> None:
        r, c = self.run, self.run.config
        sampler = r.sampler.reseeded(c.seed + STREAM)
        batches = [sampler.next_batch() for _ in range(c.reconstruct_batches)]
        r.log(f"reconstruction: input statistics of the output projections on {len(batches)} calibration batches")
        self.moments = input_moments(r.adapter, batches, r.layout.unit_types, log=r.log)
        self.report: dict = {}

    @contextmanager
    def final_weights(self, masks, fill):
        r, c = self.run, self.run.config
        before = r.masked_perplexity(masks, "pruned, before reconstruction", fill)
        try:
            with reconstructed(r.adapter, r.layout, masks, self.moments, c.reconstruct_ridge, c.bias_compensation) as refit:
                r.masks.measured.clear()  # (perplexities measured before are of other weights)
                self.report = {"reconstruction": {"ppl_before": before, "batches": c.reconstruct_batches,
                                                  "ridge": c.reconstruct_ridge, "intercept": c.bias_compensation}}
                yield refit
        finally:
            r.masks.measured.clear()

    def results(self) -> dict:
        return self.report
