"""`--reconstruct`: a hard mask's kept columns refit by least squares (engine/reconstruction.py) wherever the run
evaluates a mask it would export: the joint mix's candidates (so the mix is the one that loses least once refit),
the final mask's evaluation and its export; the final mask is also evaluated without the refit, for results.json.
The statistics are the dense model's, from a calibration stream of their own (seed + 5), taken once a run
(a resumed one takes them again, from the same stream); under --time-budget they stop at a third of the time
left when they start (at least 8 batches), and results.json records the batches used."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

from ..reconstruction import available_memory, input_moments, moments_bytes, reconstructed
from ..unit_types import UNIT_TYPES, layer_unit_types
from .base import RunHook
from .time_budget import share_of_time_left

STREAM = 5  # the statistics' batches: the calibration documents, seeded seed + STREAM
STATISTICS_SHARE = 1 / 3  # --time-budget: the statistics take at most this share of the time left when they start
MIN_BATCHES = 8  # ... and never fewer batches than this (or --reconstruct-batches, if fewer)


class Reconstruction(RunHook):
    final_evaluations = 1  # the final mask before the refit, for results.json

    @staticmethod
    def applies(config) -> bool:
        return config.reconstruct and any(not UNIT_TYPES[u].whole_layer for u in config.units)

    def on_setup(self) -> None:
        r = self.run
        need, free = moments_bytes(r.adapter, r.layout.unit_types), available_memory()
        self.moments, self.skipped, self.batches = None, None, 0
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
        """The moments of the output projections' inputs on the dense model, taken before the init scores (the
        joint mix's candidates are refit) or, resuming, before the steps (--time-budget's step times must not
        include them); under --time-budget they take at most STATISTICS_SHARE of the time left."""
        if self.moments is None and self.skipped is None:
            r, c = self.run, self.run.config
            sampler = r.sampler.reseeded(c.seed + STREAM)
            batches = [sampler.next_batch() for _ in range(c.reconstruct_batches)]
            r.log(f"reconstruction: input statistics of the output projections on {len(batches)} calibration batches")
            stop = share_of_time_left(r, STATISTICS_SHARE, min(MIN_BATCHES, len(batches)))
            with r.phases("refit statistics"):
                self.moments = input_moments(r.adapter, batches, r.layout.unit_types, log=r.log, stop=stop)
            self.batches = next(iter(self.moments.values()))[2] // batches[0].numel() if self.moments else 0
        return self.moments

    def before_scores(self, batches) -> None:
        self.statistics()  # (on the dense model: before anything is masked)

    def on_resume(self, state) -> None:
        self.statistics()  # (before the steps: --time-budget's step times must not include them)

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
        with ExitStack() as stack:  # (RunMasks.weights sets the unedited weights' perplexities aside: edits_weights)
            moments = self.statistics()
            with r.phases("refit"):  # (the solves; the weights are restored on leaving)
                refit = stack.enter_context(reconstructed(r.adapter, r.layout, masks, moments, c.reconstruct_ridge,
                                                          c.bias_compensation))
            yield refit

    @property
    def edits_weights(self) -> bool:  # (a skipped refit leaves the weights as they are)
        return self.skipped is None

    def results(self) -> dict:
        c = self.run.config
        if self.skipped is not None:
            return {"reconstruction": {"skipped": self.skipped}}
        return {"reconstruction": {"ppl_before": self.before, "batches": self.batches,
                                   "ridge": c.reconstruct_ridge, "intercept": c.bias_compensation}}
