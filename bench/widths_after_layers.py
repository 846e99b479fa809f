"""The width metric and the bias compensation's means measured on a model whose removed layers are already
skipped (bench/joint_counts.py --sequential): the engine measures both on the dense model, where the layers after
a removed one see other inputs than they will once it is gone."""

from __future__ import annotations

import torch


@torch.no_grad()
def widths_after_layers(run, layer_mask: torch.Tensor, batches: list[torch.Tensor], z: dict[str, torch.Tensor]):
    """(z with the width types' standardized metric re-measured on `batches` under the hard `layer_mask`, the
    compensation means measured likewise, as a run's fill). A removed layer's columns get zero statistics (its
    units are removed with it)."""
    from engine.hooks.compensation import compensation_fill
    from engine.run.initialise import metric_batches, metric_names
    from engine.model.masking import MaskHooks
    from engine.algo.metrics import METRICS, MetricContext
    from engine.algo.metrics.activations import batches_digest, column_moments, input_means
    from engine.algo.metrics.probability import standardize
    from engine.model.unit_types import layer_unit_types

    a, c, layer_type = run.adapter, run.config, run.budget.layer_type
    widths = [u for u in run.layout.unit_types if u != layer_type]
    names = metric_names(run)
    memo: dict = {}
    parts = [batches[:metric_batches(c, widths)]]
    parts += [batches] if len(batches) != len(parts[0]) else []  # (the compensation's means read every batch)
    for part in parts:
        with MaskHooks(a) as hooks:
            hooks.set({layer_type: run.layout.split(layer_type, layer_mask)})
            first, second, tokens = column_moments(a, part, run.world, None, "statistics after the layers")
        for t in layer_unit_types():
            for i in range(a.num_layers):
                if (t.name, i) not in first:
                    n = t.output_proj(a, i).weight.shape[1]
                    first[(t.name, i)], second[(t.name, i)] = torch.zeros(n), torch.zeros(n)
        memo[("moments", batches_digest(part))] = (first, second, tokens)
    out = dict(z)
    for name in dict.fromkeys(names[u] for u in widths):
        units = [u for u in widths if names[u] == name]
        ctx = MetricContext(a, run.layout, batches[:metric_batches(c, units)], keep_ratio=c.keep_ratio,
                            seed=c.seed + 2, world=run.world, memo=memo)
        raw = METRICS[name].fn(ctx, units)
        out.update({u: torch.cat(raw[u]).float() if METRICS[name].comparable else standardize(u, raw[u])
                    for u in units})
    means = input_means(a, batches, run.world, memo) if c.bias_compensation else None
    return out, compensation_fill(means, run.layout.unit_types)


@torch.no_grad()
def layer_mean_deltas(run, batches: list[torch.Tensor], skip_first: bool = False) -> dict[int, torch.Tensor]:
    """Per decoder layer, the mean over the batches' tokens of what it adds to the residual stream (its output
    minus its input), on the dense model: a removed layer's constant part (bench/joint_counts.py
    --layer-compensation), as FLAP's compensation keeps a removed channel's mean. skip_first: without each
    sequence's first position, whose updates in some layers are orders of magnitude larger (the attention sink)."""
    from engine.algo.evaluate import decoder_forward

    sums: dict[int, torch.Tensor] = {}
    tokens = [0]
    handles = []

    def recorder(i):
        def hook(module, args, kwargs, output):
            x = args[0] if args else kwargs["hidden_states"]
            y = output[0] if isinstance(output, tuple) else output
            d = (y - x).detach().float()[:, 1 if skip_first else 0:]  # (skip_first: not the attention sink)
            d = d.reshape(-1, x.shape[-1]).sum(0)
            sums[i] = d if i not in sums else sums[i] + d
            if i == 0:
                tokens[0] += x.shape[0] * (x.shape[1] - (1 if skip_first else 0))
        return hook

    for i, layer in enumerate(run.adapter.layers):
        handles.append(layer.register_forward_hook(recorder(i), with_kwargs=True))
    try:
        for b in batches:
            decoder_forward(run.adapter.model, b)
    finally:
        for h in handles:
            h.remove()
    return {i: s / tokens[0] for i, s in sums.items()}


class layer_compensation:
    """While active, a layer that a hard mask removes adds its mean delta (layer_mean_deltas) to the residual
    stream in place of nothing."""

    def __init__(self, deltas: dict[int, torch.Tensor]):
        self.deltas = deltas

    def __enter__(self):
        from engine.model import masking

        self.original = original = masking._LayerGate.forward
        deltas = self.deltas

        def forward(gate, hidden_states, *args, **kwargs):
            out = original(gate, hidden_states, *args, **kwargs)
            hooks = gate._hooks[0]
            if hooks._columns.get("layers") is not None and hooks._layer_decisions[gate.index] == 0.0:
                return out + deltas[gate.index].to(out.dtype)
            return out

        masking._LayerGate.forward = forward
        return self

    def __exit__(self, *exc):
        from engine.model import masking

        masking._LayerGate.forward = self.original
