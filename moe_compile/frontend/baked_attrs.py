"""Baked attributes: the plain Python values (int, float, bool, str, None) that a block's replaced code
reads from ``self``, as they were when compiling, checked before every run.

The canonical forms replace the experts' forward, the router's (components mode) or the whole block's
(block mode), and what they read was settled when compiling: the routing the probe recognised (a
temperature of 1.0 read as a plain softmax, a top-k read from ``router.top_k``), a clamp limit, a
scaling factor. Changing such an attribute afterwards (``block.temperature = 2.0``,
``router.top_k = 4``) changed nothing in the program: the run went on with the compile-time value,
silently. So the attributes that the replaced ``forward`` reads as ``self.<name>`` (directly or through
the methods it calls) and that hold a plain value are recorded, and a run that finds one changed is refused, naming the attribute,
both values and the remedy (recompile from a fresh model). Modules whose forward still runs as the
user wrote it (a block in components mode, a shared expert) read their attributes live and are not
recorded. Cost: one getattr and compare per recorded attribute per call.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass, field
from functools import cache

import torch.nn as nn

from ..errors import OptionError
from .spec import MoEBlockSpec

_PLAIN = (bool, int, float, str, type(None))


def _self_attrs(fn: ast.AST, ctx: type) -> set[str]:
    return {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ctx)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}


@cache
def _self_reads(cls: type) -> frozenset[str]:
    """Names the replaced ``forward`` reads as ``self.<name>``, directly or through the methods it calls
    (``self.route(...)``), in the user's classes (torch's own and classes without source contribute none).
    Not recorded: what a method other than ``__init__`` assigns — state the user's code keeps updating (a
    counter, a bias step a method between steps reads), not a compile-time constant."""
    methods: dict[str, ast.AST] = {}
    for k in reversed(cls.__mro__):  # a subclass's method overrides its base's
        if k.__module__.split(".")[0] in ("torch", "builtins", "moe_compile"):  # not the user's code
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(k)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = next((n for n in tree.body if isinstance(n, ast.ClassDef)), None)
        for fn in body.body if body is not None else ():
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                methods[fn.name] = fn
    reads: set[str] = set()
    todo, seen = ["forward"], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in methods:
            continue
        seen.add(name)
        found = _self_attrs(methods[name], ast.Load)
        todo += [a for a in found if a in methods]
        reads |= found - set(methods)
    updated = set().union(*(_self_attrs(fn, ast.Store) for n, fn in methods.items() if n != "__init__"))
    return frozenset(reads - updated - {"training"})


@dataclass
class BakedAttrs:
    """(module path, module, attribute, value when compiling) for each recorded attribute."""

    entries: list[tuple[str, nn.Module, str, object]] = field(default_factory=list)

    def changed(self, where: str) -> OptionError | None:
        for path, mod, name, value in self.entries:
            now = getattr(mod, name, _MISSING)
            if now is not value and (type(now) is not type(value) or now != value):  # a tensor: no __eq__ call
                shown = "deleted" if now is _MISSING else repr(now)
                return OptionError(
                    f"{where}: {path}.{name} was {value!r} when compiling and is {shown} now; the compiled "
                    "program replaced the code that reads it and keeps the compile-time value, so the change "
                    "would be ignored. Compile a fresh model with the new value instead")
        return None


_MISSING = object()


def _replaced_modules(block: nn.Module, spec: MoEBlockSpec) -> list[tuple[str, nn.Module]]:
    """The modules whose forward the canonical form replaced: the experts (every module under them: a fused
    experts module; an nn.ModuleList of FFNs was swapped for the canonical weights already, so the model no
    longer holds those modules), the router, and in block mode the block itself (not its shared expert or
    gate: those still run)."""
    out = []
    if spec.mode == "block":
        out.append(("", block))
    router = getattr(block, spec.router_attr, None) if spec.router_attr else None
    if isinstance(router, nn.Module) and not spec.router.own_forward:  # else its own forward runs
        out.append((spec.router_attr, router))
    experts = getattr(block, spec.experts_attr, None) if spec.experts_attr else None
    if isinstance(experts, nn.Module):
        out += [(f"{spec.experts_attr}.{n}".rstrip("."), m) for n, m in experts.named_modules()]
    return out


def baked_attrs(blocks: list[tuple[MoEBlockSpec, nn.Module]]) -> BakedAttrs:
    """Record the plain values the replaced code of each (spec, block) reads."""
    found = BakedAttrs()
    for spec, block in blocks:
        for sub, mod in _replaced_modules(block, spec):
            path = ".".join(p for p in (spec.path, sub) if p)
            for name in sorted(_self_reads(type(mod))):
                value = mod.__dict__.get(name, _MISSING)
                if value is not _MISSING and isinstance(value, _PLAIN):
                    found.entries.append((path, mod, name, value))
    return found
