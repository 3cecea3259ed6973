"""Visualisation of the MoE IR (graphviz): graphs with MoE layers and pipeline stages as clusters,
node kinds by colour and shape, a lease timeline, and an HTML report with the cost ledger.
Reads the IR and the plans; never drives execution."""

from .graph import GraphView, Reduction, build_view, value_label, write_view
from .reductions import bucket_reductions, grad_producers
from .report import Picture, write_report
from .style import LOOKS, kind_of
from .timeline import live_steps, timeline_high_water, timeline_svg

__all__ = [
    "LOOKS",
    "GraphView",
    "Picture",
    "Reduction",
    "bucket_reductions",
    "build_view",
    "grad_producers",
    "kind_of",
    "live_steps",
    "timeline_high_water",
    "timeline_svg",
    "value_label",
    "write_report",
    "write_view",
]
