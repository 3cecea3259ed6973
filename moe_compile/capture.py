"""Entry functions for torch.compile with a code object of their own.

Dynamo keeps its cache entries, recompile counts and frame decisions (skip, run-only) on code
objects. Every function torch.compile captures for moe_compile (a whole model, a pipeline stage, a
recording capture) gets a fresh code object, so that no other compile in the process — another
instance, another stage of the same pipeline — can use up its recompile limit or decide its frames.
"""

from __future__ import annotations

import functools
import itertools
import types

import torch

# Recompiles of one entry (input shapes, train/eval, grad mode) before torch.compile gives up on it;
# with fullgraph (the default) going past it is a FailOnRecompileLimitHit, never a silent eager run.
RECOMPILE_LIMIT = 64
_ids = itertools.count()


def compile_entry(fn, **kwargs):
    """``torch.compile(fn, **kwargs)`` with moe_compile's recompile limit for this entry. torch.compile
    takes a per-entry ``recompile_limit`` in torch 2.13; torch 2.11 has none (a TypeError), so there
    dynamo's process-wide limit is raised to RECOMPILE_LIMIT instead (never lowered)."""
    import inspect

    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return torch.compile(fn, recompile_limit=RECOMPILE_LIMIT, **kwargs)
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, **kwargs)


def fresh(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a code object of its own (same body, globals and closure)."""
    code = fn.__code__
    name = f"{code.co_name}_{next(_ids)}"
    code = code.replace(co_name=name, **({"co_qualname": name} if hasattr(code, "co_qualname") else {}))
    return types.FunctionType(code, fn.__globals__, name, None, fn.__closure__)


@functools.cache
def decompositions() -> dict:
    """Ops aot_autograd decomposes before the joint graph is traced: those whose fake (meta) strides differ
    from their kernel's, so that a ``view`` the graph holds on their result fails at run time although it
    traced. ``softplus_backward`` (gated-delta-rule linear attention: Qwen3-Next, Qwen3.5-MoE, Lara): its
    CPU kernel lays the gradient out like ``grad_output``, its meta like ``self``."""
    from torch._decomp import get_decompositions

    return get_decompositions([torch.ops.aten.softplus_backward])


def _forward_lines(cls) -> tuple[str, int, int] | None:
    """(file, first line, last line) of ``cls.forward``'s own code (decorators unwrapped)."""
    import inspect

    fn = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    lines = [ln for _, _, ln in code.co_lines() if ln is not None]
    return code.co_filename, code.co_firstlineno, max(lines, default=code.co_firstlineno)


def _raised_while_tracing(e: BaseException) -> BaseException | None:
    """A moe_compile error that code dynamo traced raised (a canonical forward refusing its arguments):
    dynamo reports it as Unsupported caused by an Observed<Name>Error whose text is ``raised exception
    Name("message")``, without the exception object; rebuilt here so the caller gets our error."""
    import ast
    import re

    from . import errors

    cause = e.__cause__
    if cause is None or not type(cause).__name__.startswith("Observed") or not cause.args:
        return None
    m = re.fullmatch(r"raised exception (\w+)\((.*)\)", str(cause.args[0]), re.S)
    cls = getattr(errors, m.group(1), None) if m else None
    if not (isinstance(cls, type) and issubclass(cls, errors.MoECompileError)):
        return None
    try:
        message = ast.literal_eval(m.group(2))
    except (ValueError, SyntaxError):
        return None
    return cls(message) if isinstance(message, str) else None


def pass_error(e: BaseException) -> BaseException | None:
    """The moe_compile error a pass raised inside the backend (dynamo wraps it in BackendCompilerFailed:
    e.g. context parallelism's attention checks, a position table too short), else None."""
    from torch._dynamo.exc import BackendCompilerFailed

    from .errors import MoECompileError

    inner = getattr(e, "inner_exception", None)
    return inner if isinstance(e, BackendCompilerFailed) and isinstance(inner, MoECompileError) else None


def capture_error(e: BaseException, model: torch.nn.Module) -> BaseException | None:
    """The error to raise for a failed capture: a moe_compile error a pass raised inside the backend
    (dynamo wraps it in BackendCompilerFailed), or the UnsupportedFeatureError for data-dependent Python
    control flow or shapes in the user's model (a branch, loop or size on tensor values, which one static
    graph cannot hold), naming the innermost module whose forward holds it; None for any other error."""
    from torch._dynamo.exc import UserError

    from .errors import UnsupportedFeatureError

    inner = pass_error(e)
    if inner is not None:
        return inner
    raised = _raised_while_tracing(e)
    if raised is not None:
        return raised
    text = str(e)
    if not (isinstance(e, UserError) and "data-dependent" in text):
        return None
    spans: dict[type, tuple | None] = {}
    for frame in reversed(getattr(e, "real_stack", None) or []):
        for path, mod in model.named_modules():
            span = spans.setdefault(type(mod), _forward_lines(type(mod)))
            if path and span and span[0] == frame.filename and span[1] <= frame.lineno <= span[2]:
                where = f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
                return UnsupportedFeatureError(
                    f"{path} ({type(mod).__name__}): data-dependent Python control flow or shapes (`{frame.line}` at "
                    f"{where}) cannot be captured as one static graph; {text.strip().splitlines()[0]}")
    return None
