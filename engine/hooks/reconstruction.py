"""`--reconstruct`: a hard mask's kept columns refit by least squares (engine/algo/reconstruction.py) wherever the run
evaluates a mask it would export: the joint mix's candidates (so the mix is the one that loses least once refit),
the final mask's evaluation and its export; the final mask is also evaluated without the refit, for results.json.
The statistics are the dense model's, on the first --reconstruct-batches batches of the init stream, read in the
run's one statistics pass with the init metric's (engine/algo/statistics.py; a resumed run reads the same batches
again, alone; --refit-stream own: a stream of their own, seed + 5, as runs before the one pass read). Under
--time-budget they stop at a third of the time left when they start in a run that takes steps, and where the
plan's later phases need the rest in one that takes none (at least 8 batches): the run says so in its log, in
results.json ("reduced") and in the plan before it starts (engine/plan/forecast.py)."""

from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager

from ..algo.reconstruction import InputMoments, available_memory, moments_bytes, reconstructed
from ..model.precision import run_passes
from ..algo.statistics import init_stream, one_pass
from ..model.unit_types import UNIT_TYPES, layer_unit_types
from .base import RunHook
from .time_budget import allowed_seconds, share_of_time_left

STREAM = 5  # the statistics' batches: the calibration documents, seeded seed + STREAM
STATISTICS_SHARE = 1 / 3  # --time-budget: the statistics take at most this share of the time left when they start
MIN_BATCHES = 8  # ... and never fewer batches than this (or --reconstruct-batches, if fewer)
# a run that takes no steps (a one-shot method: the default preset's run) has nothing to leave the time to: its
# statistics may take all of it but what its plan's later phases need, this much more than planned
LATER_MARGIN = 1.25
# the plan's phases before the statistics, the statistics' own and the sums (engine/run/plan.py's "other", "total");
# every other phase of the plan comes after them
NOT_LATER = ("load", "calibration text", "loading", "data and export", "statistics", "refit statistics", "other",
             "total")


def statistics_allowance(steps: bool, plan: dict[str, float] | None) -> tuple[float, float]:
    """(share, reserve): under --time-budget the statistics may take `share` of the time left when they start, less
    `reserve` seconds, and never less than STATISTICS_SHARE of it (time_budget.allowed_seconds). A run that takes steps:
    STATISTICS_SHARE (the steps get the rest); one that takes none: all of it but LATER_MARGIN times what its plan
    gives the phases after the statistics (the init metric, the joint mix, the evaluations, the export); with no
    plan, the share as for steps."""
    if steps or not plan:
        return STATISTICS_SHARE, 0.0
    return 1.0, LATER_MARGIN * sum(v for k, v in plan.items() if k not in NOT_LATER)


def batches_within_share(n: int, per_batch: float, seconds_left: float, read_anyway: int = 0,
                         share: float = STATISTICS_SHARE, reserve: float = 0.0) -> int:
    """The batches of n the statistics read under --time-budget when one costs `per_batch` seconds and
    `seconds_left` remain when they start, as their stop rule (share_of_time_left) decides: they go on while one
    more batch stays within allowed_seconds (statistics_allowance's share and reserve), never below MIN_BATCHES
    (or n) nor below the batches the one pass runs for its other readers anyway (`read_anyway`). The plan says it
    before a run (engine/plan/forecast.py)."""
    floor = min(n, max(MIN_BATCHES, read_anyway))
    if per_batch <= 0:
        return n
    fit = math.floor(allowed_seconds(seconds_left, share, reserve, STATISTICS_SHARE) / per_batch + 1e-9)
    return max(floor, min(n, fit))


def share_text(run) -> str:
    """What the statistics may take, in words, for a run's log and results.json."""
    from ..algo.methods import optimises

    share, reserve = statistics_allowance(optimises(run.config), run.plan)
    return "a third of the time left" if share < 1.0 else (
        f"the time left but the {reserve:.0f} s kept for the phases after them")


