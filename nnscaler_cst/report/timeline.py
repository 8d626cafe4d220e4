"""The pipeline timeline as an SVG picture: ranks as rows, time as columns, forwards and
backwards coloured by micro-batch lightness, idle time (bubbles) left blank."""
from __future__ import annotations

from xml.sax.saxutils import escape

from ..verify.simulate import Event, bubble_fraction

ROW, LEFT, WIDTH, TOP = 34, 70, 900, 40


def timeline_svg(events: list[Event], ranks: int, title: str) -> str:
    end = max(e.end for e in events) if events else 1.0
    scale = WIDTH / end
    micro = max((e.action.micro for e in events), default=0) + 1
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + 20}" '
             f'height="{TOP + ranks * ROW + 50}" font-family="monospace" font-size="12">',
             '<rect width="100%" height="100%" fill="white"/>',
             f'<text x="{LEFT}" y="20" font-size="14">{escape(title)}; bubble '
             f'{100 * bubble_fraction(events, ranks):.1f}%</text>']
    for rank in range(ranks):
        y = TOP + rank * ROW
        parts.append(f'<text x="8" y="{y + ROW / 2 + 4}">rank {rank}</text>')
        parts.append(f'<rect x="{LEFT}" y="{y}" width="{WIDTH}" height="{ROW - 6}" fill="#f3f3f3"/>')
    for e in events:
        light = 35 + 40 * e.action.micro / max(micro - 1, 1)
        hue = 210 if e.action.kind == "F" else 20
        x, y = LEFT + e.start * scale, TOP + e.rank * ROW
        w = max((e.end - e.start) * scale, 1.0)
        parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{ROW - 6}" '
                     f'fill="hsl({hue},70%,{light:.0f}%)" stroke="white"><title>{e.action}</title></rect>')
        if w > 22:
            parts.append(f'<text x="{x + 3:.1f}" y="{y + ROW / 2 + 2}" fill="white">{e.action}</text>')
    y = TOP + ranks * ROW + 20
    parts.append(f'<text x="{LEFT}" y="{y}">blue: forward, orange: backward; lighter = later micro-batch; '
                 f'blank: idle</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
