"""What the front end understood about one MoE block."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int  # N
    top_k: int  # K
    score_func: str  # softmax | sigmoid | sqrtsoftplus (DeepSeek-V4)
    renormalize: bool  # top-k weights divided by their sum
    scaling: float = 1.0  # routed scaling factor applied to the weights
    fp32_weights: bool = False  # weights stay fp32 (Mixtral) instead of the logits' dtype
    bias_attr: str | None = None  # score-correction bias buffer (selection only)
    lb_coef: float = 0.0
    z_coef: float = 0.0
    n_group: int = 1  # group-limited routing: experts in n_group equal groups (1: ungrouped)
    topk_group: int = 1  # ... tokens pick their top-k among the best topk_group groups only
    group_score: str = "top2_sum"  # a group's score: sum of its top-2 (DeepSeek-V3, GLM-4) | max (V2)
    weight_attr: str = "weight"  # the [N, d] weight inside the router module: its own, or one level down
    #                             ("gate.weight" for router.gate, "wg.weight" for gate.wg, …)
    outputs: tuple[str, str, str] = ("logits", "weights", "indices")  # the router's tuple order (components)
    weights_on_input: bool = False  # the weight scales the expert's input, y = Σ_k expert(w_k·x) (Llama 4),
    #                                not its output, y = Σ_k w_k·expert(x)
    logit_bias_attr: str | None = None  # a bias of the router Linear itself (gpt-oss): logits = x Wᵀ + b,
    #                                    so it moves selection and weights (unlike the score-correction bias)
    bias_on: str = "scores"  # the score-correction bias is added to the scores (DeepSeek-V3) | logits (Kolibri)
    input_norm_attr: str | None = None  # the router's child normalising its input (Gemma 4: norm) …
    input_scale_attr: str | None = None  # … its [d] parameter scaling it (scale) …
    input_scaling: float = 1.0  # … and a constant (d^-1/2): see frontend/router_input.py
    expert_scale_attr: str | None = None  # the router's [N] parameter scaling each chosen expert's weight
    identity_experts: int = 0  # Z zero-computation experts scored after the N routed ones (LongCat-Flash): the
    #                            router selects among N + Z; a row routed to index ≥ N adds weight·x, no FFN
    shared_scored: int = 0  # S > 0: the router's weight has N + S rows, the last S scoring the shared experts
    #                        (Inkling); selection is among the first N, renormalisation over the K chosen and
    #                        the S shared scores, and the shared scores weight the shared experts (dense ops)
    weight_scale_attr: str | None = None  # the router's [1] parameter scaling every route weight (global_scale)
    logits_from_forward: bool = False  # a router network (Zaya: projection, cross-layer state, MLP): its own forward,
    #                                    run as dense graph code, gives the logits (and any outputs after its
    #                                    three); moe::router re-derives weights and indices from those logits
    null_experts: int = 0  # Z skip classes scored after the N routed ones (Zaya): a row routed to one adds nothing
    hash_table_attr: str | None = None  # hash routing (DeepSeek-V4's first layers): the router's [vocab, K] buffer of
    #                                     expert indices; a token's experts are its row, the scores weight them
    call_router: bool = False  # block mode: the router module returns logits only (DBRX) and the canonical forward
    #                            calls it, so hooks on it (transformers' router-logit recorders) see them

    @property
    def own_forward(self) -> bool:
        """The router module's own forward runs in the compiled form (it reads everything it holds)."""
        return self.logits_from_forward or self.call_router

    @property
    def bias_in_router(self) -> bool:
        """The score-correction bias is the router's own buffer; else the block holds it and passes it in."""
        return bool(self.bias_attr) and "." in self.bias_attr


@dataclass(frozen=True)
class ExpertsSpec:
    num_experts: int
    d_model: int  # d
    hidden: int  # h_e
    activation: str  # silu | gelu | gelu_tanh | relu | relu2 | clamped_swiglu | softcap_swiglu
    gated: bool  # SwiGLU-style (w_in holds [gate; up]) or a plain two-layer FFN
    layout: str  # fused (HF 3-D tensors) | module_list | stacked
    act_params: tuple[tuple[str, float], ...] = ()  # e.g. (("alpha", 1.702), ("limit", 7.0), ("up_offset", 1.0))
    bias: bool = False  # expert biases b_in [N, F] (gate_up_proj_bias) and b_out [N, d] (down_proj_bias)

    @property
    def in_rows(self) -> int:
        return 2 * self.hidden if self.gated else self.hidden

    @property
    def op_activation(self) -> str:
        """The activation as the moe:: ops take it: its name, with parameters as ``name(k=v,...)``."""
        if not self.act_params:
            return self.activation
        return f"{self.activation}({','.join(f'{k}={v!r}' for k, v in self.act_params)})"


