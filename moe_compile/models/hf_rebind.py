"""A modeling module's function run with some of its global names rebound, for the CP state-passing forms.

The function's code runs over a copy of its module's namespace. The copy is a module of its own, registered
in sys.modules: dynamo guards a function's globals through the module its ``__name__`` names, and would
otherwise read the original names from the modeling module.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import types

_COPIES = itertools.count()


def namespace_copy(names: dict, prefix: str, **overrides) -> types.ModuleType:
    """A fresh module registered in sys.modules holding ``names`` (its own ``__name__``), with ``overrides``."""
    scope = types.ModuleType(f"{prefix}_{next(_COPIES)}")
    scope.__dict__.update({k: v for k, v in names.items() if k not in ("__name__", "__spec__")})
    scope.__dict__.update(overrides)
    sys.modules[scope.__name__] = scope
    return scope


def rebound(fn, prefix: str, **overrides) -> types.FunctionType:
    """``fn`` (unwrapped) over a copy of its globals with ``overrides`` in place of those names."""
    inner = inspect.unwrap(fn)
    scope = namespace_copy(inner.__globals__, prefix, **overrides)
    copy = types.FunctionType(inner.__code__, scope.__dict__, inner.__name__, inner.__defaults__, inner.__closure__)
    copy.__kwdefaults__ = inner.__kwdefaults__
    return copy
