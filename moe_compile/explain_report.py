"""What ``moe-compile explain`` writes: ledger.json, the graphs (their graphviz sources .dot, and SVG,
PNG drawn from them), the lease timeline and report.html. Shared by the CLI and by anyone holding a
compiled model (``write_outputs(cm, …)``).

Without graphviz's ``dot`` program (pip installs pydot, not graphviz) everything is still written
except the SVG/PNG pictures: the report links the .dot sources instead, and one message saying how to
install graphviz goes to ``messages``."""

from __future__ import annotations

import html
import json
from pathlib import Path

from .ledger import Ledger
from .viz import (
    DOT_MISSING,
    GraphvizMissing,
    Picture,
    bucket_reductions,
    build_view,
    have_dot,
    timeline_svg,
    write_report,
    write_view,
)
from .viz.graph import groups_of


def _first_moe_layer(gm) -> str | None:
    from .ir import MOE_META

    groups = groups_of(gm)
    return next((groups[n] for n in gm.graph.nodes if MOE_META in n.meta), None)


def write_outputs(cm, ledger: Ledger, out: Path, *, name: str, rank: int = 0, seq_len: int | None = None,
                  batch_size: int | None = None, png: bool = True, max_nodes: int = 350,
                  published: str = "", messages: list[str] | None = None, pipeline: dict | None = None,
                  programs: dict | None = None, cp: dict | None = None) -> dict[str, Path]:
    """Write the outputs to ``out``; returns what was written (key → path). ``messages`` (if given)
    receives what the caller should tell the user (one line when graphviz is missing)."""
    prog = cm.program
    graphs = prog.graphs
    files: dict[str, Path] = {}
    data = ledger.to_dict()
    if pipeline is not None:
        data["pipeline"] = pipeline
    if cp is not None:
        data["context_parallel"] = cp
    data["run"] = {"model": name, "mesh": str(prog.mesh), "rank": rank, "world": prog.mesh.world_size,
                   "seq_len": seq_len, "batch_size": batch_size, "published": published}
    files["ledger"] = out / "ledger.json"
    files["ledger"].write_text(json.dumps(data, indent=1))

    pictures: list[Picture] = []
    drawing = have_dot()

    def draw(key: str, caption: str, gm, **kw) -> None:
        nonlocal drawing
        view = build_view(gm, title=f"{name} · {caption}", max_nodes=max_nodes, pp=prog.mesh.pp, **kw)
        tag = " (collapsed per layer)" if view.collapsed else ""
        files[f"{key}_dot"] = Path(write_view(view, str(out / f"{key}.dot")))
        picture = files[f"{key}_dot"]
        if drawing:
            try:
                files[key] = picture = Path(write_view(view, str(out / f"{key}.svg")))
                if png:
                    files[f"{key}_png"] = Path(write_view(view, str(out / f"{key}.png")))
            except GraphvizMissing:  # gone since the lookup
                drawing = False
        pictures.append(Picture(caption + tag, picture))

    for s, sprog in sorted((programs or {}).items()):  # pipeline: each stage's graphs, drawn as its stage
        if "partitioned" in sprog.graphs:
            draw(f"stage{s}_partitioned", f"stage {s}: forward IR after the passes", sprog.graphs["partitioned"],
                 direction="fwd", stage=s)
        if "backward" in sprog.graphs:
            draw(f"stage{s}_backward", f"stage {s}: backward graph", sprog.graphs["backward"], direction="bwd",
                 stage=s)
    if "partitioned" in graphs:
        draw("partitioned", f"forward IR after the passes (rank {rank})", graphs["partitioned"], direction="fwd")
        layer = _first_moe_layer(graphs["partitioned"])
        if layer is not None and len(graphs["partitioned"].graph.nodes) > max_nodes:
            draw("layer", f"{layer} in detail", graphs["partitioned"], collapse=False, only_group=layer,
                 direction="fwd")
    if "backward" in graphs:
        bw = graphs["backward"]
        draw("backward", "backward graph and gradient reductions", bw, reductions=bucket_reductions(cm, bw),
             direction="bwd")
    plan = cm.lease_plan() if callable(getattr(cm, "lease_plan", None)) else None
    timeline = timeline_svg(plan, f"{name} lease timeline") if plan is not None else None
    if timeline is not None:
        files["timeline"] = out / "timeline.svg"
        files["timeline"].write_text(timeline)
    if pipeline is not None and getattr(cm, "pipeline", None) is not None:  # the lease walk over the schedule
        from .viz.schedule import schedule_svg

        files["schedule"] = out / "schedule.svg"
        files["schedule"].write_text(schedule_svg(cm.pipeline.schedule, f"{name} lease instances"))
        pictures.append(Picture("pipeline schedule: lease instance of every forward and backward", files["schedule"]))

    blocks = "<table><tr><th>MoE block</th><th>what the front end understood</th><th>probed</th></tr>" + "".join(
        f"<tr><td>{html.escape(b.path)}</td><td>{html.escape(b.describe())}</td>"
        f"<td>{'yes' if b.checked else 'no (meta weights: read from attributes)'}</td></tr>"
        for b in prog.blocks.values()) + "</table>"
    records = "<table><tr><th>pass</th><th>op-count diff</th></tr>" + "".join(
        f"<tr><td>{html.escape(r.name)}</td><td>{html.escape(str(dict(sorted(r.op_diff.items()))))}</td></tr>"
        for r in prog.records) + "</table>"
    sections = {"MoE blocks": blocks, "Passes": records}
    if prog.options.capacity_factor is None and "C_bound" in ledger.figures:  # dropless receive buffer
        sections["Dropless receive buffer"] = dropless_table_html(ledger)
    if cp is not None:
        from .explain_cp import cp_table_html

        sections["Context parallelism"] = cp_table_html(cp)
    if pipeline is not None:
        from .explain_pipeline import stage_table_html

        sections["Pipeline stages"] = stage_table_html(pipeline)
    if cm.ddp is not None:
        sections["Gradient buckets"] = "<table><tr><th>family</th><th>dtype</th><th>params</th><th>bytes</th>" \
            "<th>reduction</th><th>reduced through</th></tr>" + \
            "".join(f"<tr><td>{b['family']}</td><td>{b['dtype']}</td><td>{b['params']}</td><td>{b['bytes']:,}</td>"
                    f"<td>{b['reduction']}</td><td>{b['transport']}</td></tr>"
                    for b in cm.ddp.bucket_summary()) + "</table>"
    notes = [f"mesh {prog.mesh} ({prog.mesh.world_size} ranks), seen from rank {rank}"
             + (f"; {batch_size}×{seq_len} tokens per rank per micro-batch" if seq_len else "")]
    if published:
        notes.append(published)
    files["report"] = write_report(out / "report.html", title=f"moe-compile explain: {name}", ledger=ledger,
                                   pictures=pictures, timeline=timeline, sections=sections, notes=notes)
    if not drawing and pictures and messages is not None:
        messages.append(DOT_MISSING)
    return files


def dropless_table_html(ledger: Ledger) -> str:
    """Receive rows and capacity-sized bytes per MoE layer: headroom (uniform), the given imbalance ρ, and
    the static bound ep_mp·T·K (runtime.dropless: the capacity grows only when a load needs it)."""
    from .ledger import format_value

    rows = [("uniform (rho ≤ h_d)", "C", "M_recv_uniform"), (f"rho = {ledger.values.get('rho', 1)}", "C_rho",
            "M_recv_rho"), ("bound (all to one rank)", "C_bound", "M_recv_bound")]
    return "<table><tr><th>load</th><th>receive rows</th><th>bytes per MoE layer</th></tr>" + "".join(
        f"<tr><td>{html.escape(w)}</td><td>{format_value(ledger[c], 'rows')}</td>"
        f"<td>{format_value(ledger[m], 'bytes')}</td></tr>" for w, c, m in rows) + "</table>"
