"""The ledger's formulas: one sympy expression per figure, over the base symbols of
:mod:`.symbols` and the other figures (``definition``), or fully expanded (``formula``).

Groups: parameters (counts), persistent training state (bytes per rank), execution working memory
(bytes per rank per micro-batch), traffic (bytes per rank per optimizer step, per process group),
compute (FLOPs). Conventions stated where a figure depends on one.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from .symbols import (
    B,
    G,
    G_s,
    H,
    K,
    L,
    L_attn,
    N,
    P_bb,
    P_lookup,
    P_mx_dense,
    P_vec,
    S,
    T,
    b_a,
    b_g,
    b_i,
    b_main,
    b_opt,
    b_r,
    b_w,
    beta_E,
    c_f,
    cp,
    d,
    d_qk,
    d_v,
    dp,
    ep_dp,
    ep_mp,
    g_r,
    h_d,
    h_e,
    m,
    m_s,
    pp,
    q_mx,
    rho,
    sigma_s,
    z_1,
    z_rs,
)


@dataclass(frozen=True)
class Formula:
    name: str
    expr: sp.Expr  # over base symbols and other figures' symbols
    unit: str  # params | ratio | rows | bytes | FLOPs
    group: str
    doc: str


FORMULAS: dict[str, Formula] = {}
_FIG: dict[str, sp.Symbol] = {}


def fig(name: str) -> sp.Symbol:
    """The symbol standing for figure ``name`` inside other figures' definitions."""
    return _FIG[name]


def _def(name: str, expr: sp.Expr, unit: str, group: str, doc: str) -> sp.Symbol:
    FORMULAS[name] = Formula(name, sp.sympify(expr), unit, group, doc)
    _FIG[name] = sp.Symbol(name, positive=True)
    return _FIG[name]


# -- routing shapes -----------------------------------------------------------------------------
R = _def("R", T * K, "rows", "routing", "routed rows per rank per MoE layer (T·K)")
C = _def("C", sp.ceiling(c_f * T * K), "rows", "routing",
         "receive-buffer rows per rank per MoE layer (capacity; dropless: ceil(min(ep_mp, f)·T·K), f ≥ h_d)")
# nobody receives more than the group routes in all (g_r·T·K: ep_mp·T·K when every rank routes T·K)
_f_rho = sp.Min(g_r, h_d * 2 ** sp.Max(0, sp.ceiling(sp.log(rho / h_d, 2))))
C_rho = _def("C_rho", sp.ceiling(_f_rho * T * K), "rows", "routing",
             "dropless receive rows once the capacity followed a load of imbalance rho (h_d doubled until it "
             "holds rho, at most the group's rows g_r·T·K)")
C_bound = _def("C_bound", g_r * T * K, "rows", "routing",
               "dropless bound: the group's rows g_r·T·K, ep_mp·T·K when every rank routes T·K (what a static "
               "dropless buffer needs)")
# one dispatched row as it travels and is received: d activations, or under MXFP8 (q_mx = 1) one packed
# qdata–scale row of d E4M3 bytes and d/32 E8M0 scales; the combine mirror's gradient rows likewise
_mx_row = q_mx * (d + d / 32) + (1 - q_mx) * d * b_a
_recv_row = _mx_row + (d + (1 + G) * h_e) * b_a  # capacity-sized tensors of one layer: receive rows, expert output, pre-activations
_def("M_recv_rho", C_rho * _recv_row, "bytes", "working",
     "dropless: capacity-sized buffers of one MoE layer (receive, expert output, pre-activations) at imbalance rho")
_def("M_recv_uniform", sp.ceiling(sp.Min(ep_mp, h_d) * T * K) * _recv_row, "bytes", "working",
     "the same at rho ≤ h_d (uniform routing): the headroom capacity")
_def("M_recv_bound", C_bound * _recv_row, "bytes", "working",
     "the same at the bound C_bound (all rows to one rank; what a static dropless buffer always costs)")
L_loc = _def("L_loc", N / ep_mp, "experts", "routing", "num_local_experts: routed experts stored per EP-MP rank")

# -- parameters -------------------------------------------------------------------------------
P_E_layer = _def("P_E_layer", N * ((2 + G) * d * h_e + beta_E * ((1 + G) * h_e + d)), "params", "parameters",
                 "routed-expert parameters of one MoE layer (weights, and biases if beta_E)")
P_E = _def("P_E", L * P_E_layer, "params", "parameters", "routed-expert parameters of the model")
P_router = _def("P_router", L * N * d, "params", "parameters", "router projections [N, d] of all MoE layers")
P_shared = _def("P_shared", L * ((2 + G_s) * d * m_s + sigma_s * d), "params", "parameters",
                "shared experts (and their gates): always active, dense family")
