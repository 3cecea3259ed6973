"""What the front end understood about one MoE block."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int  # N
    top_k: int  # K
    score_func: str  # softmax | sigmoid
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

    @property
    def bias_in_router(self) -> bool:
        """The score-correction bias is the router's own buffer; else the block holds it and passes it in."""
        return bool(self.bias_attr) and "." in self.bias_attr


@dataclass(frozen=True)
class ExpertsSpec:
    num_experts: int
    d_model: int  # d
    hidden: int  # h_e
    activation: str  # silu | gelu | gelu_tanh | relu
    gated: bool  # SwiGLU-style (w_in holds [gate; up]) or a plain two-layer FFN
    layout: str  # fused (HF 3-D tensors, kept as they are) | module_list | stacked

    @property
    def in_rows(self) -> int:
        return 2 * self.hidden if self.gated else self.hidden


@dataclass(frozen=True)
class ParamView:
    """Where an original parameter lives inside a canonical expert tensor ([N, out, in])."""

    original: str  # name in the original model.named_parameters()
    canonical: str  # name in the compiled model
    expert: int | None  # None: the whole [N, out, in] tensor is the original parameter
    rows: tuple[int, int] | None = None  # slice of the out dimension (gate / up halves)


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

    def describe(self) -> str:
        r, e = self.router, self.experts
        parts = [
            f"{r.score_func} router, top-{r.top_k} of {r.num_experts}",
            "renormalised" if r.renormalize else "not renormalised",
            f"{'SwiGLU' if e.gated else 'FFN'}({e.activation}) experts d={e.d_model} h={e.hidden} [{e.layout}]",
        ]
        if r.bias_attr:
            parts.append("score-correction bias")
        if r.scaling != 1.0:
            parts.append(f"scaling {r.scaling}")
        if self.shared_attr:
            parts.append(f"shared expert h={self.shared_hidden}" + (" (sigmoid gate)" if self.shared_gate_attr else ""))
        if r.lb_coef or r.z_coef:
            parts.append(f"aux lb={r.lb_coef} z={r.z_coef}")
        return ", ".join(parts)
