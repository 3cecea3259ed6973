"""The pipeline schedule as a lease timeline: one row per pipeline rank, one box per action in the
schedule's own order (torch.distributed.pipelining), each forward labelled with the lease-pool
instance it claims and each backward with the one it frees — the walk ``verify_schedule`` proves.

    box   F<mb>·i<k> = forward of microbatch mb on stage s, writing its leased payloads into instance k
          B<mb>·i<k> = its backward, after which instance k is free again
    count the instances of stage s in use never exceed H_s (the plan's in_flight)
"""

from __future__ import annotations

import html

from ..schedules import BACKWARDS, FORWARD

_COLOURS = ("#dbeafe", "#dcfce7", "#fef3c7", "#fce7f3", "#e0e7ff", "#ccfbf1", "#fee2e2", "#f3e8ff")


def schedule_instances(order: dict[int, list]) -> dict[tuple[int, int], list[tuple[str, int, int, int]]]:
    """(rank, step) → [(kind "F"/"B", stage, microbatch, instance)], instances assigned lowest-free."""
    out: dict[tuple[int, int], list] = {}
    for rank, actions in sorted(order.items()):
        taken: dict[tuple[int, int], int] = {}
        for step, a in enumerate(actions):
            if a is None:
                continue
            s, mb = a.stage_index, a.microbatch_index
            if a.computation_type == FORWARD:
                busy = {i for (st, _), i in taken.items() if st == s}
                inst = next(i for i in range(len(busy) + 1) if i not in busy)
                taken[(s, mb)] = inst
                out[(rank, step)] = [("F", s, mb, inst)]
            elif a.computation_type in BACKWARDS:
                out[(rank, step)] = [("B", s, mb, taken.pop((s, mb), -1))]
    return out


def schedule_svg(schedule, title: str = "pipeline schedule") -> str:
    """SVG of ``schedule`` (a schedules.ScheduleOrder)."""
    cells = schedule_instances(schedule.order)
    steps = max((len(a) for a in schedule.order.values()), default=0)
    w, h, left, top = 46, 26, 70, 40
    width, height = left + steps * w + 10, top + len(schedule.order) * (h + 8) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="Helvetica" '
             f'font-size="10" class="schedule" data-schedule="{html.escape(schedule.name)}">',
             f'<text x="4" y="16" font-size="13" font-weight="bold">{html.escape(title)}: {schedule.name}, '
             f'm={schedule.microbatches}, H_s {dict(sorted(schedule.in_flight.items()))}</text>']
    for row, rank in enumerate(sorted(schedule.order)):
        y = top + row * (h + 8)
        parts.append(f'<text x="4" y="{y + 17}">rank {rank}</text>')
        for step in range(steps):
            for kind, stage, mb, inst in cells.get((rank, step), []):
                x = left + step * w
                fill = _COLOURS[stage % len(_COLOURS)] if kind == "F" else "#e5e7eb"
                parts.append(f'<g class="action" data-kind="{kind}" data-stage="{stage}" data-microbatch="{mb}" '
                             f'data-instance="{inst}"><rect x="{x}" y="{y}" width="{w - 3}" height="{h}" rx="3" '
                             f'fill="{fill}" stroke="#6b7280"/><text x="{x + 3}" y="{y + 11}">{kind}{mb} s{stage}</text>'
                             f'<text x="{x + 3}" y="{y + 22}" fill="#374151">i{inst}</text></g>')
    parts.append(f'<text x="4" y="{height - 8}">F: forward (writes its leases into instance i), B: backward (frees '
                 'it); colour: stage</text></svg>')
    return "\n".join(parts)