class Reconstruction(RunHook):
    @property
    def final_evaluations(self) -> int:  # the final mask before the refit, for results.json: only when asked for
        return int(self.run.config.eval_unrefit and self.skipped is None)

    @staticmethod
    def applies(config) -> bool:
        return config.reconstruct and any(not UNIT_TYPES[u].whole_layer for u in config.units)

    def on_setup(self) -> None:
        r = self.run
        need, free = moments_bytes(r.adapter, r.layout.unit_types), available_memory()
        self.moments, self.skipped, self.batches, self.reader, self.reduced = None, None, 0, None, None
        self.before = None  # (the final mask's perplexity before its refit: --eval-unrefit)
        offloaded = any(t.output_proj(r.adapter, i).weight.device.type == "meta" for t in layer_unit_types()
                        for i in range(r.adapter.num_layers))
        if offloaded:  # (accelerate's offload: the weights live elsewhere and cannot be edited in place)
            self.skipped = "the model is offloaded (--device auto), and its weights cannot be refit in place"
        elif free is not None and need > free // 2:  # (a 7B model's MLP moments alone are about 15 GiB)
            self.skipped = (f"its input statistics need {need / 2**30:.1f} GiB, more than half of the "
                            f"{free / 2**30:.1f} GiB available")
        if self.skipped:
            r.log(f"reconstruction skipped: {self.skipped} (--no-reconstruct silences this)")

    def new_reader(self) -> InputMoments:
        """The statistics' reader: --reconstruct-batches batches, under --time-budget at most STATISTICS_SHARE of the
        time left when it starts."""
        r, n = self.run, self.run.config.reconstruct_batches
        from ..algo.methods import optimises

        share, reserve = statistics_allowance(optimises(r.config), r.plan)
        stop = share_of_time_left(r, share, min(MIN_BATCHES, n), reserve, STATISTICS_SHARE)
        return InputMoments(n, r.layout.unit_types, stop=stop)

    def statistics_wanted(self, batches) -> list:
        if not self.reads_in_the_pass():
            return []
        self.reader = self.new_reader()  # (read in the fresh run's one pass, with the init metric's statistics)
        return [self.reader]

    def planned_statistics(self, batches) -> list:
        return [InputMoments(self.run.config.reconstruct_batches, self.run.layout.unit_types)] if (
            self.reads_in_the_pass()) else []

    def reads_in_the_pass(self) -> bool:
        return self.moments is None and self.skipped is None and self.run.config.refit_stream == "init"

    def statistics(self):
        """The moments of the output projections' inputs on the dense model: from the fresh run's one statistics
        pass (before the init scores: the joint mix's candidates are refit) or, resuming, from a pass of their own
        before the steps (--time-budget's step times must not include them); under --time-budget they take at
        most STATISTICS_SHARE of the time left."""
        if self.moments is None and self.skipped is None:
            r, c = self.run, self.run.config
            reader = self.reader if self.reader is not None and self.reader.result is not None else None
            if reader is None:
                reader = self.new_reader()
                if c.refit_stream == "init":  # (the batches the fresh run's pass read)
                    batches = init_stream(r, reader.batches)
                else:  # (a run from before the one pass: a stream of its own)
                    sampler = r.sampler.reseeded(c.seed + STREAM)
                    batches = [sampler.next_batch() for _ in range(reader.batches)]
                r.log(f"reconstruction: input statistics of the output projections on {len(batches)} calibration batches")
                with r.phases("statistics"), run_passes(r):
                    one_pass(r.adapter, batches, [reader], r.world, r.log)
            self.moments, self.batches = reader.result, reader.batches
            if reader.batches < reader.asked:
                self.reduced = {"reconstruct_batches": [reader.asked, reader.batches], "why": (
                    f"--time-budget: the refit's statistics may take {share_text(r)} when they start, and "
                    f"{reader.asked} batches would not have fit (at least {MIN_BATCHES} are read); fewer batches, a "
                    "less exact refit")}
                r.log(f"reduced: the refit's statistics read {reader.batches} of {reader.asked} batches "
                      f"({self.reduced['why']})")
        return self.moments

    def before_scores(self, batches) -> None:
        self.statistics()  # (on the dense model: before anything is masked)

    def on_resume(self, state) -> None:
        self.statistics()  # (before the steps: --time-budget's step times must not include them)

    def final_masks(self, masks, metric):
        if self.skipped is None and self.run.config.eval_unrefit:  # (asked for: one more evaluation)
            self.before = self.run.masked_perplexity(masks, "pruned, before reconstruction")
        return masks

    @contextmanager
    def weights_for(self, masks, comp_means):
        r, c = self.run, self.run.config
        if self.skipped is not None:
            yield comp_means
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
        out = {"reconstruction": {**({"ppl_before": self.before} if self.before is not None else {}),
                                  "batches": self.batches, "ridge": c.reconstruct_ridge,
                                  "intercept": c.bias_compensation}}
        return {**out, "reduced": self.reduced} if self.reduced else out