P_dense = _def("P_dense", P_bb + P_router + P_shared, "params", "parameters",
               "dense (non-expert) parameters: backbone, routers, shared experts")
P_total = _def("P_total", P_dense + P_E, "params", "parameters", "total parameters: the persistent parameter pool")
P_active = _def("P_active", P_dense + L * K * ((2 + G) * d * h_e + beta_E * ((1 + G) * h_e + d)), "params", "parameters",
                "parameters one token uses: every dense parameter (embeddings and head included) and K of N "
                "experts per MoE layer")
_def("alpha_E", K / N, "ratio", "parameters", "expert activation ratio K/N")
_def("alpha_P", P_active / P_total, "ratio", "parameters", "parameter activation ratio P_active/P_total")
_def("Gamma_capacity", P_total / P_active, "ratio", "parameters", "capacity-to-active gap P_total/P_active = 1/alpha_P")
P_local = _def("P_local", (P_dense + P_E / ep_mp) / pp, "params", "parameters",
               "parameters one rank holds after PP and EP placement (layers split evenly over pp)")

# -- persistent training state (bytes per rank) -------------------------------------------------
M_w = _def("M_weights", P_local * b_w, "bytes", "persistent", "compute weights")
M_g = _def("M_grads", P_local * b_g, "bytes", "persistent", "accumulated gradients (flat dense and expert buckets)")
P_owned = _def("P_owned", (P_dense / (1 + z_1 * (dp * cp - 1)) + P_E / (ep_mp * (1 + z_1 * (ep_dp - 1)))) / pp,
               "params", "parameters", "parameters whose FP32 main weight and optimizer state this rank keeps: "
               "P_local, or under ZeRO-1 (z_1 = 1) its share over the family's replicas")
M_main = _def("M_main", P_owned * b_main, "bytes", "persistent", "FP32 main weights")
M_opt = _def("M_opt", P_owned * b_opt, "bytes", "persistent",
             "optimizer states (replicated over dp, or ZeRO-1 sharded with z_1 = 1)")
M_mx = _def("M_mxfp8", 2 * (1 + sp.Rational(1, 32)) * (q_mx * P_E / (pp * ep_mp) + P_mx_dense), "bytes",
            "persistent", "MXFP8 compute-weight caches of the local experts (and of the dense linears under "
            "mxfp8='experts+shared' | 'all'): 1-byte qdata plus one E8M0 scale per 32 elements, in two "
            "orientations (forward and transposed)")
# a reduce-scattered bucket of a group of n > 1 ranks keeps its reduced part [⌈bucket/n⌉] beside the flat
# bucket; its packed send rows [n, ⌈bucket/n⌉] live from its launch to the backward's end (train/grad_shards.py;
# padding of < n elements per tensor left out)
_rs_buckets = (z_rs * b_g / pp * P_dense * sp.Min(1, dp * cp - 1), z_rs * b_g / pp * P_E / ep_mp * sp.Min(1, ep_dp - 1))
M_rs = _def("M_grad_shards", _rs_buckets[0] / (dp * cp) + _rs_buckets[1] / ep_dp, "bytes", "persistent",
            "reduced parts of the reduce-scattered gradient buckets (z_rs = 1, family groups of n > 1 ranks): 1/n "
            "of each bucket")
_def("M_persistent", M_w + M_g + M_main + M_opt + M_mx + M_rs, "bytes", "persistent",
     "persistent training state per rank")

# -- execution working memory (bytes per rank, one micro-batch) -----------------------------------
_layout = 2 * ep_mp * N * b_i  # layout [2, ep, ep, L_loc] int64
M_route = _def("M_route_layer", T * N * b_a + T * K * (b_r + b_i) + R * b_i + N * b_i + _layout + L_loc * b_i,
               "bytes", "working", "routing buffers of one MoE layer: logits, route weights and indices, "
               "permutation order, per-expert counts, dispatch layout, receive counts")
M_comm = _def("M_comm_layer", (2 * R + C) * d * b_a + (C + q_mx * R) * _mx_row, "bytes", "working",
              "communication buffers of one MoE layer: permuted send rows (and, under MXFP8, their packed "
              "copy), receive buffer, expert output, returned rows")
M_ffn = _def("M_ffn_layer", C * (1 + G) * h_e * b_a, "bytes", "working", "expert FFN pre-activations of one MoE layer")
M_saved_layer = _def(
    "M_saved_moe_layer",
    T * K * (b_i + b_r) + R * b_i + _layout + L_loc * b_i + C * _mx_row + C * (1 + G) * h_e * b_a + R * d * b_a,
    "bytes", "working",
    "what the MoE ops of one layer keep for backward: route indices and weights, order, layout, receive "
    "counts, receive buffer, pre-activations, returned rows",
)
_def("M_ffn_workspace", C * ((5 + 2 * G) * h_e + d) * b_a + q_mx * 2 * (1 + G) * h_e * d * 4, "bytes", "working",
     "bound on the temporaries inside one moe::grouped_ffn_backward (torch kernels: activation recompute, "
     "gate/up gradients, input gradient; under MXFP8 the torch-op emulation's dequantised FP32 weights of one "
     "expert, twice: the widest of them and its unscaled copy) on top of the graph's values")
