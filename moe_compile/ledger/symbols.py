"""The ledger's base symbols (sympy), with their meaning and unit.

Glossary names where the glossary has one: d, h_e, m_s, N, K, S, T, B, m, and the mesh degrees
pp (P), dp (D), cp (C), ep_dp (D_E), ep_mp (M_E). Everything else is named here.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp


@dataclass(frozen=True)
class SymbolInfo:
    symbol: sp.Symbol
    meaning: str
    unit: str


SYMBOLS: dict[str, SymbolInfo] = {}


def _sym(name: str, meaning: str, unit: str = "", latex: str | None = None) -> sp.Symbol:
    s = sp.Symbol(latex or name, positive=True)
    SYMBOLS[name] = SymbolInfo(s, meaning, unit)
    return s


# -- model (MoE layer shape; every MoE block of a model has the same shape) ---------------------
d = _sym("d", "transformer model width d_model")
h_e = _sym("h_e", "routed-expert intermediate width")
m_s = _sym("m_s", "total shared-expert intermediate width (0 without a shared expert)")
N = _sym("N", "routed experts per MoE layer")
K = _sym("K", "routed experts selected per token (top_k)")
L = _sym("L", "MoE layers")
G = _sym("G", "1 for gated (SwiGLU-style) routed experts, 0 for two-layer FFN experts")
beta_E = _sym("beta_E", "1 if the routed experts have biases (b_in [N, (1+G)·h_e], b_out [N, d]: GPT-OSS), else 0")
G_s = _sym("G_s", "1 for a gated shared expert, 0 for a two-layer one")
sigma_s = _sym("sigma_s", "1 if the shared expert has a sigmoid gate Linear(d, 1), else 0")
P_bb = _sym("P_bb", "backbone parameters: embeddings, attention, norms, output head, dense MLPs, and router "
            "parameters besides the [N, d] projections (biases, scales, a router network's layers; counted from "
            "the model's own parameters)", "params")
P_lookup = _sym("P_lookup", "embedding-table parameters used only by lookup (no matmul)", "params")
P_vec = _sym("P_vec", "1-D parameters (norm scales, biases): elementwise, no matmul", "params")
L_attn = _sym("L_attn", "attention layers")
d_qk = _sym("d_qk", "attention query/key width (heads x head dim)")
d_v = _sym("d_v", "attention value width (heads x head dim)")

# -- data -----------------------------------------------------------------------------------
S = _sym("S", "sequence length before context-parallel sharding", "tokens")
T = _sym("T", "tokens per rank per micro-batch, before top-K expansion", "tokens")
B = _sym("B", "useful tokens per rank in one optimizer step (before model parallelism)", "tokens")
m = _sym("m", "micro-batches per optimizer step")

# -- mesh -------------------------------------------------------------------------------------
pp = _sym("pp", "pipeline degree P")
dp = _sym("dp", "dense data-parallel degree D")
cp = _sym("cp", "context-parallel degree C")
ep_dp = _sym("ep_dp", "expert replica degree D_E")
ep_mp = _sym("ep_mp", "expert-sharding degree M_E")
c_f = _sym("c_f", "capacity factor: receive rows per rank = ceil(c_f T K); dropless: the receive factor "
           "min(ep_mp, f) the program compiled (f starts at the headroom h_d, doubles on overflow)")
h_d = _sym("h_d", "dropless headroom: the first receive factor (runtime.dropless.DROPLESS_HEADROOM)")
rho = _sym("rho", "load imbalance: the most rows one rank receives / T·K (1 uniform, ep_mp: all to one rank)")
g_r = _sym("g_r", "group load: the most rows the EP-MP group routes in one dispatch / T·K (ep_mp when every rank "
           "routes T·K; more for a rank whose batch is smaller than its peers')")
H = _sym("H", "high-water: simultaneously live symmetric payloads of one stage and family", "payloads")

# -- bytes per element ----------------------------------------------------------------------
b_w = _sym("b_w", "bytes per compute-weight element (parameter dtype)", "B")
b_g = _sym("b_g", "bytes per gradient element", "B")
b_a = _sym("b_a", "bytes per activation element (and activation gradient)", "B")
b_r = _sym("b_r", "bytes per route-weight element (fp32 when the router keeps fp32 weights)", "B")
b_i = _sym("b_i", "bytes per index element (int64)", "B")
b_main = _sym("b_main", "bytes per parameter of FP32 main weights (4 with low-precision compute weights, "
              "0 when the optimizer updates FP32 compute weights directly)", "B")
b_opt = _sym("b_opt", "optimizer-state bytes per parameter (AdamW: two FP32 moments = 8)", "B")
q_mx = _sym("q_mx", "1 when routed experts run in MXFP8 (compute-weight caches exist), else 0")
P_mx_dense = _sym("P_mx_dense", "dense parameters of this rank held as MXFP8 compute-weight caches "
                  "(mxfp8='experts+shared' | 'all': shared-expert or every dense linear's weight), else 0", "params")
z_1 = _sym("z_1", "1 when the optimizer shards its FP32 main weights and states ZeRO-1 over each family's "
           "replica group (dense dp·cp, experts ep_dp: OLMoDDPOptimizer), 0 when every replica holds them")
z_rs = _sym("z_rs", "1 when the gradient buckets are reduce-scattered into the ZeRO-1 owned ranges "
            "(OLMoDDPOptimizer on accelerators), 0 when they are all-reduced (CPU ranks, replicated optimizers)")


def symbol(name: str) -> sp.Symbol:
    return SYMBOLS[name].symbol
