"""Runtime: transports, route plans, runtime contexts and counters."""

from .context import LOCAL_CONTEXT, RuntimeContext, get_context, register_context, release_context
from .route_plan import RoutePlan, keep_counts
from .stats import RuntimeStats
from .transport import AllToAllTransport, LocalTransport, Transport

__all__ = [
    "LOCAL_CONTEXT",
    "AllToAllTransport",
    "LocalTransport",
    "RoutePlan",
    "RuntimeContext",
    "RuntimeStats",
    "Transport",
    "get_context",
    "keep_counts",
    "register_context",
    "release_context",
]
