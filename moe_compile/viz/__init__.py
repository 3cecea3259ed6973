"""Visualisation of the MoE IR (graphviz): graphs with MoE layers and pipeline stages as clusters,
node kinds by colour and shape, a lease timeline, and an HTML report with the cost ledger.
Reads the IR and the plans; never drives execution. SVG and PNG need graphviz's ``dot`` program
(``have_dot()``; without it ``write_view`` raises ``GraphvizMissing``, whose message says how to
install it); .dot sources, the lease timeline and the report need nothing beyond pydot."""

from .graph import (
    DOT_MISSING,
    GraphView,
    GraphvizMissing,
    Reduction,
    build_view,
    have_dot,
    value_label,
    warn_dot_missing,
    write_view,
)
from .reductions import bucket_reductions, grad_producers
from .report import Picture, write_report
from .style import LOOKS, kind_of
from .timeline import live_steps, timeline_high_water, timeline_svg

__all__ = [
    "DOT_MISSING",
    "LOOKS",
    "GraphView",
    "GraphvizMissing",
    "Picture",
    "Reduction",
    "bucket_reductions",
    "build_view",
    "grad_producers",
    "have_dot",
    "kind_of",
    "live_steps",
    "timeline_high_water",
    "timeline_svg",
    "value_label",
    "warn_dot_missing",
    "write_report",
    "write_view",
]
