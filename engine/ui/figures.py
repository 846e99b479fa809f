"""Plotly figures of a run (live or from disk). Pure functions of plain data; no Streamlit here.

Reports are StepReport dicts (metrics.jsonl lines, or JobSnapshot.history).
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..model.unit_types import UNIT_TYPES

_FONT = dict(size=13)
_MARGIN = dict(l=10, r=10, t=64, b=10)
_RUN_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
REMOVED = "#bdbdbd"  # a layer the hard mask removes whole: grey in every chart


def effective_kept(kept_fraction: dict[str, list[float]]) -> dict[str, list[float]]:
    """Kept fractions per layer with the units of removed layers counted as removed (a hard mask leaves the
    widths of a removed layer as they were: moot, but not kept)."""
    whole = [u for u in kept_fraction if u in UNIT_TYPES and UNIT_TYPES[u].whole_layer]
    if not whole:
        return dict(kept_fraction)
    kept_layer = [x > 0.5 for x in kept_fraction[whole[0]]]
    return {u: list(v) if u in whole else [x if k else 0.0 for x, k in zip(v, kept_layer)]
            for u, v in kept_fraction.items()}


def _rgb(colour: str) -> tuple[float, float, float]:
    """(r, g, b) in 0..1 of "#rrggbb", "#rgb" or "rgb(r, g, b)"."""
    c = colour.strip()
    if c.startswith("#"):
        h = c[1:]
        h = "".join(ch * 2 for ch in h) if len(h) == 3 else h
        return tuple(int(h[i:i + 2], 16) / 255 for i in (0, 2, 4))
    parts = c[c.index("(") + 1:c.index(")")].replace(" ", ",").split(",")
    return tuple(float(x) / 255 for x in parts if x.strip())[:3]


def relative_luminance(colour: str) -> float:
    """WCAG 2's relative luminance of an sRGB colour."""
    def lin(x: float) -> float:
        return x / 12.92 if x <= 0.04045 else ((x + 0.055) / 1.055) ** 2.4

    r, g, b = (lin(x) for x in _rgb(colour))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast_ratio(a: str, b: str) -> float:
    """WCAG 2's contrast ratio of two colours, 1 to 21."""
    la, lb = sorted((relative_luminance(a), relative_luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


DARK_TEXT, LIGHT_TEXT = "#000000", "#ffffff"


def text_colour(background: str) -> str:
    """Black or white text, whichever contrasts more with the background: at least 4.58:1 on any colour (WCAG
    AA asks 4.5:1 for text)."""
    return DARK_TEXT if contrast_ratio(background, DARK_TEXT) >= contrast_ratio(background, LIGHT_TEXT) else LIGHT_TEXT


def cell_colours(z: list[list[float | None]], colorscale: str = "Viridis", zmin: float = 0.0, zmax: float = 1.0,
                 missing: str = REMOVED) -> list[list[str]]:
    """The colour plotly paints each heatmap cell (a value's place on the colour scale; None: `missing`)."""
    from plotly.colors import sample_colorscale

    def one(v):
        if v is None:
            return missing
        return sample_colorscale(colorscale, [min(max((v - zmin) / (zmax - zmin), 0.0), 1.0)])[0]

    return [[one(v) for v in row] for row in z]


def _layout(fig: go.Figure, title: str, height: int) -> go.Figure:
    fig.update_layout(title=dict(text=title, x=0, xanchor="left"), height=height, margin=_MARGIN, font=_FONT,
                      legend=dict(orientation="h", yanchor="top", y=-0.3, xanchor="left", x=0))
    return fig


def heads_heatmap(head_scores: list[list[float]], head_mask: list[list[int]] | None, title: str = "",
                  removed: list[int] | tuple = (), which: str = "") -> go.Figure:
    """Layers (rows, first layer on top) x KV groups (columns); colour = keep probability s.

    Groups the hard mask keeps carry a check mark, pruned ones a cross (the "marks" trace, each in black or white,
    whichever reads on its cell); `removed` layers (removed whole) are grey, marked "removed", and none of their
    groups count as kept. `which`: the mask's name for the title (current, final, init).
    """
    n_layers = len(head_scores)
    n_groups = max(len(r) for r in head_scores)
    removed = set(removed)
    ys = [f"L{i}" + (" (removed)" if i in removed else "") for i in range(n_layers)]
    text = None
    if head_mask is not None:
        head_mask = [[0] * len(row) if i in removed else row for i, row in enumerate(head_mask)]
        text = [["" if i in removed else ("✓" if k else "✗") for k in row] for i, row in enumerate(head_mask)]
    z = [[None] * len(row) if i in removed else row for i, row in enumerate(head_scores)]
    xs = [f"g{j}" for j in range(n_groups)]
    fig = go.Figure(go.Heatmap(
        z=z, x=xs, y=ys, zmin=0, zmax=1, colorscale="Viridis", text=text, xgap=2, ygap=2,
        colorbar=dict(title=dict(text="s", side="top"), thickness=12, len=1.0, tickvals=[0, 0.5, 1]),
        hovertemplate="layer %{y}, group %{x}<br>s = %{z:.3f}" + (" %{text}" if text else "") + "<extra></extra>",
    ))
    if removed:
        fig.add_heatmap(z=[[1] * n_groups if i in removed else [None] * n_groups for i in range(n_layers)],
                        x=xs, y=ys, name="removed layers", showscale=False,
                        colorscale=[[0, REMOVED], [1, REMOVED]], xgap=2, ygap=2,
                        text=[["removed"] * n_groups if i in removed else [""] * n_groups for i in range(n_layers)],
                        texttemplate="%{text}", textfont=dict(size=11, color=text_colour(REMOVED)),
                        hovertemplate="%{y}: the whole layer is removed<extra></extra>")
    if text is not None:  # the marks, each in the text colour its cell's colour needs (a heatmap has one text colour)
        colours = cell_colours(z)
        cells = [(i, j) for i, row in enumerate(text) for j, t in enumerate(row) if t]
        fig.add_scatter(x=[xs[j] for _, j in cells], y=[ys[i] for i, _ in cells], mode="text", name="marks",
                        text=[text[i][j] for i, j in cells], showlegend=False, hoverinfo="skip",
                        textfont=dict(size=13, color=[text_colour(colours[i][j]) for i, j in cells]))
    # (fixed ranges: the marks' text trace would pad them; the first layer on top)
    fig.update_yaxes(range=[n_layers - 0.5, -0.5], title="layer", dtick=1 if n_layers <= 16 else 2)
    fig.update_xaxes(range=[-0.5, n_groups - 0.5], title="KV group", side="bottom")
    kept = sum(map(sum, head_mask)) if head_mask else None
    total = sum(len(r) for r in head_scores)
    suffix = (f"<br><sup>{which + ' ' if which else ''}hard mask keeps {kept} of {total}: ✓ kept, ✗ pruned</sup>"
              if kept is not None else "")
    return _layout(fig, title or f"KV groups: keep probability s{suffix}", height=min(max(300, 150 + 22 * n_layers), 820))


def channels_figure(mean_score: list[float], kept_fraction: list[float] | None, title: str = "",
                    removed: list[int] | tuple = ()) -> go.Figure:
    """Per layer: the fraction of MLP channels the hard mask keeps (bars) and the mean s (markers); `removed`
    layers (removed whole) keep none: a grey bar marked "removed"."""
    removed = set(removed)
    layers = [f"L{i}" for i in range(len(mean_score))]
    fig = go.Figure()
    if kept_fraction is not None:
        kept_fraction = [0.0 if i in removed else f for i, f in enumerate(kept_fraction)]
        fig.add_bar(x=layers, y=kept_fraction, name="kept by hard mask", marker_color="#4c78a8",
                    hovertemplate="%{x}: %{y:.1%} kept<extra></extra>")
    if removed:
        fig.add_bar(x=[layers[i] for i in sorted(removed)], y=[1.0] * len(removed), name="removed layer",
                    marker_color=REMOVED, opacity=0.6, text=["removed"] * len(removed), textposition="inside",
                    hovertemplate="%{x}: the whole layer is removed<extra></extra>")
        fig.update_layout(barmode="overlay")
    fig.add_scatter(x=layers, y=mean_score, name="mean s", mode="markers+lines", marker=dict(color="#f58518", size=7),
                    line=dict(width=1), hovertemplate="%{x}: mean s %{y:.3f}<extra></extra>")
    fig.update_yaxes(range=[0, 1.05], title="fraction", tickformat=".0%")
    fig.update_xaxes(title="layer")
    return _layout(fig, title or "MLP channels kept per layer<br><sup>bars: hard mask; dots: mean s</sup>", height=360)


def layers_figure(layer_scores: list[float], kept: list[float] | None, title: str = "") -> go.Figure:
    """Per layer: its keep probability s (bars, coloured by the current hard mask: kept or removed)."""
    layers = [f"L{i}" for i in range(len(layer_scores))]
    colours = ["#4c78a8" if (kept is None or k) else REMOVED for k in (kept or [1] * len(layers))]
    fig = go.Figure(go.Bar(x=layers, y=layer_scores, marker_color=colours,
                           text=None if kept is None else ["" if k else "✗" for k in kept], textposition="outside",
                           hovertemplate="%{x}: s %{y:.3f}<extra></extra>"))
    fig.update_yaxes(range=[0, 1.1], title="keep probability s")
    fig.update_xaxes(title="layer")
    n_removed = None if kept is None else sum(1 for k in kept if not k)
    sub = f"<br><sup>hard mask removes {n_removed} of {len(layers)} (grey, ✗)</sup>" if kept is not None else ""
    return _layout(fig, title or f"Whole layers: keep probability s{sub}", height=340)


def loss_figure(history: list[dict], title: str = "", reward: str = "ce") -> go.Figure:
    """Each mask sample's loss, the moving-average baseline, the held-out check of the hard mask, and the learning
    rate (right axis). The loss and the check are the reward's: under kl the mean KL from the dense model (nats per
    token; the check's value is that, not a perplexity), under ce the cross-entropy (the check: log perplexity)."""
    reward = next((r["reward"] for r in history if r.get("reward")), reward)  # (a line names its reward itself)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    steps = [r["step"] for r in history]
    n_samples = max((len(r["losses"]) for r in history), default=0)
    for j in range(n_samples):
        fig.add_scatter(x=steps, y=[r["losses"][j] if j < len(r["losses"]) else None for r in history],
                        name=f"loss, sample {j + 1}", mode="lines", line=dict(width=1), opacity=0.55,
                        secondary_y=False)
    if any(r["baseline"] for r in history):
        fig.add_scatter(x=steps, y=[r["baseline"] for r in history], name="baseline", mode="lines",
                        line=dict(width=2.5, color="black"), secondary_y=False)
    kl = reward == "kl"
    # the held-out check in the reward's own terms: under kl metrics.jsonl's val_reward (the mean KL; its val_ppl is
    # the same check's perplexity, on another scale), under ce the perplexity, drawn as its log
    val = ([(r["step"], r["val_reward"]) for r in history if r.get("val_reward") is not None] if kl else
           [(r["step"], math.log(r["val_ppl"])) for r in history if r.get("val_ppl")])
    if val:
        fig.add_scatter(x=[v[0] for v in val], y=[v[1] for v in val],
                        name="hard mask, held-out (mean KL)" if kl else "hard mask, held-out (log ppl)",
                        mode="markers+lines", marker=dict(size=8, symbol="diamond", color="#54a24b"),
                        hovertemplate=("step %{x}: held-out mean KL %{y:.4f}<extra></extra>" if kl else
                                       "step %{x}: held-out ppl %{customdata:.2f}<extra></extra>"),
                        customdata=None if kl else [math.exp(v[1]) for v in val], secondary_y=False)
    fig.add_scatter(x=steps, y=[r["lr"] for r in history], name="learning rate", mode="lines",
                    line=dict(width=1.5, dash="dot", color="#e45756"), secondary_y=True)
    fig.update_xaxes(title="step", tickformat="d", dtick=max(1, math.ceil(len(steps) / 10)) if steps else None)
    fig.update_yaxes(title="mean KL from the dense model (nats)" if kl else "cross-entropy (nats; held-out: log ppl)",
                     secondary_y=False)
    fig.update_yaxes(title="lr", secondary_y=True, showgrid=False, tickformat=".1e", rangemode="tozero")
    return _layout(fig, title or "Calibration loss per mask sample, baseline, learning rate", height=400)


RECOVERY_PARTS = {"kl": "KL from the dense model", "ce": "cross-entropy"}  # a recovery's loss terms, as labelled


def recovery_parts(records: list[dict]) -> list[str]:
    """The loss terms a recovery's lines hold (recover_log.jsonl: kl only where the loss has a KL term)."""
    return [k for k in RECOVERY_PARTS if any(k in r for r in records)]


def recovery_figure(records: list[dict], title: str = "") -> go.Figure:
    """A recovery's loss per step (recover_log.jsonl's lines), in nats per token: the training loss and, where it
    mixes two terms, each term; a loss of one term is drawn once, under that term's name."""
    fig = go.Figure()
    steps = [r["step"] for r in records]
    parts = recovery_parts(records)
    if len(parts) == 1:
        fig.add_scatter(x=steps, y=[r.get("loss") for r in records], name=f"loss ({RECOVERY_PARTS[parts[0]]})",
                        mode="lines", line=dict(width=2.5, color="black"))
    else:
        for key, name, style in (("loss", "loss", dict(width=2.5, color="black")),
                                 ("kl", RECOVERY_PARTS["kl"], dict(width=1.5, color="#4c78a8")),
                                 ("ce", RECOVERY_PARTS["ce"], dict(width=1.5, dash="dot", color="#e45756"))):
            if any(key in r for r in records):
                fig.add_scatter(x=steps, y=[r.get(key) for r in records], name=name, mode="lines", line=style)
    fig.update_xaxes(title="step", tickformat="d")
    fig.update_yaxes(title="nats per token")
    what = ", ".join(RECOVERY_PARTS[k] for k in parts) or "its terms"
    return _layout(fig, title or f"Recovery: loss per step ({what})", height=320)


def sparsity_profiles(runs: list[tuple[str, dict[str, list[float]]]], unit_types: list[str],
                      colours: list[str] | None = None) -> go.Figure:
    """Fraction pruned per layer, one line per run, one panel per unit type.

    runs: (label, {unit type: kept fraction per layer}); colours: each run's (default: by position).
    """
    unit_types = [u for u in unit_types if any(u in kept for _, kept in runs)] or unit_types
    fig = make_subplots(rows=len(unit_types), cols=1, subplot_titles=[UNIT_TYPES[u].title if u in UNIT_TYPES else u for u in unit_types],
                        vertical_spacing=0.16)
    for k, (label, kept) in enumerate(runs):
        colour = colours[k] if colours else _RUN_COLOURS[k % len(_RUN_COLOURS)]
        for row, u in enumerate(unit_types, 1):
            if u not in kept:
                continue
            fig.add_scatter(x=list(range(len(kept[u]))), y=[1 - f for f in kept[u]], name=label, mode="lines+markers",
                            line=dict(color=colour), marker=dict(size=6), legendgroup=label,
                            showlegend=row == 1, row=row, col=1,
                            hovertemplate="layer %{x}: %{y:.1%} pruned<extra>" + label + "</extra>")
            fig.update_yaxes(title="pruned", tickformat=".0%", rangemode="tozero", row=row, col=1)
            fig.update_xaxes(title="layer", tickformat="d", dtick=1 if len(kept[u]) <= 16 else 2, row=row, col=1)
    return _layout(fig, "Sparsity per layer (fraction pruned)", height=200 + 240 * len(unit_types))


def perplexity_bars(runs: list[tuple[str, dict]], colours: list[str] | None = None) -> go.Figure:
    """Dense / init / pruned perplexity of each run (results.json dicts); colours: each run's (default: by
    position)."""
    fig = go.Figure()
    for k, (label, res) in enumerate(runs):
        names = ["dense", "init", "pruned"]
        values = [res.get("ppl_dense"), res.get("ppl_init"), res.get("ppl_pruned")]
        fig.add_bar(x=names, y=values, name=label,
                    marker_color=colours[k] if colours else _RUN_COLOURS[k % len(_RUN_COLOURS)],
                    text=[f"{v:.2f}" if v is not None else "" for v in values], textposition="outside",
                    hovertemplate="%{x}: %{y:.2f}<extra>" + label + "</extra>")
    fig.update_yaxes(title="WikiText-2 perplexity", rangemode="tozero")
    fig.update_layout(barmode="group")
    return _layout(fig, "Perplexity (lower is better)", height=360)


def kept_fractions_from_results(results: dict) -> dict[str, list[float]]:
    """Kept fraction per layer of each unit type, a removed layer's units counted as removed."""
    return effective_kept({u: [k / n for k, n in zip(kept, results["units_per_layer"][u])]
                           for u, kept in results.get("kept_per_layer", {}).items()})
