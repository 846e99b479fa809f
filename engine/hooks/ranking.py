"""`--within-layer-ranking init-metric`: the final mask keeps each layer's count from the scores, but chooses
the kept units inside every layer by the init metric."""

from __future__ import annotations

from .base import RunHook


def rank_within_layers(layout, masks, metric):
    return {u: layout.ranked_within_layers(u, m, metric[u]) for u, m in masks.items()}


class WithinLayerRanking(RunHook):
    @staticmethod
    def applies(config) -> bool:
        return config.within_layer_ranking == "init-metric"

    def final_masks(self, masks, metric):
        return masks if metric is None else rank_within_layers(self.run.layout, masks, metric)
