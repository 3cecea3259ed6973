"""One verdict on a training step's batches, agreed over the world before any rank runs the step.

A ``train_step`` is collective: every rank's forward meets its peers in dispatch/combine (EP-MP), in the
pipeline's sends and receives (PP), in the K/V all-gathers (CP) and in the gradient reduction (DP). A
batch that one rank alone refuses — out-of-vocabulary token ids or labels, a batch that does not split
into the microbatches, a CP shard it cannot cut, another shape than a pipeline's first step — used to
stop that rank only: its peers waited in their first collective until the timeout, or, if the caller
caught the error and went on, paired that step's collectives with the refusing rank's next step.

So each rank makes its own checks first (``err``: an OptionError or None), then one small all-reduce
(MAX of [refused, bad ids, bad labels, batch differs] · (rank + 1)) and one host read decide for all: every rank raises
an OptionError before anything runs — the refusing rank its own message, the others naming it — and the
next step starts clean on every rank. Cost: one all-reduce of 4 int64 and one host read per train_step
(on a GPU the read waits for the work already queued, once per step, before the step's first kernel).
``cm(...)`` alone (forward only, or the user's own loop) is not agreed: it refuses on the host, locally;
at cp > 1 or pp > 1 it compares the CP group's and the pipeline's batches (``same_batch_in_groups``, one
all-reduce of two int64 per group).

Every rank of one pipeline and of one CP group must pass the same batch (the stages and the shards cut
one batch). A data loader sharded by global rank instead of by data-parallel replica gave them different
batches, and the step trained on a mix of them — stage 0's ids with the last stage's labels, one
sequence's shard attending to another's — with no error. So at pp > 1 or cp > 1 each rank also takes a
fingerprint of its batch (names, shapes, dtypes, and each tensor's elements mixed with their positions
in wrapping int64 arithmetic) and compares it within those groups (one all-reduce of two int64 per group, before the world's); a
mismatch is refused like any other batch. Cost: those one or two small all-reduces per train_step.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import OptionError
from . import token_range

_SUFFIX = "; no rank started the step"


_CHUNK = 1 << 20  # elements hashed at once: int64 temporaries of 8 MiB, whatever the batch's size
_MIX = (0x2545F4914F6CDD1D, 0x5851F42D4C957F2D)  # odd 64-bit multipliers (wrapping int64 arithmetic)


def fingerprint(batch: dict[str, Any], device: torch.device) -> torch.Tensor:
    """One int64 (a tensor on ``device``: no host read) of a batch's tensors: equal for equal batches; another
    name, shape, dtype or value changes it almost surely: each element is mixed with its position through
    multiplications and an xor-shift before the wrapping sum, so permuted or offsetting changes (which a
    weighted sum alone would miss) change it too."""
    fp = torch.zeros((), dtype=torch.int64, device=device)
    for k in sorted(batch):
        v = batch[k]
        if not isinstance(v, torch.Tensor):
            continue
        flat = v.detach().reshape(-1)
        if v.is_floating_point() or v.is_complex():  # the bits, as integers
            flat = flat.contiguous().view(torch.uint8).view(-1, flat.element_size()).to(torch.int64)
            flat = (flat << (8 * torch.arange(flat.shape[1], device=flat.device))).sum(1)
        tag = zlib.crc32(f"{k}{tuple(v.shape)}{v.dtype}".encode())  # not hash(): salted per process
        total = torch.zeros((), dtype=torch.int64, device=flat.device)
        for lo in range(0, flat.numel(), _CHUNK):
            x = flat[lo: lo + _CHUNK].to(torch.int64)
            h = x * _MIX[0] + torch.arange(lo + 1, lo + 1 + x.numel(), dtype=torch.int64, device=x.device)
            h = (h ^ (h >> 29)) * _MIX[1]
            total = total + (h ^ (h >> 32)).sum()
        fp = fp * 1_000_003 + tag + total.to(device)
    return fp & (2**62 - 1)


def _same_batch_mismatch(batch: dict[str, Any], groups: list, device: torch.device) -> tuple[torch.Tensor, str | None]:
    """Whether the ranks of any of ``groups`` hold different batches (MAX of (fp, -fp) per group), as a bool
    tensor on ``device``; and why this rank could not fingerprint its batch (it still takes part in the
    reductions, so its peers do not wait)."""
    differs = torch.zeros((), dtype=torch.bool, device=device)
    if not groups:
        return differs, None
    why = None
    try:
        fp = fingerprint(batch, device)
    except (RuntimeError, TypeError) as e:  # a tensor it cannot read as integers (sparse, say)
        fp, why = torch.zeros((), dtype=torch.int64, device=device), f"{type(e).__name__}: {e}"
    for g in groups:
        t = torch.stack([fp, -fp])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
        differs = differs | (t[0] != -t[1])
    return differs, why


def agree_on_batch(model: nn.Module, batch: dict[str, Any], err: OptionError | None, where: str = "train_step",
                   same_batch: tuple = ()) -> None:
    """Raise on every rank of the world if any rank refused its batch (``err``), holds token ids or labels
    outside the model's vocabulary, or passed another batch than the ranks of a group in ``same_batch``
    (its pipeline's, its CP group's process groups); return on every rank otherwise."""
    vocab = token_range.vocab_size(model)
    ids, labels = (t if token_range.is_integer_tensor(t) else None for t in (batch.get("input_ids"), batch.get("labels")))
    device = next(model.parameters()).device
    no = torch.zeros((), dtype=torch.bool, device=device)
    differs, why = _same_batch_mismatch(batch, [g for g in same_batch if g is not None], device)
    if why is not None and err is None:
        err = OptionError(f"{where}: the batch could not be compared with the pipeline's and CP group's ({why})")
    mine = torch.stack([torch.full((), err is not None, device=device),
                        token_range.bad_ids(ids, vocab).any().to(device) if vocab and ids is not None else no,
                        token_range.bad_labels(labels, vocab).any().to(device)
                        if vocab and labels is not None and labels.dim() > 0 else no, differs])
    shared = dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if shared else 0
    flag = mine.to(torch.int64) * (rank + 1)  # which rank, for the others' message
    if shared:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    refused, ids_rank, labels_rank, differ_rank = (r - 1 for r in flag.tolist())  # the one host read
    if max(refused, ids_rank, labels_rank, differ_rank) < 0:
        return
    if err is not None:
        raise OptionError(f"{err}{_SUFFIX}") from err
    bad = mine.tolist()
    if bad[1]:
        raise OptionError(token_range.ids_message(where, ids, vocab) + _SUFFIX)
    if bad[2]:
        raise OptionError(token_range.labels_message(where, labels, vocab) + _SUFFIX)
    if refused >= 0:
        raise OptionError(f"{where}: rank {refused} refused its batch (its error is raised there){_SUFFIX}")
    if max(ids_rank, labels_rank) >= 0:  # named before a mismatch: a rank's own bad batch differs from its peers'
        which, r = ("input_ids", ids_rank) if ids_rank >= 0 else ("labels", labels_rank)
        raise OptionError(f"{where}: rank {r}'s {which} fall outside the model's vocabulary [0, {vocab}) "
                          f"(its error is raised there){_SUFFIX}")
    mine_differ = " this rank's" if bad[3] else f" rank {differ_rank}'s"
    raise OptionError(f"{where}: the ranks of{mine_differ} pipeline or context-parallel group passed different "
                      "batches; every rank of one pipeline and of one CP group passes the same batch (shard the "
                      f"data by data-parallel replica, not by global rank){_SUFFIX}")


def same_batch_in_groups(batch: dict[str, Any], groups: dict[str, Any], device: torch.device) -> None:
    """cm(...) at cp > 1 or pp > 1: every rank of a CP group and of a pipeline (``groups``: its name → process
    group) must pass the same batch (each keeps its shard of it, each stage its part of the model);
    different ones (a loader sharded by global rank) attended across sequences, or ran one rank's ids
    through another's labels, and returned a loss (and gradients) of a mix of them, without an error. One
    all-reduce of two int64 per group (whose ranks meet in this forward's collectives anyway); every rank
    of the group raises alike."""
    if device.type == "meta" or any(isinstance(v, torch.Tensor) and v.is_meta for v in batch.values()):
        return  # explain's plan: meta batches hold no values to compare (and its ranks are simulated)
    names = [k for k, g in groups.items() if g is not None]
    differs, why = _same_batch_mismatch(batch, [groups[k] for k in names], device)
    if bool(differs):
        which = " or ".join(names)
        raise OptionError(f"forward: the ranks of this {which} group passed different batches; every rank of one "
                          f"{which} group passes the same batch (shard the data by data-parallel replica, not by "
                          "global rank)" + (f" ({why})" if why else ""))