_def("M_saved_moe", L / pp * M_saved_layer, "bytes", "working",
     "MoE tensors kept for backward, the rank's MoE layers (L/pp; without activation checkpointing, which "
     "recomputes some of them)")
_def("M_grad_send", _rs_buckets[0] + _rs_buckets[1], "bytes", "working",
     "packed send rows of the reduce-scattered gradient buckets (z_rs = 1), one copy of each bucket from its "
     "launch to the end of the backward: all of them at its end, when the saved activations are freed")
_def("M_sym", H * C * _mx_row, "bytes", "working",
     "symmetric payloads at high-water: H receive buffers of C rows live at once (one family)")

# -- traffic (bytes per rank per optimizer step) --------------------------------------------------
V_row = m * L / pp * R * d * b_a  # the rank's stage holds L/pp of the MoE layers (layers split evenly over pp)
V_row_sent = m * L / pp * R * _mx_row  # dispatch and the combine mirror carry MXFP8 rows under mxfp8
for _kind, _what in (("dispatch", "dispatch"), ("combine_backward", "combine mirror")):
    _def(f"V_{_kind}", V_row_sent, "bytes", "traffic",
         f"ep_mp {_what}: the rank's T·K rows leaving through the transport, its own included (exact when "
         "dropless; an upper bound with a capacity)")
for _kind, _what in (("combine", "combine"), ("dispatch_backward", "dispatch mirror")):
    _def(f"V_{_kind}", V_row, "bytes", "traffic",
         f"ep_mp {_what}: rows the rank returns (those it received): routing-dependent per rank, exact as the "
         "mean over an EP-MP group when dropless (every row sent comes back)")
V_ep = _def("V_ep_mp", 2 * V_row + 2 * V_row_sent, "bytes", "traffic", "ep_mp total: dispatch, combine and their backward mirrors")
_def("V_ep_mp_peer", V_ep * (1 - 1 / ep_mp), "bytes", "traffic",
     "ep_mp bytes to other ranks, expected value under uniform routing (a routed row stays on its rank "
     "with probability 1/ep_mp)")
V_dense = _def("V_dense_bucket", P_dense / pp * b_g, "bytes", "traffic",
               "dense buckets reduced over dp x cp each step: all-reduced, or reduce-scattered with z_rs = 1 "
               "(0 traffic when dp·cp = 1)")
_def("V_dense_sent", (2 - z_rs) * (dp * cp - 1) / (dp * cp) * V_dense, "bytes", "traffic",
     "dense reduction bytes each rank sends (ring all-reduce: 2(n-1)/n of the buckets; reduce-scatter, z_rs = 1: "
     "(n-1)/n)")
V_exp = _def("V_expert_bucket", P_E / (pp * ep_mp) * b_g, "bytes", "traffic",
             "expert buckets reduced over ep_dp each step: all-reduced, or reduce-scattered with z_rs = 1 "
             "(0 traffic when ep_dp = 1)")
_def("V_expert_sent", (2 - z_rs) * (ep_dp - 1) / ep_dp * V_exp, "bytes", "traffic",
     "expert reduction bytes each rank sends (ring all-reduce over ep_dp; reduce-scatter, z_rs = 1: half)")
_def("V_main_gather", z_1 * b_main * ((dp * cp - 1) * P_dense / (dp * cp) + (ep_dp - 1) * P_E / (ep_mp * ep_dp)) / pp,
     "bytes", "traffic", "ZeRO-1 copy-back: each rank sends its share of the FP32 main weights to the n − 1 "
     "others of each family's replica group after the optimizer step (ring all-gather)")

# -- compute ---------------------------------------------------------------------------------------
F_fwd = _def("F_fwd_token", 2 * (P_active - P_lookup - P_vec) + 2 * L_attn * S * (d_qk + d_v), "FLOPs", "compute",
             "forward FLOPs per token: 2 per multiply-add of every active matmul parameter, plus attention "
             "scores and values over all S keys (the non-causal count torch's FLOP counter makes)")
F_train = _def("F_train_token", 3 * F_fwd, "FLOPs", "compute", "training FLOPs per token (backward = 2 x forward)")
_def("F_step_rank", F_train * B / (cp * pp), "FLOPs", "compute",
     "training FLOPs per rank per optimizer step (B/cp = m·T tokens on this rank, through its 1/pp of the "
     "layers)")

__all__ = ["FORMULAS", "Formula", "fig"]