@dataclass(frozen=True)
class ParamView:
    """Where an original parameter lives inside a canonical expert tensor ([N, out, in])."""

    original: str  # name in the original model.named_parameters()
    canonical: str  # name in the compiled model
    expert: int | None  # None: the whole [N, out, in] tensor is the original parameter
    rows: tuple[int, int] | None = None  # slice of the out dimension (gate / up halves)
    transpose: bool = False  # the original is input-major ([N, in, out]): canonical = originalᵀ
    interleaved: bool = False  # the original's gate/up columns alternate (g0 u0 g1 u1 …): canonical = [gate; up]
    flat: bool = False  # the original holds the experts flattened into rows ([N·out, in], DBRX)
    dead_experts: int = 0  # the original holds this many unused experts after the N routed ones (LongCat-Flash's
    #                        gate_up_proj [N + Z, …] for its Z identity experts): they read back as zeros

    def original_of(self, full: torch.Tensor) -> torch.Tensor:
        """The original parameter (or its gradient) from the full canonical tensor: weights [N, out, in],
        biases [N, out] (handled as [N, out, 1])."""
        x = full if self.expert is None else full[self.expert]
        bias = x.dim() == (2 if self.expert is None else 1)
        x = x.unsqueeze(-1) if bias else x
        if self.rows is not None:
            x = x[..., self.rows[0]: self.rows[1], :]
        if self.interleaved:  # [gate; up] rows back to alternating g0 u0 g1 u1 …
            g, u = x.chunk(2, dim=-2)
            x = torch.stack([g, u], dim=-2).flatten(-3, -2)
        if bias:
            x = x.squeeze(-1)
        elif self.transpose:
            x = x.transpose(-2, -1)
        if self.dead_experts:  # never read by the model: zero (their gradient is zero in the original too)
            x = torch.cat([x, x.new_zeros(self.dead_experts, *x.shape[1:])])
        return (x.reshape(-1, x.shape[-1]) if self.flat else x).clone()


@dataclass(frozen=True)
class MoEBlockSpec:
    path: str  # original module path
    index: int  # order among the model's MoE blocks
    mode: str  # "components": the block's own forward calls router and experts (HF protocol);
    #            "block": the whole forward is replaced by the canonical one
    router_attr: str
    experts_attr: str
    router: RouterSpec
    experts: ExpertsSpec
    shared_attr: str | None = None
    shared_gate_attr: str | None = None
    shared_hidden: int = 0
    returns_aux: bool = False
    returns_logits: bool = False  # "block" mode: the block returns (output, router logits) (Llama 4)
    checked: bool = False  # the canonical form reproduced the block's own output on a probe batch
    param_views: tuple[ParamView, ...] = ()

    @property
    def router_weight_name(self) -> str:
        """Name of the router's [N, d] weight in model.named_parameters()."""
        return f"{self.path}.{self.router_attr}.{self.router.weight_attr}".lstrip(".")

    @property
    def in_name(self) -> str:
        return f"{self.path}.{self.experts_attr}.{'gate_up_proj' if self.experts.gated else 'up_proj'}"

    @property
    def out_name(self) -> str:
        return f"{self.path}.{self.experts_attr}.down_proj"

    @property
    def expert_param_names(self) -> tuple[str, ...]:
        """Canonical names of the routed-expert tensors (sharded over ep_mp): weights, then biases."""
        names = (self.in_name, self.out_name)
        return names + (f"{self.in_name}_bias", f"{self.out_name}_bias") if self.experts.bias else names

    def describe(self) -> str:
        r, e = self.router, self.experts
        parts = [
            f"{r.score_func} router, top-{r.top_k} of {r.num_experts}",
            "renormalised" if r.renormalize else "not renormalised",
            f"{'SwiGLU' if e.gated else 'FFN'}({e.op_activation}) experts d={e.d_model} h={e.hidden} [{e.layout}]",
        ]
        if r.bias_attr:
            parts.append("score-correction bias" + (" on the logits" if r.bias_on == "logits" else ""))
        if r.weights_on_input:
            parts.append("weights scale the expert input")
        if r.logit_bias_attr:
            parts.append("router bias")
        if r.identity_experts:
            parts.append(f"{r.identity_experts} identity (zero-computation) experts")
        if r.null_experts:
            parts.append(f"{r.null_experts} skip (null) experts")
        if r.hash_table_attr:
            parts.append(f"hash routing by token id ({r.hash_table_attr})")
        if r.logits_from_forward:
            parts.append("logits from the router network's own forward")
        if r.scaling != 1.0:
            parts.append(f"scaling {r.scaling}")
        if self.shared_attr:
            parts.append(f"shared expert h={self.shared_hidden}" + (" (sigmoid gate)" if self.shared_gate_attr else ""))
        if r.shared_scored:
            parts.append(f"router also scores {r.shared_scored} shared experts")
        if r.lb_coef or r.z_coef:
            parts.append(f"aux lb={r.lb_coef} z={r.z_coef}")
        return ", ".join(parts)
