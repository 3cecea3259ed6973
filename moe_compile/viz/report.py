"""HTML report: the ledger table, the graphs, the lease timeline, and what the compiler decided
(MoE blocks, pass op-count diffs, gradient buckets). One self-contained file: pictures are inlined
as SVG (a very large one is linked instead); a picture given as its graph source (.dot, graphviz's
``dot`` program missing) is linked with a note saying how to install graphviz and draw it."""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path

from ..ledger import Ledger
from .graph import DOT_MISSING

INLINE_LIMIT = 3 * 2**20
CSS = """
body{font-family:Helvetica,Arial,sans-serif;margin:24px;color:#111827;max-width:1400px}
h1{font-size:22px} h2{font-size:18px;margin-top:28px;border-bottom:1px solid #e5e7eb}
table{border-collapse:collapse;font-size:12px} td,th{border:1px solid #e5e7eb;padding:3px 6px;text-align:left}
th{background:#f3f4f6} td.v{text-align:right;white-space:nowrap;font-family:monospace}
td.f{font-family:monospace;font-size:11px;color:#374151} .note{color:#92400e}
.pic{overflow:auto;border:1px solid #e5e7eb;margin:8px 0;max-height:900px}
"""


@dataclass
class Picture:
    caption: str
    path: Path  # an SVG (inlined), a PNG (linked) or a graph source .dot (linked, not drawn)


def _svg_inline(path: Path) -> str:
    text = path.read_text()
    text = re.sub(r"<\?xml[^>]*>\s*", "", text)
    return re.sub(r"<!DOCTYPE[^>]*>\s*", "", text)


def ledger_table(ledger: Ledger) -> str:
    rows = ["<table class='ledger'><tr><th>group</th><th>figure</th><th>value</th><th>definition</th>"
            "<th>meaning</th></tr>"]
    for group, name, value, form, doc in ledger.rows():
        rows.append(f"<tr data-figure='{html.escape(name)}'><td>{html.escape(group)}</td><td>{html.escape(name)}</td>"
                    f"<td class='v'>{html.escape(value)}</td><td class='f'>{html.escape(form)}</td>"
                    f"<td>{html.escape(doc)}</td></tr>")
    rows.append("</table>")
    return "\n".join(rows)


def write_report(path: str | Path, *, title: str, ledger: Ledger, pictures: list[Picture], timeline: str | None,
                 sections: dict[str, str] | None = None, notes: list[str] | None = None) -> Path:
    """Write the HTML report to ``path``. ``timeline`` is SVG text (or None: no lease plan);
    ``sections`` maps a heading to ready HTML."""
    path = Path(path)
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
           f"<style>{CSS}</style></head><body>", f"<h1>{html.escape(title)}</h1>"]
    out.append(f"<p><b>{html.escape(ledger.shorthand)}</b> (P_active@P_total) · "
               f"P_local {ledger['P_local']:,} parameters per rank</p>")
    for n in list(notes or []) + ledger.notes:
        out.append(f"<p class='note'>{html.escape(n)}</p>")
    out.append("<h2>Cost ledger</h2>")
    out.append(ledger_table(ledger))
    out.append("<h2>Graphs</h2>")
    if any(pic.path.suffix == ".dot" for pic in pictures):
        out.append(f"<p class='note dot-missing'>{html.escape(DOT_MISSING)}.</p>")
    for pic in pictures:
        out.append(f"<h3>{html.escape(pic.caption)}</h3>")
        rel = pic.path.name if pic.path.parent == path.parent else str(pic.path)
        if pic.path.suffix == ".dot":
            svg = pic.path.with_suffix(".svg").name
            out.append(f"<p class='note'>not drawn (no graphviz `dot`); graph source: "
                       f"<a href='{html.escape(rel)}'>{html.escape(pic.path.name)}</a> (draw it with "
                       f"<code>dot -Tsvg {html.escape(pic.path.name)} -o {html.escape(svg)}</code>)</p>")
        elif pic.path.suffix == ".svg" and pic.path.stat().st_size <= INLINE_LIMIT:
            out.append(f"<div class='pic'>{_svg_inline(pic.path)}</div>")
        else:
            out.append(f"<div class='pic'><a href='{html.escape(rel)}'><img src='{html.escape(rel)}' "
                       f"alt='{html.escape(pic.caption)}'></a></div>")
    out.append("<h2>Lease timeline</h2>")
    if timeline is None:
        out.append("<p class='note'>no lease plan: this program has no <code>lease_plan</code> "
                   "(symmetric payload lifetimes are not planned yet)</p>")
    else:
        out.append(f"<div class='pic'>{timeline}</div>")
    for heading, body in (sections or {}).items():
        out.append(f"<h2>{html.escape(heading)}</h2>{body}")
    out.append("</body></html>")
    path.write_text("\n".join(out))
    return path
