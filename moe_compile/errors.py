"""Errors raised by moe_compile. Each names the thing at fault and the rule it broke."""

from __future__ import annotations


class MoECompileError(Exception):
    """Base class: every error moe_compile raises on purpose derives from it."""


class MeshError(MoECompileError, ValueError):
    """A mesh whose degrees do not fit together or do not fit the world."""


class RecognitionError(MoECompileError):
    """A model (or module) whose MoE structure could not be understood."""


class UnsupportedFeatureError(RecognitionError):
    """A recognised MoE block uses a feature the compiler does not support."""


class OptionError(MoECompileError, ValueError):
    """An invalid compile option."""


class IRError(MoECompileError):
    """A graph that breaks the IR contract after a pass; the message names the pass."""


class RuntimeFault(MoECompileError, RuntimeError):
    """A runtime guard fired (transport, capacity, buffer lifetime)."""


class CheckpointError(MoECompileError):
    """A checkpoint that is missing, incomplete, truncated, or does not match the model."""
