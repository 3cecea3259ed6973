"""The model's load-balancing loss under context parallelism, over the whole sequences.

Terms: CP group, shard (runtime/context_parallel.py). A transformers MoE causal LM with
``output_router_logits`` adds ``coef · load_balancing_loss_func(router_logits, …)`` to its loss: the
fraction of routed rows per expert times the mean router probability per expert, over every token of
the batch. That is bilinear in per-token statistics, so a shard's value (or the mean of the shards'
values) is not the whole sequence's (Mixtral at cp=2: loss 7.56 for 6.55), and this was refused.

While a CP rank's forward runs (and is traced), the function the model's module calls is wrapped:

    logits_l  ← moe_cp::all_gather(logits_l, dim 0)    every layer's router logits of the CP group's
                                                        shards (backward: reduce-scatter, the sum of
                                                        every rank's gradient for this shard's rows)
    mask      ← moe_cp::all_gather(attention_mask, dim 0): the shards' padding masks, [cp·b, S/cp], rows
                in the gathered logits' order (rank, sequence, token)
    aux       ← the family's own function on them
    return aux / q                                      q: the context's cp_aux_divisor

Every rank of the group computes the whole-sequence aux. At pp = 1 the CP group's loss is the sum of
its ranks' losses (LossSum), so each adds aux/cp (q = cp), and the reduce-scatter hands each shard Σ
over ranks of (1/cp)·∂aux/∂logits = ∂aux/∂logits; ``aux_loss`` in the output is summed over the group
like the loss. At pp > 1 the schedule weights rank r's loss of microbatch j by its share n_rj/N of the
batch's loss tokens (runtime/pipeline_runtime.py), so each adds the whole aux (q = 1): Σ_r n_rj/N·aux_j
is aux_j weighted by microbatch j's share, as at cp = 1, however unevenly the labels are masked across
the shards (the weights sum over the group to the microbatch's, and aux_j is the same on every rank).
Cost: the router logits all-gathered, [tokens, N] per MoE layer (N experts), against the K/V gathers.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn

NAME = "load_balancing_loss_func"


def _forwards(model: nn.Module) -> list[Callable]:
    """Every forward the model's modules run or inherit (under transformers' decorators): a subclass's
    forward calling its parent's, a wrapper module calling the transformers model it holds."""
    seen, out = set(), []
    for mod in model.modules():
        for cls in type(mod).__mro__:
            fn = cls.__dict__.get("forward")
            if fn is not None and id(fn) not in seen:
                seen.add(id(fn))
                out.append(inspect.unwrap(fn))
    return out


def _namespaces(model: nn.Module) -> list[dict]:
    """The module globals those forwards read ``load_balancing_loss_func`` from (found once per model)."""
    if model not in _FOUND:
        out = {}
        for fn in _forwards(model):
            g = getattr(fn, "__globals__", None)
            if g is not None and callable(g.get(NAME)):
                out[id(g)] = g
        _FOUND[model] = list(out.values())
    return _FOUND[model]


_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def whole_sequence(fn: Callable, ctx: int, cp: int, divisor: int) -> Callable:
    names = list(inspect.signature(fn).parameters)  # read here: the wrapper itself is traced
    mask = names.index("attention_mask") - 1 if "attention_mask" in names[1:] else None  # its index in *args

    def balance_loss(gate_logits, *args, **kwargs):
        if isinstance(gate_logits, tuple | list) and gate_logits:
            gate_logits = tuple(torch.ops.moe_cp.all_gather(t, 0, ctx, cp) for t in gate_logits)
        if mask is not None:  # the shard's padding mask → the group's, [cp·b, S/cp] in the gathered rows' order
            given = kwargs.get("attention_mask") if "attention_mask" in kwargs else (
                args[mask] if len(args) > mask else None)
            if isinstance(given, torch.Tensor):
                given = torch.ops.moe_cp.all_gather(given, 0, ctx, cp)
                if "attention_mask" in kwargs:
                    kwargs["attention_mask"] = given
                else:
                    args = (*args[:mask], given, *args[mask + 1:])
        return fn(gate_logits, *args, **kwargs) / divisor

    balance_loss.wrapped = fn
    return balance_loss


def unsupported_balance_loss(model: nn.Module) -> str | None:
    """Why the model's own load-balancing loss cannot be made the whole sequences' (None: it can, or the
    model computes none): a forward of its modules assigns an aux_loss, and none reads ``NAME``."""
    if _namespaces(model):
        return None
    for fn in _forwards(model):
        try:
            src = inspect.getsource(fn)
        except (OSError, TypeError):
            continue
        if re.search(r"\baux_loss\s*=\s*(?!None\b)", src):
            return (f"{fn.__qualname__} computes an aux_loss without transformers' {NAME}, which moe_compile "
                    "gathers over the CP group: it would use one sequence shard's router statistics")
    return None


def check_balance_loss(model: nn.Module, kwargs: dict) -> None:
    """A call asking for the load-balancing loss (``output_router_logits=True``) of a model whose loss
    cannot be made the whole sequences': OptionError naming why."""
    why = unsupported_balance_loss(model) if kwargs.get("output_router_logits") else None
    if why is not None:
        from ..errors import OptionError

        raise OptionError(f"context parallelism: output_router_logits=True: {why}; leave it out or use cp=1")


@contextlib.contextmanager
def whole_sequence_balance_loss(model: nn.Module, ctx: int, cp: int) -> Iterator[None]:
    """Inside the block, the model's load-balancing loss is the whole sequences' (module docstring)."""
    from . import get_context

    divisor = get_context(ctx).cp_aux_divisor
    saved = []
    try:
        for g in _namespaces(model):
            orig = g[NAME]
            base = getattr(orig, "wrapped", orig)
            saved.append((g, orig))
            key = (id(base), ctx, cp, divisor)
            if key not in _WRAPPERS:  # made once: it reads the signature, and the forward runs every step
                _WRAPPERS[key] = whole_sequence(base, ctx, cp, divisor)
            g[NAME] = _WRAPPERS[key]
        yield
    finally:
        for g, orig in saved:
            g[NAME] = orig


_WRAPPERS: dict[tuple[int, int, int, int], Callable] = {}  # one object per (function, context): dynamo's guards hold
