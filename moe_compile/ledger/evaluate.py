"""Evaluate the ledger for a compiled model: gather the symbol values from the model, the program,
its captured graphs and the mesh; substitute them into every formula; add the figures read off the
graphs (saved activations, working-memory high-water) and the lease plan (symmetric payloads).

    values  = model shape (block specs) + exact parameter counts (model) + T, dtypes (graphs)
              + mesh degrees + options (capacity factor, micro-batches, optimizer state bytes)
    figure  = formula(name).subs(values)            for every formula
            + graph liveness figures                when forward/backward graphs exist
            + lease-plan figures                    when the program has a lease plan
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from typing import Any

import sympy as sp
import torch

from ..attention_ops import ATTENTION, EFFICIENT
from ..ir import MOE_META, Role
from ..runtime.dropless import DROPLESS_HEADROOM, find_dropless_state
from ..runtime.route_plan import exact_capacity_factor
from .formulas import FORMULAS, fig
from .memory import GraphMemory, graph_memory
from .model_counts import LedgerError, MoEShape, ParamCounts, count_params, dtype_bytes, moe_shape
from .symbols import SYMBOLS


def definition(name: str) -> sp.Expr:
    """Figure ``name`` as defined: over base symbols and other figures."""
    try:
        return FORMULAS[name].expr
    except KeyError:
        raise LedgerError(f"no ledger figure {name!r}; figures: {sorted(FORMULAS)}") from None


def formula(name: str) -> sp.Expr:
    """Figure ``name`` expanded to the base symbols of :mod:`moe_compile.ledger.symbols`."""
    expr = definition(name)
    for _ in range(len(FORMULAS)):
        figs = {s for s in expr.free_symbols if str(s) in FORMULAS and s == fig(str(s))}
        if not figs:
            return expr
        expr = expr.subs({s: FORMULAS[str(s)].expr for s in figs})
    raise LedgerError(f"ledger figure {name!r} has a circular definition")


@dataclass
class Figure:
    name: str
    value: int | float | None
    unit: str
    group: str
    doc: str
    formula: str  # the definition, as text ('' for figures read off graphs or plans)
    source: str  # formula | graph | lease plan | runtime
    note: str = ""


@dataclass
class Ledger:
    """Every figure for one compiled model, plus the symbol values they were evaluated with."""

    figures: dict[str, Figure]
    values: dict[str, int | float]
    notes: list[str] = field(default_factory=list)

    def __getitem__(self, name: str) -> int | float | None:
        return self.figures[name].value

    @property
    def shorthand(self) -> str:
        """XB@YB: billions of active @ total parameters."""
        def b(x: float) -> str:
            return f"{x / 1e9:.2f}B" if x >= 1e8 else f"{x / 1e9:.3g}B"

        return f"{b(self['P_active'])}@{b(self['P_total'])}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: f.value for name, f in self.figures.items()}
        out["shorthand"] = self.shorthand
        out["symbols"] = dict(self.values)
        out["figures"] = {name: asdict(f) for name, f in self.figures.items()}
        out["notes"] = list(self.notes)
        return out

    def to_json(self, indent: int = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def rows(self) -> list[tuple[str, str, str, str, str]]:
        """(group, figure, value, formula, meaning) for tables."""
        return [(f.group, f.name, format_value(f.value, f.unit), f.formula or f"({f.source})", f.doc)
                for f in self.figures.values()]


def format_value(v: int | float | None, unit: str) -> str:
    if v is None:
        return "n/a"
    if unit == "bytes":
        for scale, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(v) >= scale:
                return f"{v / scale:.2f} {suffix}"
        return f"{int(v)} B"
    if unit in ("params", "FLOPs") and abs(v) >= 1e6:
        for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
            if abs(v) >= scale:
                return f"{v / scale:.3f}{suffix}" + (" FLOP" if unit == "FLOPs" else "")
    if isinstance(v, float):
        return f"{v:.4g}"
    return f"{v:,}"


def _num(x: sp.Expr) -> int | float:
    x = sp.nsimplify(x) if not isinstance(x, sp.Basic) else x
    if x.is_Integer:
        return int(x)
    if x.is_Rational and x.q == 1:
        return int(x.p)
    return float(x)


# -- gathering values -------------------------------------------------------------------------


def _attention(captured: torch.fx.GraphModule | list | None) -> tuple[int, int, int, int] | None:
    """(L_attn, d_qk, d_v, S) from the scaled-dot-product-attention calls of the captured graph (or of every
    pipeline stage's captured graph, in stage order)."""
    calls = _attention_calls(captured)
    if not calls:
        return None
    q, k, v = (calls[0].args[i].meta["val"] for i in range(3))
    heads, s = q.shape[-3], q.shape[-2]  # the queries: a shard's (indexed attention's keys are already whole)
    return len(calls), heads * q.shape[-1], heads * v.shape[-1], s


def _attention_calls(captured: torch.fx.GraphModule | list | None) -> list[torch.fx.Node]:
    graphs = [g for g in (captured if isinstance(captured, list) else [captured]) if g is not None]
    return [n for g in graphs for n in g.graph.nodes if n.op == "call_function" and n.target in ATTENTION]


def _dispatch_spec(graphs: dict[str, torch.fx.GraphModule]):
    for key in ("partitioned", "joint", "forward"):
        g = graphs.get(key)
        if g is None:
            continue
        for n in g.graph.nodes:
            meta = n.meta.get(MOE_META)
            if meta is not None and meta.role == Role.DISPATCH and meta.dispatch is not None:
                return meta.dispatch, n
    return None, None


def gather_values(shape: MoEShape, counts: ParamCounts, mesh, graphs: dict, *, capacity_factor: float | None,
                  micro_batches: int, optimizer_state_bytes: int, main_weights: bool | None, mxfp8: bool,
                  activation_dtype: torch.dtype | None, tokens: int | None,
                  seq_len: int | None, dropless_factor=None, dropless_headroom=None,
                  load_imbalance: float | None = None, sharded_optimizer: bool = False,
                  reduce_scatter: bool = False, mx_dense_params: int = 0,
                  group_rows: int | None = None) -> tuple[dict[str, int | float | None], list[str]]:
    notes: list[str] = []
    spec, dnode = _dispatch_spec(graphs)
    if spec is not None:
        tokens = spec.num_tokens
        activation_dtype = dnode.meta["val"][0].dtype if isinstance(dnode.meta.get("val"), tuple) else activation_dtype
    if activation_dtype is None:
        raise LedgerError("ledger: no activation dtype (no captured graph and none given)")
    b_w = sp.Rational(counts.local_bytes, counts.local)
    b_a = dtype_bytes(activation_dtype)
    attn = _attention(graphs.get("captured"))
    if attn is None:
        notes.append("attention FLOPs need a captured graph with scaled_dot_product_attention calls")
    elif any(n.target in EFFICIENT for n in _attention_calls(graphs.get("captured"))):
        notes.append("attention with value heads narrower than the query's or a bias that needs a gradient is "
                     "planned as the memory-efficient kernel a GPU rank runs (saving its output and log-sum-exp); "
                     "a CPU rank runs SDPA's math path there, which also keeps the [B, H, S, S] probabilities")
    if main_weights is None:
        main_weights = sharded_optimizer or b_w < 4  # OLMoDDPOptimizer keeps FP32 main weights for every dtype
    h_d = DROPLESS_HEADROOM if dropless_headroom is None else Fraction(dropless_headroom).limit_denominator(1000)
    v: dict[str, int | float | None] = dict(
        d=shape.d, h_e=shape.h_e, N=shape.N, K=shape.K, L=shape.layers, G=int(shape.gated), beta_E=int(shape.bias),
        m_s=shape.m_s, G_s=1, sigma_s=0, P_bb=counts.backbone, P_lookup=counts.lookup, P_vec=counts.vector,
        pp=mesh.pp, dp=mesh.dp, cp=mesh.cp, ep_dp=mesh.ep_dp, ep_mp=mesh.ep_mp,
        c_f=(dropless_factor or min(mesh.ep_mp, h_d)) if capacity_factor is None else capacity_factor,
        h_d=h_d, rho=load_imbalance, g_r=mesh.ep_mp,
        m=micro_batches, T=tokens, S=seq_len, b_w=b_w, b_g=4 if sharded_optimizer else b_w, b_a=b_a, b_r=4 if shape.fp32_route_weights else b_a,
        b_i=8, b_main=4 if main_weights else 0, b_opt=optimizer_state_bytes, q_mx=int(mxfp8),
        z_1=int(sharded_optimizer), z_rs=int(reduce_scatter), P_mx_dense=mx_dense_params, H=None,
        L_attn=None, d_qk=None, d_v=None,
    )
    if shape.m_s:
        L = shape.layers
        per = counts.shared // L
        if counts.shared % L or per not in (2 * shape.d * shape.m_s, 3 * shape.d * shape.m_s):
            raise LedgerError(f"ledger: shared experts hold {counts.shared} parameters over {L} layers, which is not "
                              f"L·(2 or 3)·d·m_s with d={shape.d}, m_s={shape.m_s}")
        v["G_s"] = int(per == 3 * shape.d * shape.m_s)
        if counts.shared_gate not in (0, L * shape.d):
            raise LedgerError(f"ledger: shared-expert gates hold {counts.shared_gate} parameters, not L·d = {L * shape.d}")
        v["sigma_s"] = int(counts.shared_gate > 0)
    if attn is not None:
        v["L_attn"], v["d_qk"], v["d_v"], s = attn
        v["S"] = v["S"] or s * mesh.cp  # captured before the CP pass: a shard's keys; its queries see all S
    if tokens is not None:
        v["B"] = micro_batches * tokens * mesh.cp
        if group_rows and group_rows > mesh.ep_mp * tokens * shape.K:  # ranks routed different rows (ragged)
            v["g_r"] = Fraction(group_rows, tokens * shape.K)
    else:
        notes.append("token-dependent figures need T: run one forward (or pass tokens=)")
    return v, notes


def _exact(name: str, v):
    """A value as sympy substitutes it. The capacity factor is the decimal the user wrote, as the dispatch
    pass reads it (runtime.route_plan.exact_capacity_factor: 1.1 → 11/10), so the figure
    C = ceiling(c_f·T·K) equals the receive-buffer rows the pass allocates (capacity_rows)."""
    if isinstance(v, Fraction):
        return sp.Rational(v.numerator, v.denominator)
    if name == "c_f" and not isinstance(v, sp.Basic):
        f = exact_capacity_factor(v)
        return sp.Rational(f.numerator, f.denominator)
    return sp.nsimplify(v) if isinstance(v, float) else v


def evaluate(values: dict[str, int | float | None], graph_mem: GraphMemory | None = None, lease_plan=None,
             notes: list[str] | None = None) -> Ledger:
    values = dict(values)  # symbols with a neutral default: no expert biases; every rank routes T·K rows
    if values.get("beta_E") is None:
        values["beta_E"] = 0
    if values.get("g_r") is None and values.get("ep_mp") is not None:
        values["g_r"] = values["ep_mp"]
    subs = {SYMBOLS[k].symbol: _exact(k, v) for k, v in values.items() if v is not None and k in SYMBOLS}
    figures: dict[str, Figure] = {}
    for name, f in FORMULAS.items():
        expr = formula(name).subs(subs)
        value = None if expr.free_symbols else _num(expr)
        note = "" if value is not None else "needs " + ", ".join(sorted(str(s) for s in expr.free_symbols))
        figures[name] = Figure(name, value, f.unit, f.group, f.doc, str(f.expr), "formula", note)
    notes = list(notes or [])

    def add(name: str, value, unit: str, group: str, doc: str, source: str) -> None:
        figures[name] = Figure(name, value, unit, group, doc, "", source)

    if graph_mem is not None:
        add("M_saved", graph_mem.saved_bytes, "bytes", "working", "activations the forward keeps for backward "
            "(all layers, one micro-batch)", "graph")
        add("N_recomputed", graph_mem.recomputed, "ops", "working", "forward ops the backward recomputes "
            "(activation_checkpointing; 0 without)", "graph")
        add("M_saved_moe_graph", sum(graph_mem.saved_moe_bytes.values()), "bytes", "working",
            "of those, produced by MoE ops (compare M_saved_moe)", "graph")
        add("M_grads_transient", graph_mem.grad_bytes, "bytes", "working",
            "gradients the backward graph returns together before accumulation", "graph")
        add("M_working", graph_mem.high_water, "bytes", "working", "execution working memory high-water over one "
            "forward and backward (graph liveness; kernel-internal temporaries excluded)", "graph")
    else:
        notes.append("graph figures (saved activations, working-memory high-water) need a compiled forward and "
                     "backward: run one training step first")
    if lease_plan is not None:
        add("M_sym", lease_plan.symmetric_bytes, "bytes", "working", "symmetric memory the lease pools allocate "
            "(slots x slot bytes, all pools)", "lease plan")
        add("H_payloads", sum(lease_plan.high_water.values()), "payloads", "working",
            "high-water payload count summed over (stage, family) pools", "lease plan")
    else:
        notes.append("no lease plan: the program has no lease_plan (symmetric payload figures not planned)")
    return Ledger(figures, {k: (float(v) if isinstance(v, Fraction) or (isinstance(v, sp.Rational) and v.q != 1) else
                                (int(v) if isinstance(v, sp.Integer) else v))
                            for k, v in values.items() if v is not None}, notes)


def _pipeline_graphs(cm) -> tuple[dict, GraphMemory | None, str, int | None]:
    """At pp > 1: the graphs the ledger reads and the graph memory of this rank's stages. Attention comes
    from the whole model's capture (every stage's, as explain plans them, or the first step's); the
    dispatch (T, activation dtype) from the first of this rank's stages that has one (T of a rank whose
    stages are all dense: the first step's microbatch tokens on this rank); graph memory sums
    the stages' saved activations (one microbatch each) and takes the largest high-water (one stage
    graph runs at a time)."""
    pipe = cm.pipeline
    progs = [p for p in pipe._stage_programs() if "forward" in p.training_graphs]
    graphs: dict = {}
    for p in progs:
        if _dispatch_spec(p.training_graphs)[0] is not None:
            graphs = {k: v for k, v in p.training_graphs.items() if k in ("partitioned", "joint", "forward")}
            break
    if pipe.planned:
        graphs["captured"] = [pipe.planned[s].training_graphs.get("captured") for s in sorted(pipe.planned)]
    elif pipe.captured is not None:
        graphs["captured"] = pipe.captured
    tokens = pipe.microbatch_tokens if progs else None
    if not progs:
        return graphs, None, ("pp > 1: token and graph figures come from this rank's compiled stages: run one "
                              "train_step first"), tokens
    symmetric = cm.program.transport == "symmetric"
    mems = [graph_memory(p.training_graphs["forward"], p.training_graphs.get("backward"), symmetric=symmetric)
            for p in progs]
    moe: dict[str, int] = {}
    for m in mems:
        for k, v in m.saved_moe_bytes.items():
            moe[k] = moe.get(k, 0) + v
    gm = GraphMemory(
        saved_bytes=sum(m.saved_bytes for m in mems), saved_moe_bytes=moe,
        output_bytes=max(m.output_bytes for m in mems), forward_high_water=max(m.forward_high_water for m in mems),
        backward_high_water=max(m.backward_high_water for m in mems), grad_bytes=max(m.grad_bytes for m in mems),
        recomputed=sum(m.recomputed for m in mems))
    stages = [p.pipeline_stage for p in progs]
    return graphs, gm, (f"pp > 1: graph figures are this rank's stages {stages}, one microbatch each (M_saved summed, "
                        "M_working the largest stage's); the schedule's forwards in flight are explain's stage rows"), tokens


DROPLESS_ONLY = ("C_rho", "C_bound", "M_recv_rho", "M_recv_uniform", "M_recv_bound")


def ledger_for(cm, *, micro_batches: int | None = None, optimizer_state_bytes: int = 8, main_weights: bool | None = None,
               tokens: int | None = None, seq_len: int | None = None, load_imbalance: float | None = None,
               sharded_optimizer: bool = False, reduce_scatter: bool | None = None) -> Ledger:
    """The ledger of a CompiledMoE (see :meth:`CompiledMoE.ledger`). ``load_imbalance`` ρ (the most rows one
    rank receives / T·K) sets the dropless figures C_rho, M_recv_rho; default: the observed high-water
    of the steps run so far (1 before any). ``micro_batches``: default the program's ``microbatches``
    (what one train_step runs). ``sharded_optimizer``: the persistent state of
    OLMoDDPOptimizer (FP32 main_grad buckets, FP32 main weights and moments ZeRO-1 sharded over each
    family's replicas) instead of a replicated optimizer over the parameters' own gradients.
    ``reduce_scatter``: that optimizer's gradient intake reduce-scatters the buckets (half an all-reduce's
    bytes; each bucket's reduced part persists beside it, its packed send rows only while it reduces);
    default: as the OLMoDDPOptimizer built over ``cm`` does, else as it would decide: on accelerators,
    not on CPU ranks."""
    prog = cm.program
    observed = tokens is None  # the graphs' own shapes: the most rows the group routed bounds C (ragged batches)
    if reduce_scatter is None:  # the intake of the OLMoDDPOptimizer built over cm, else the one it would pick
        from ..train.optimizer import auto_reduce_scatter

        built = [o.reduce_scatter for o in cm.optimizers]
        reduce_scatter = sharded_optimizer and (any(built) if built else auto_reduce_scatter(cm))
    elif reduce_scatter and not sharded_optimizer:
        raise LedgerError("ledger(reduce_scatter=True): buckets are reduce-scattered into the ZeRO-1 owned ranges "
                          "of a sharded optimizer; pass sharded_optimizer=True too")
    if micro_batches is None:
        micro_batches = prog.options.microbatches
    state = find_dropless_state(prog.ctx_id) if prog.options.capacity_factor is None else None
    if load_imbalance is None and state is not None and state.high_water and state.blocks:
        load_imbalance = state.high_water / max(r for r, _ in state.blocks.values())
    shape = moe_shape(prog.blocks.values())
    counts = count_params(cm.model, prog.blocks.values(), cm.is_expert_param, prog.ep_size)
    shape_values = dict(L=shape.layers, N=shape.N, G=int(shape.gated), d=shape.d, h_e=shape.h_e, beta_E=int(shape.bias))
    expected = int(formula("P_E").subs({SYMBOLS[k].symbol: v for k, v in shape_values.items()}))
    if counts.expert_total != expected:
        raise LedgerError(f"ledger: the model holds {counts.expert_total} routed-expert parameters (all ranks), but "
                          f"P_E = {formula('P_E')} = {expected}")
    graphs = dict(prog.training_graphs)  # the last training capture's (an evaluation compiles no backward)
    gm = None
    if cm.pipeline is not None:  # the whole program captured no graph of its own: its stages did
        graphs, gm, note, mb_tokens = _pipeline_graphs(cm)
        tokens = tokens if tokens is not None else mb_tokens
    act = next((p.dtype for n, p in cm.model.named_parameters() if p.is_floating_point()), None)
    values, notes = gather_values(
        shape, counts, prog.mesh, graphs, capacity_factor=prog.options.capacity_factor,
        micro_batches=micro_batches, optimizer_state_bytes=optimizer_state_bytes, main_weights=main_weights,
        mxfp8=prog.options.mxfp8 is not None, activation_dtype=act, tokens=tokens, seq_len=seq_len,
        dropless_factor=state.ledger_factor if state is not None else None, load_imbalance=load_imbalance or 1,
        dropless_headroom=prog.options.dropless_headroom, sharded_optimizer=sharded_optimizer,
        reduce_scatter=reduce_scatter, group_rows=state.group_rows if state is not None and observed else None,
        mx_dense_params=sum(s.param.numel() for s in prog.dense_weight_stores.values()),
    )
    if cm.pipeline is not None:
        notes.append(note)
    elif "forward" in graphs:
        gm = graph_memory(graphs["forward"], graphs.get("backward"), symmetric=cm.program.transport == "symmetric")
    plan = cm.lease_plan() if callable(getattr(cm, "lease_plan", None)) else None
    if plan is not None and values.get("H") is None:
        values["H"] = max(plan.high_water.values(), default=0)
    led = evaluate(values, gm, plan, notes)
    if prog.options.capacity_factor is not None:  # a fixed capacity: the dropless figures describe no buffer here
        for name in DROPLESS_ONLY:
            f = led.figures[name]
            led.figures[name] = replace(f, value=None, note="dropless only (capacity_factor is set)")
    led.values["P_dense_measured"] = counts.dense
    led.values["P_E_measured"] = counts.expert_total
    led.values["P_local_measured"] = counts.local
    return led


__all__ = ["Figure", "GraphMemory", "Ledger", "definition", "evaluate", "formula", "format_value", "ledger_for"]
