"""A small line chart as SVG text, for the bench's figures (no plotting library is installed on the bench machines).

    svg = line_chart([Panel("WikiText", [Series("kl, 30 %", [(14.0, 0.0), (31.9, -10.3)], "#1f77b4")])],
                     x_label="CPU minutes", y_label="% against the init")

Each panel has its own y range (padded to include 0) and the same x range; each series is a polyline with a
dot per point; a legend lists each label once, in the colour of its first series.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f")


@dataclass
class Series:
    label: str
    points: list[tuple[float, float]]
    color: str = PALETTE[0]
    dashed: bool = False


@dataclass
class Panel:
    title: str
    series: list[Series] = field(default_factory=list)


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 × a power of ten apart) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"ticks need a finite range, got {lo}..{hi}")
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) * step
    ticks, t = [], first
    while t < hi + step * 0.999:
        ticks.append(round(t, 10))
        t += step
    return ticks


def _fmt(v: float) -> str:
    return f"{v:g}"


def line_chart(panels: list[Panel], x_label: str, y_label: str, panel_width: int = 360, height: int = 260) -> str:
    """The panels side by side, one SVG document."""
    points = [p for panel in panels for s in panel.series for p in s.points]
    if not points:
        raise ValueError("a chart needs at least one point")
    xt = nice_ticks(min(x for x, _ in points), max(x for x, _ in points))
    first = {}  # each label's first series, in order: the legend
    for panel in panels:
        for s in panel.series:
            first.setdefault(s.label, s)
    left, right, top, bottom, legend_h = 52, 16, 28, 40, 18 * len(first) + 8
    width = len(panels) * panel_width
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + legend_h}" '
           f'font-family="sans-serif" font-size="11">', f'<rect width="{width}" height="{height + legend_h}" fill="white"/>']
    for i, panel in enumerate(panels):
        ys = [y for s in panel.series for _, y in s.points] or [0.0]
        yt = nice_ticks(min(min(ys), 0.0), max(max(ys), 0.0))
        x0, x1 = i * panel_width + left, (i + 1) * panel_width - right
        y0, y1 = height - bottom, top

        def sx(x, x0=x0, x1=x1):
            return x0 + (x - xt[0]) / (xt[-1] - xt[0]) * (x1 - x0)

        def sy(y, y0=y0, y1=y1, yt=yt):
            return y0 - (y - yt[0]) / (yt[-1] - yt[0]) * (y0 - y1)

        out.append(f'<text x="{(x0 + x1) / 2:.1f}" y="16" text-anchor="middle" font-weight="bold">'
                   f'{escape(panel.title)}</text>')
        for t in yt:
            out.append(f'<line x1="{x0}" x2="{x1}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="{"#888" if t == 0 else "#e5e5e5"}"/>')
            out.append(f'<text x="{x0 - 4}" y="{sy(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
        for t in xt:
            out.append(f'<line x1="{sx(t):.1f}" x2="{sx(t):.1f}" y1="{y0}" y2="{y0 + 4}" stroke="#888"/>')
            out.append(f'<text x="{sx(t):.1f}" y="{y0 + 16}" text-anchor="middle">{_fmt(t)}</text>')
        out.append(f'<rect x="{x0}" y="{y1}" width="{x1 - x0}" height="{y0 - y1}" fill="none" stroke="#888"/>')
        out.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{height - 6}" text-anchor="middle">{escape(x_label)}</text>')
        if i == 0:
            out.append(f'<text x="12" y="{(y0 + y1) / 2:.1f}" text-anchor="middle" '
                       f'transform="rotate(-90 12 {(y0 + y1) / 2:.1f})">{escape(y_label)}</text>')
        for s in panel.series:
            pts = sorted(s.points)
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
            dash = ' stroke-dasharray="5,3"' if s.dashed else ""
            out.append(f'<polyline points="{path}" fill="none" stroke="{s.color}" stroke-width="1.5"{dash}/>')
            out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{s.color}"/>' for x, y in pts]
    for j, (label, s) in enumerate(first.items()):
        y = height + 12 + 18 * j
        dash = ' stroke-dasharray="5,3"' if s.dashed else ""
        out.append(f'<line x1="{left}" x2="{left + 24}" y1="{y - 4}" y2="{y - 4}" stroke="{s.color}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{left + 30}" y="{y}">{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
