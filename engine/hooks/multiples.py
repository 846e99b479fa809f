"""`--unit-multiple UNIT=N`: every layer keeps a multiple of N units of that type in every hard mask (whole
Q8_0 blocks and GEMM tiles for llama.cpp; never over the budget: units.round_to_multiple)."""

from __future__ import annotations

from ..errors import UserError
from ..model.units import round_to_multiple
from .base import RunHook


class UnitMultiples(RunHook):
    @staticmethod
    def applies(config) -> bool:
        return bool(config.unit_multiple)

    def on_setup(self) -> None:
        sizes = self.run.layout.sizes
        for u, n in self.run.config.unit_multiple.items():  # a multiple no layer exceeds would round nothing
            if n >= max(sizes[u]):
                raise UserError(f"unit multiple {u}={n} is not below the {max(sizes[u])} {u} of this model's "
                                f"largest layer: no layer could be rounded to it")

    def hard_masks(self, masks, scores):
        layout, c = self.run.layout, self.run.config
        return {u: round_to_multiple(m, scores[u], layout.layer_slices(u), layout.pools(u, c.scope), c.unit_multiple[u])
                if u in c.unit_multiple else m for u, m in masks.items()}
