"""Small SVG charts drawn on the server: metric curves, histograms, bars and the trace waterfall.

SVG geometry lives in attributes, not styles, so the pages need no inline CSS or script under
the Content-Security-Policy, and a chart is visible without JavaScript. Every text that reaches
the SVG (metric names, tool names) goes through :func:`markupsafe.escape`.
"""

from __future__ import annotations

import math
from typing import Sequence

from markupsafe import Markup, escape

from closedloop.trace_layout import WaterfallRow

__all__ = ["ema", "line_chart", "histogram", "bars", "waterfall", "WaterfallRow"]


def ema(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average with its start-up bias removed
    (``weight`` 0 returns the values; non-finite values are passed through and skipped)."""
    if not 0 <= weight < 1:
        raise ValueError("smoothing weight must be in [0, 1)")
    out, last, n = [], 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        last = last * weight + (1 - weight) * v
        n += 1
        out.append(last / (1 - weight ** n))
    return out


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def _range(values: Sequence[float]) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return 0.0, 1.0
    lo, hi = min(finite), max(finite)
    if lo == hi:
        pad = abs(lo) * 0.05 or 1.0
        return lo - pad, hi + pad
    return lo, hi


def line_chart(title: str, series: Sequence[tuple[str, Sequence[float], Sequence[float]]], *,
               width: int = 360, height: int = 170, faded: Sequence[tuple[str, Sequence[float], Sequence[float]]] = ()
               ) -> Markup:
    """Lines ``(label, xs, ys)``; ``faded`` lines (the raw values under a smoothed curve) are drawn
    thinner and lighter. Axes show the first/last x and the y range."""
    left, right, top, bottom = 46, 8, 20, 22
    all_x = [x for _, xs, _ in list(series) + list(faded) for x in xs]
    all_y = [y for _, _, ys in list(series) + list(faded) for y in ys]
    x0, x1 = _range(all_x)
    y0, y1 = _range(all_y)
    pw, ph = width - left - right, height - top - bottom

    def pt(x: float, y: float) -> str:
        return f"{left + (x - x0) / (x1 - x0) * pw:.1f},{top + (1 - (y - y0) / (y1 - y0)) * ph:.1f}"

    parts = [f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img">',
             f'<title>{escape(title)}</title>',
             f'<text class="ct" x="{left}" y="13">{escape(title)}</text>',
             f'<rect class="frame" x="{left}" y="{top}" width="{pw}" height="{ph}"/>',
             f'<text class="tick" x="{left - 4}" y="{top + 4}" text-anchor="end">{_fmt(y1)}</text>',
             f'<text class="tick" x="{left - 4}" y="{top + ph}" text-anchor="end">{_fmt(y0)}</text>',
             f'<text class="tick" x="{left}" y="{height - 6}">{_fmt(x0)}</text>',
             f'<text class="tick" x="{left + pw}" y="{height - 6}" text-anchor="end">{_fmt(x1)}</text>']
    for cls, lines in (("raw", faded), ("line", series)):
        for i, (label, xs, ys) in enumerate(lines):
            pts = " ".join(pt(x, y) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y))
            if not pts:
                continue
            parts.append(f'<polyline class="{cls} s{i % 6}" points="{pts}"><title>{escape(label)}</title></polyline>')
            if len(xs) == 1:
                parts.append(f'<circle class="dot s{i % 6}" cx="{pt(xs[0], ys[0]).split(",")[0]}" '
                             f'cy="{pt(xs[0], ys[0]).split(",")[1]}" r="3"/>')
    if len(series) > 1:
        for i, (label, _, _) in enumerate(series):
            parts.append(f'<text class="legend s{i % 6}" x="{left + 4}" y="{top + 12 + 11 * i}">{escape(label)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def histogram(title: str, values: Sequence[float], *, bins: int = 12, log: bool = False, width: int = 360,
              height: int = 170, unit: str = "") -> Markup:
    """Counts of ``values`` in equal bins (of log10 when ``log``: speedups)."""
    data = [math.log10(v) for v in values if v > 0 and math.isfinite(v)] if log else \
        [v for v in values if math.isfinite(v)]
    counts = [0] * bins
    lo, hi = _range(data)
    for v in data:
        counts[min(int((v - lo) / (hi - lo) * bins), bins - 1)] += 1
    edges = [lo + (hi - lo) * i / bins for i in range(bins + 1)]
    labels = [f"{_fmt(10 ** a if log else a)}–{_fmt(10 ** b if log else b)}{unit}" for a, b in zip(edges, edges[1:])]
    return bars(title, list(zip(labels, counts)), width=width, height=height,
                axis=(f"{_fmt(10 ** lo if log else lo)}{unit}", f"{_fmt(10 ** hi if log else hi)}{unit}"))


def bars(title: str, items: Sequence[tuple[str, float]], *, width: int = 360, height: int = 170,
         axis: tuple[str, str] | None = None) -> Markup:
    """Vertical bars, one per ``(label, value)``; hovering a bar shows its label and value."""
    left, right, top, bottom = 30, 8, 20, 22
    pw, ph = width - left - right, height - top - bottom
    top_value = max((v for _, v in items), default=0) or 1
    bw = pw / max(len(items), 1)
    parts = [f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img">',
             f'<title>{escape(title)}</title><text class="ct" x="{left}" y="13">{escape(title)}</text>',
             f'<text class="tick" x="{left - 4}" y="{top + 4}" text-anchor="end">{_fmt(top_value)}</text>',
             f'<line class="axis" x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}"/>']
    for i, (label, value) in enumerate(items):
        h = ph * value / top_value
        parts.append(f'<rect class="bar" x="{left + i * bw + 1:.1f}" y="{top + ph - h:.1f}" width="{max(bw - 2, 1):.1f}" '
                     f'height="{h:.1f}"><title>{escape(label)}: {_fmt(value)}</title></rect>')
        if axis is None and len(items) <= 8:
            parts.append(f'<text class="tick" x="{left + (i + 0.5) * bw:.1f}" y="{height - 6}" '
                         f'text-anchor="middle">{escape(label[:14])}</text>')
    if axis is not None:
        parts.append(f'<text class="tick" x="{left}" y="{height - 6}">{escape(axis[0])}</text>'
                     f'<text class="tick" x="{left + pw}" y="{height - 6}" text-anchor="end">{escape(axis[1])}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def waterfall(rows: Sequence[WaterfallRow], *, width: int = 900, row_h: int = 16) -> Markup:
    """The trace's steps as bars on one time axis; each bar links to its step below."""
    if not rows:
        return Markup("")
    label_w = 190
    total = max((r.start_s + r.duration_s for r in rows), default=0.0) or 1.0
    pw = width - label_w - 60
    height = row_h * len(rows) + 18
    parts = [f'<svg class="waterfall" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img">',
             "<title>steps in recorded order, bars as long as each step's recorded latency</title>"]
    for i, r in enumerate(rows):
        y = i * row_h
        x = label_w + r.start_s / total * pw
        w = max(r.duration_s / total * pw, 1.5)
        parts.append(f'<a href="#{escape(r.anchor)}"><text class="wl" x="{label_w - 6}" y="{y + 12}" '
                     f'text-anchor="end">{escape(r.label[:30])}</text>'
                     f'<rect class="wb {escape(r.kind)}" x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{row_h - 5}">'
                     f'<title>{escape(r.label)}: {r.duration_s:.3f} s</title></rect>'
                     f'<text class="wt" x="{x + w + 4:.1f}" y="{y + 12}">{r.duration_s:.2f}s</text></a>')
    parts.append(f'<text class="tick" x="{label_w}" y="{height - 4}">0 s</text>'
                 f'<text class="tick" x="{label_w + pw}" y="{height - 4}" text-anchor="end">{_fmt(total)} s</text></svg>')
    return Markup("".join(parts))
