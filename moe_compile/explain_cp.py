"""Context-parallel figures for ``moe-compile explain`` (mesh with cp > 1).

Glossary: C / CP, S, B. Read from the compiled graphs of the explained rank (one micro-batch of B
sequences of S tokens; this rank holds S/cp of each; at pp > 1 the graphs of this rank's stages):

    kv_gathered      bytes the K/V all-gathers return per step (every layer, one micro-batch; with them
                     DeepSeek-V4's compressed entries, models/hf_compressed.py) and the halos the
                     neighbouring ranks send (halo_bytes: a sliding window's keys before each chunk,
                     convolutions' and V4's halo windows; moe_cp::halo_exchange)
    cp_bytes         bytes a rank receives: (cp−1)/cp of the all-gathered, and the halos; the same again
                     in backward's reduce-scatter of the gradients and return of the halos'
    attn_flops       attention FLOPs per rank per step: QKᵀ and PV against the keys each query row is
                     given, 4·B·H·(S/cp)·keys·hd per layer forward, ×3 with backward: all S keys (the
                     all-gather form computes the masked half too; the causal work is half of it), or
                     a sliding window's S/cp + 2·(window − 1)
    saved            activations the forward keeps for backward (the ledger's M_saved)

    whole_saved      of saved, what the linear-attention mixers keep (models/hf_mixers.py: they run on the
                     whole sequence on every CP rank): saved − kv_gathered times the share of the forward's
                     saved outputs made in those modules

Scaling with cp' ∈ {1, 2, 4, 8} at the same S: tokens and per-token activations divide by cp'; the
gathered K/V that attention keeps and the whole-sequence mixers' activations stay whole:
    saved(cp') ≈ (saved − kv_gathered − whole_saved)·cp/cp' + kv_gathered + whole_saved
    attn_flops(cp') per call: 4·B·H·hd·(S/cp')·keys(cp'), keys S (with V4's entries), or S/cp' + 2·(window − 1)
                    where a sliding window's halos fit (passes/context_parallel.halo_reach)
    cp_bytes(cp') = 2·((kv_gathered − halos)·(cp'−1)/cp' + halos)
"""

from __future__ import annotations

from typing import Any

import torch

from .attention_ops import SINKS
from .passes.context_parallel import halo_reach


def _nbytes(v: Any) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _forward_graphs(cm) -> list[tuple[Any, Any]]:
    """(forward, partitioned-or-forward) of the whole program, or at pp > 1 of each of this rank's stages."""
    progs = cm.pipeline._programs if cm.pipeline is not None else [cm.program]
    out = []
    for p in progs:
        graphs = p.training_graphs if cm.pipeline is not None else p.graphs
        fwd = graphs.get("forward")
        if fwd is not None:
            out.append((fwd, graphs.get("partitioned", fwd)))
    return out


