"""Data-parallel runs (torchrun; engine/model/distributed.py): the ranks must hold the same state at every point a
checkpoint can be taken. After every step (and at the start) each rank hands in a digest of its scores, baseline,
method state and generators' positions; rank 0 writes a step only when every rank agrees, and a disagreement ends
the run with one line. Each session's number of ranks is kept in the state (results.json: `worlds`). In one process
this costs nothing: there is nobody to compare with."""

from __future__ import annotations

from .base import RunHook


class SameStateOnEveryRank(RunHook):
    @staticmethod
    def applies(config) -> bool:
        return True  # (a no-op in one process)

    def check(self, state, what: str) -> None:
        run = self.run
        run.world.check_same(what, state.step, state.scores, state.baseline, state.method_state,
                             run.mask_rng.get_state(), run.sampler.state_dict())

    def on_start(self, state) -> None:
        worlds = list(state.worlds or [])
        if not worlds or worlds[-1]["world_size"] != self.run.world.size:
            worlds.append({"from_step": state.step, "world_size": self.run.world.size})
        self.own(state)["worlds"] = worlds
        self.check(state, f"the state at step {state.step} (the start)")

    def on_step(self, state, report) -> None:
        self.check(state, f"the state after step {state.step}")
