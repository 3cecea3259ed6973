"""Model preparation before capture: things a model does lazily on its first call, done up front so
the whole forward captures as one graph."""

from __future__ import annotations

import sys

import torch.nn as nn


def prepare_for_capture(model: nn.Module) -> None:
    # transformers 5.x installs its output-recording hooks (router logits, hidden states) lazily
    # under a threading lock, which a full-graph capture cannot trace; install them now. A model of
    # transformers means transformers is imported already: importing it for any other model would cost
    # every process ~2 s.
    if "transformers" not in sys.modules:
        return
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:
        return
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        maybe_install_capturing_hooks(model)
