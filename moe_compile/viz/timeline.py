"""Lease timeline: payload lifetimes over the forward/backward schedule, one row per pool slot, and
below each pool its live-payload count with the high-water line. Plain SVG (no plotting library).

    pool (stage, family): rows = slots; a payload is a bar on its slot's row over [acquire, release)
                          (pink: leased — a backward consumer reads it; blue: shared transient slot)
    live(pos)           = #payloads of the pool with acquire ≤ pos < release
    high-water          = max_pos live(pos); drawn as a dashed line and compared with the plan's own
                          figure (a mismatch is printed in red on the picture)
"""

from __future__ import annotations

import html

from ..leases import LeasePlan, Payload

W, LEFT, ROW, CHART, GAP = 760, 190, 14, 56, 26


def pools(plan: LeasePlan) -> list[tuple[int, str]]:
    return sorted({(p.stage, p.family) for p in plan.payloads})


def live_steps(payloads: list[Payload]) -> list[tuple[int, int]]:
    """[(position, live count from that position on)] at every position where the count changes."""
    delta: dict[int, int] = {}
    for p in payloads:
        delta[p.acquire] = delta.get(p.acquire, 0) + 1
        delta[p.release] = delta.get(p.release, 0) - 1
    out, cur = [], 0
    for pos in sorted(delta):
        cur += delta[pos]
        out.append((pos, cur))
    return out


def timeline_high_water(plan: LeasePlan) -> dict[tuple[int, str], int]:
    """High-water of every pool, computed from the payload intervals."""
    out = {}
    for key in pools(plan):
        steps = live_steps([p for p in plan.payloads if (p.stage, p.family) == key])
        out[key] = max((c for _, c in steps), default=0)
    return out


def _x(pos: float, n: int) -> float:
    return LEFT + W * pos / max(n, 1)


def timeline_svg(plan: LeasePlan, title: str = "lease timeline") -> str:
    n = plan.schedule_len
    computed = timeline_high_water(plan)
    parts: list[str] = []
    y = 34
    for stage, family in pools(plan):
        mine = [p for p in plan.payloads if (p.stage, p.family) == (stage, family)]
        slots = plan.pool_slots(stage, family)
        hw_plan = plan.high_water.get((stage, family))
        hw = computed[(stage, family)]
        g = [f'<g class="pool" data-stage="{stage}" data-family="{html.escape(family)}" '
             f'data-high-water="{hw_plan if hw_plan is not None else ""}" data-computed-high-water="{hw}">']
        slot_bytes = plan.slot_bytes.get((stage, family))
        head = f"stage {stage} · {family}: {slots} slot(s)" + (f" × {slot_bytes:,} B" if slot_bytes else "")
        g.append(f'<text x="4" y="{y - 6}" font-weight="bold">{html.escape(head)}</text>')
        for s in range(slots):
            g.append(f'<text x="{LEFT - 6}" y="{y + s * ROW + 10}" text-anchor="end" fill="#6b7280">slot {s}</text>')
        for p in mine:
            x0, x1 = _x(p.acquire, n), _x(p.release, n)
            cls = "payload leased" if p.leased else "payload transient"
            fill = "#f472b6" if p.leased else "#60a5fa"
            tip = (f"{p.name} ({p.block}) {list(p.shape)} {p.dtype}, {p.nbytes:,} B, [{p.acquire}, {p.release})"
                   + (" leased" if p.leased else " transient"))
            g.append(f'<rect class="{cls}" x="{x0:.1f}" y="{y + p.slot * ROW + 1}" width="{max(x1 - x0, 1):.1f}" '
                     f'height="{ROW - 2}" fill="{fill}" stroke="#374151" stroke-width="0.5">'
                     f'<title>{html.escape(tip)}</title></rect>')
        y += slots * ROW + 8
        # live count and high-water
        top = max(hw, hw_plan or 0, 1)
        base = y + CHART
        pts, prev = [f"{_x(0, n):.1f},{base}"], 0
        for pos, c in live_steps(mine):
            px = _x(pos, n)
            pts += [f"{px:.1f},{base - CHART * prev / top:.1f}", f"{px:.1f},{base - CHART * c / top:.1f}"]
            prev = c
        pts.append(f"{_x(n, n):.1f},{base - CHART * prev / top:.1f}")
        g.append(f'<polyline class="live" points="{" ".join(pts)}" fill="none" stroke="#111827" stroke-width="1.2"/>')
        hy = base - CHART * hw / top
        g.append(f'<line class="high-water" data-value="{hw}" x1="{LEFT}" x2="{LEFT + W}" y1="{hy:.1f}" y2="{hy:.1f}" '
                 'stroke="#dc2626" stroke-dasharray="5,3"/>')
        g.append(f'<text x="{LEFT + W + 4}" y="{hy + 4:.1f}" fill="#dc2626">high-water {hw}</text>')
        g.append(f'<text x="{LEFT - 6}" y="{base}" text-anchor="end" fill="#6b7280">live payloads</text>')
        if hw_plan is not None and hw_plan != hw:
            g.append(f'<text class="warning" x="4" y="{base + 14}" fill="#dc2626">plan says high-water {hw_plan}, '
                     f'its payload intervals give {hw}</text>')
            base += 14
        g.append("</g>")
        parts += g
        y = base + GAP
    if not plan.payloads:
        parts.append(f'<text x="4" y="{y}">no symmetric payloads in this plan</text>')
        y += GAP
    # schedule axis and the forward | backward boundary
    axis = [f'<line x1="{LEFT}" x2="{LEFT + W}" y1="{y}" y2="{y}" stroke="#374151"/>']
    for i in range(11):
        pos = round(n * i / 10)
        axis.append(f'<text x="{_x(pos, n):.1f}" y="{y + 14}" text-anchor="middle" fill="#6b7280">{pos}</text>')
    axis.append(f'<text x="{LEFT + W / 2}" y="{y + 30}" text-anchor="middle">schedule position (joint graph node '
                'order: forward, then backward)</text>')
    if plan.boundary:
        bx = _x(plan.boundary, n)
        axis.append(f'<line class="boundary" x1="{bx:.1f}" x2="{bx:.1f}" y1="20" y2="{y}" stroke="#6b7280" '
                    'stroke-dasharray="2,2"/>')
        axis.append(f'<text x="{bx - 4:.1f}" y="16" text-anchor="end" fill="#6b7280">forward</text>')
        axis.append(f'<text x="{bx + 4:.1f}" y="16" fill="#6b7280">backward</text>')
    height = y + 40
    sharing = "shared transient slots" if plan.sharing else "fixed per-block caches (sharing off)"
    try:
        sym = f"{plan.symmetric_bytes:,}"
    except KeyError:  # a pool without a slot size
        sym = "n/a (slot sizes missing)"
    head = [f'<svg xmlns="http://www.w3.org/2000/svg" class="lease-timeline" width="{LEFT + W + 110}" '
            f'height="{height}" font-family="Helvetica" font-size="10">',
            f'<text x="4" y="12" font-size="12" font-weight="bold">{html.escape(title)} — {sharing}, '
            f'symmetric bytes {sym}</text>']
    return "\n".join(head + parts + axis + ["</svg>"])