def _whole_mixer_share(cm) -> float:
    """Of the forward's saved outputs (what backward takes besides its tangents; each storage once), the
    share made inside the modules run on the whole sequence (Program.cp_whole_mixers), over this rank's
    programs: applied to the ledger's M_saved, which counts the same outputs."""
    from .ledger.memory import _key, _tensors
    from .ledger.memory import _nbytes as _storage_bytes
    from .viz.graph import module_path

    progs = cm.pipeline._programs if cm.pipeline is not None else [cm.program]
    mine: dict = {}
    every: dict = {}
    for p in progs:
        graphs = p.training_graphs if cm.pipeline is not None else p.graphs
        fwd, bwd = graphs.get("forward"), graphs.get("backward")
        if fwd is None or bwd is None or not p.cp_whole_mixers:
            continue
        outs = list(fwd.graph.output_node().args[0])
        n_saved = sum(1 for n in bwd.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents"))
        # views of the graph's inputs (a weight's transpose) are not saved bytes, as in the ledger's M_saved
        inputs = {_key(t) for n in fwd.graph.nodes if n.op == "placeholder" for t in _tensors(n.meta.get("val"))}
        for n in {a for a in outs[len(outs) - n_saved:] if isinstance(a, torch.fx.Node) and a.op != "placeholder"}:
            sizes = {_key(t): _storage_bytes(t) for t in _tensors(n.meta.get("val")) if _key(t) not in inputs}
            every.update(sizes)
            path = module_path(n) or ""
            if any(path == m or path.startswith(m + ".") for m in p.cp_whole_mixers):
                mine.update(sizes)
    return sum(mine.values()) / sum(every.values()) if every else 0.0


def cp_rows(cm, ledger) -> dict[str, Any] | None:
    spec = cm.program.mesh
    graphs = _forward_graphs(cm) if spec.cp > 1 else []
    if not graphs:
        return None
    cp = spec.cp
    gathers = [n for fwd, _ in graphs for n in fwd.graph.nodes
               if n.op == "call_function" and "moe_cp.all_gather" in str(n.target)]
    kv = [n for n in gathers if n.meta["val"].is_floating_point() and n.meta["val"].dim() >= 3]
    # halos from the neighbouring ranks (sliding-window keys, convolutions, V4's halo windows): two chunks' worth
    halos = [n for fwd, _ in graphs for n in fwd.graph.nodes if n.op == "call_function"
             and "moe_cp.halo_exchange" in str(n.target) and n.meta["val"].is_floating_point()]
    halo_bytes = sum(_nbytes(n.meta["val"]) for n in halos)
    kv_bytes = sum(_nbytes(n.meta["val"]) for n in kv) + halo_bytes
    # router logits [tokens, N] (and a block's routes [tokens, K]) gathered along the tokens for a
    # load-balancing loss over the whole sequences; the positions' gather runs along the sequence (dim 1)
    router_bytes = sum(_nbytes(n.meta["val"]) for n in gathers if n.meta["val"].dim() == 2 and n.args[1] == 0)
    attn = []  # (B·H·hd, S/cp queries, keys) of each attention call
    for n in (n for _, part in graphs for n in part.graph.nodes):
        if n.op == "call_function" and ("scaled_dot_product" in str(n.target) or n.target in SINKS):
            q, k = n.args[0].meta["val"], n.args[1].meta["val"]
            b, h, sq, hd = (int(x) for x in q.shape)
            attn.append((b * h * hd, sq, int(k.shape[-2])))

    def attn_flops(c: int) -> int:  # forward, at cp = c: the whole sequence's keys, or a sliding window's spans
        total = 0
        for bhd, sq, keys in attn:
            seq = sq * cp
            reach = (keys - sq) // 2 if keys < seq else 0
            if reach:
                keys = seq // c + 2 * reach if halo_reach(reach + 1, 0, seq // c, c) else seq
            total += 4 * bhd * (seq // c) * keys
        return total

    flops = attn_flops(cp)
    try:
        saved = int(ledger["M_saved"])
    except (KeyError, TypeError, ValueError):
        saved = None
    whole = int((saved - kv_bytes) * _whole_mixer_share(cm)) if saved is not None else 0
    def traffic(c: int) -> int:  # received in forward, and the gradients sent back in backward
        return 2 * ((kv_bytes - halo_bytes + router_bytes) * (c - 1) // c + (halo_bytes if c > 1 else 0))

    scaling = []
    for c in (1, 2, 4, 8):
        scaling.append({"cp": c, "saved_bytes": (saved - kv_bytes - whole) * cp // c + kv_bytes + whole
                        if saved is not None else None, "attn_flops": 3 * attn_flops(c), "cp_bytes": traffic(c)})
    return {"cp": cp, "kv_gathered_bytes": kv_bytes, "router_gathered_bytes": router_bytes,
            "halo_bytes": halo_bytes, "cp_bytes_per_step": traffic(cp),
            "attn_flops_per_step": 3 * flops, "saved_bytes": saved, "whole_saved_bytes": whole, "scaling": scaling,
            "all_gathers": len(kv)}


def cp_table_html(data: dict[str, Any]) -> str:
    import html

    head = html.escape(f"cp={data['cp']}: K/V all-gathered {data['kv_gathered_bytes']:,} B per step "
                       f"({data['all_gathers']} all-gathers); CP traffic per rank {data['cp_bytes_per_step']:,} B "
                       f"(all-gather + reduce-scatter); attention {data['attn_flops_per_step']:,} FLOP per rank")
    rows = "".join(f"<tr><td>{r['cp']}</td><td>{r['saved_bytes'] or 0:,}</td><td>{r['attn_flops']:,}</td>"
                   f"<td>{r['cp_bytes']:,}</td></tr>" for r in data["scaling"])
    return (f"<p>{head}</p><table><tr><th>cp</th><th>saved activations (B)</th><th>attention FLOP</th>"
            f"<th>CP bytes</th></tr>{rows}</table>")
