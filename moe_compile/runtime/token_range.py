"""Token ids and labels outside the model's vocabulary (or not token ids: dtype, shape), refused before the
program runs. Inside it the
embedding's or the loss's IndexError names neither the batch nor the vocabulary, an inductor-compiled
embedding aborts the whole process (its kernel's C++ exception ends in std::terminate), and under a
pipeline only the stage that reads them fails while the others wait in a receive."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn

from ..errors import OptionError

IGNORE_INDEX = -100  # transformers' loss ignores these labels


def vocab_size(model: nn.Module) -> int | None:
    """The vocabulary size: the model's config's (HF: its text config's), else its input embedding's rows;
    None for a model that names neither (the user's own module: its ids are not checked)."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    vocab = getattr(cfg, "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0:
        return vocab
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return emb.num_embeddings if isinstance(emb, nn.Embedding) else None


def bad_ids(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return (ids < 0) | (ids >= vocab)


def bad_labels(labels: torch.Tensor, vocab: int) -> torch.Tensor:
    """Labels the shifted loss reads (labels[..., 1:]) outside [0, vocab), the ignore index excepted."""
    used = labels[..., 1:]
    return (used != IGNORE_INDEX) & bad_ids(used, vocab)


def first_outside(t: torch.Tensor, vocab: int) -> int:
    """The first value of ``t`` outside [0, vocab) (for the message: the error path only)."""
    t = t.reshape(-1)
    return int(t[bad_ids(t, vocab)][0])


def ids_message(where: str, ids: torch.Tensor, vocab: int) -> str:
    return f"{where}: input_ids hold token id {first_outside(ids, vocab)}, outside the model's vocabulary [0, {vocab})"


def labels_message(where: str, labels: torch.Tensor, vocab: int) -> str:
    used = labels[..., 1:]
    return (f"{where}: labels hold {first_outside(used[used != IGNORE_INDEX], vocab)}, outside the model's "
            f"vocabulary [0, {vocab}) (and not the ignore index {IGNORE_INDEX})")


def token_range_error(model: nn.Module, kwargs: dict[str, Any], where: str) -> OptionError | None:
    """An OptionError naming the first out-of-vocabulary id or label in ``kwargs``; None when all are in range
    or the vocabulary is unknown. Reads the verdict on the host."""
    vocab = vocab_size(model)
    if vocab is None:
        return None
    ids, labels = kwargs.get("input_ids"), kwargs.get("labels")
    if is_integer_tensor(ids) and bool(bad_ids(ids, vocab).any()):
        return OptionError(ids_message(where, ids, vocab))
    if is_integer_tensor(labels) and labels.dim() > 0 and bool(bad_labels(labels, vocab).any()):
        return OptionError(labels_message(where, labels, vocab))
    return None


def check_on_host(model: nn.Module, args: tuple, kwargs: dict[str, Any], where: str) -> None:
    """Refuse out-of-vocabulary ids and labels held in host memory (a few µs for a batch). Device tensors are
    not checked: the verdict would cost a device→host sync per step, and torch's device-side assert fires
    there (as in the plain model)."""
    named = dict(kwargs)
    if args:  # the model's own parameter names for positional ids and labels
        try:
            named.update(inspect.signature(model.forward).bind_partial(*args).arguments)
        except TypeError:  # the call itself is wrong: the model says so when it runs
            return
    shape_err = batch_layout_error(named, where)
    if shape_err is not None:
        raise shape_err
    held = {k: t for k in ("input_ids", "labels") if is_integer_tensor(t := named.get(k)) and t.device.type == "cpu"}
    if not held:
        return
    err = token_range_error(model, held, where)
    if err is not None:
        raise err


def batch_layout_error(named: dict[str, Any], where: str) -> OptionError | None:
    """input_ids and labels that no causal LM takes: not integer token ids (float, bool), not [batch, seq],
    empty, or labels of another shape than the ids. Inside the program each was a fake-tensor error from
    dynamo that named neither the input nor the rule. Shapes and dtypes only: no value is read."""
    ids, labels = named.get("input_ids"), named.get("labels")
    for name, t in (("input_ids", ids), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            continue
        if t.dtype == torch.bool or not is_integer_tensor(t):
            return OptionError(f"{where}: {name} of dtype {t.dtype}: token ids and labels are integer tensors "
                               "(torch.long)")
        if t.dim() != 2 or t.numel() == 0:
            return OptionError(f"{where}: {name} of shape {list(t.shape)}: a causal LM takes a non-empty "
                               "[batch, sequence] tensor")
    if isinstance(ids, torch.Tensor) and isinstance(labels, torch.Tensor) and ids.shape != labels.shape:
        return OptionError(f"{where}: labels of shape {list(labels.shape)} for input_ids of shape {list(ids.shape)}: "
                           "a causal LM's labels are the ids' shape (-100 where no loss is taken)")
    return None


def is_integer_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex()
