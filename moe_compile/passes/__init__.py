"""Compiler passes over the MoE IR, one per file; ``pipeline`` holds their order."""

from .base import MoEPass, PassContext, moe_pass
from .pipeline import FORWARD_PASSES, JOINT_PASSES, run_passes
from .verify import verify

__all__ = ["FORWARD_PASSES", "JOINT_PASSES", "MoEPass", "PassContext", "moe_pass", "run_passes", "verify"]
