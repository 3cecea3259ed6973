"""call_order: where each module outside the decoder layers first runs, relative to the layers.

plan_split gives a parameter outside the decoder layers to the first pipeline stage or the last.
Registration order (embeddings before the layers, final norm and head after) says which for most
models, not for all: Gemma 4 registers the modules that make its per-layer inputs
(``embed_tokens_per_layer``, ``per_layer_model_projection``, ``per_layer_projection_norm``) after the
layers but runs them before the first one, so by registration they went to the last stage and every
earlier layer read a later stage's value. So with pp > 1, before anything is captured, the model runs
one forward on a few tokens (eval mode, no grad; RNG state, modes and buffers restored afterwards) with a pre-hook on
each module outside the layers that holds parameters: a module first run before the first layer starts
is "before", after the last layer returns "after", in between "between" (used among the layers: the
split's own checks decide). A model whose forward does not take ``input_ids`` alone, or fails on the
probe tokens, gets None and keeps registration order.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..frontend.kept_state import kept_state

PROBE_TOKENS = 4


def first_run_phases(model: nn.Module, layers_path: str, n_layers: int) -> dict[str, str] | None:
    """Module path → "before" | "after" | "between" (where it first runs) for the modules outside
    ``layers_path`` that hold parameters of their own; None when the probe forward cannot run."""
    mods = dict(model.named_modules())
    phase = ["before"]
    seen: dict[str, str] = {}

    def first_layer_starts(*_):
        if phase[0] == "before":
            phase[0] = "between"

    def last_layer_returns(*_):
        phase[0] = "after"

    def runs(name: str):
        def hook(*_):  # returns None: a pre-hook's result would replace the module's inputs
            seen.setdefault(name, phase[0])
        return hook

    handles = [mods[f"{layers_path}.0"].register_forward_pre_hook(first_layer_starts),
               mods[f"{layers_path}.{n_layers - 1}"].register_forward_hook(last_layer_returns)]
    for name, m in mods.items():
        if name == layers_path or name.startswith(layers_path + "."):
            continue
        if next(m.parameters(recurse=False), None) is not None:
            handles.append(m.register_forward_pre_hook(runs(name)))
    p = next(model.parameters(), None)
    device = p.device if p is not None else torch.device("cpu")
    ids = torch.zeros(1, PROBE_TOKENS, dtype=torch.long, device=device)
    forked = [device.index or 0] if device.type == "cuda" else []
    try:
        with kept_state(model), torch.no_grad(), torch.random.fork_rng(devices=forked):
            model.eval()
            model(input_ids=ids)
    except Exception:  # noqa: BLE001 - any failure: registration order decides, as before
        return None
    finally:
        for h in handles:
            h.remove()
    return seen
