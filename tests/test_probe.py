"""The probe settles routing semantics that the block's output alone does not show: identical experts
(sparse upcycling), mixture weights detached in the forward. Checked against the dense model training."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from moe_compile import moe_compile
from moe_compile.errors import UnsupportedFeatureError
from moe_compile.models import MoEFeedForward, TinyMoEConfig

from .common import assert_step_matches_dense, build_model, grads_of, make_batches, rel_err


class _Unannounced(MoEFeedForward):
    """The tiny block with its score function in the forward only (no ``score_func`` attribute to read):
    the probe must tell softmax from sigmoid by what the block computes. No aux loss."""

    def __init__(self, cfg: TinyMoEConfig) -> None:
        super().__init__(cfg)
        self.sigmoid = cfg.score_func == "sigmoid"
        del self.score_func

    def forward(self, hidden):
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        logits = self.router(x).float()
        scores = torch.sigmoid(logits) if self.sigmoid else torch.softmax(logits, dim=-1)
        w, idx = torch.topk(scores, self.top_k, dim=-1)
        y = self.expert_mix(x, idx, (w / w.sum(-1, keepdim=True)).to(x.dtype)).reshape(shape)
        return y, logits.new_zeros(())


def _upcycled(score: str) -> torch.nn.Module:
    """Every expert a copy of expert 0 (a dense FFN upcycled into an MoE)."""
    model = build_model("tiny", lb_coef=0.0, z_coef=0.0)
    cfg = TinyMoEConfig(vocab_size=256, lb_coef=0.0, z_coef=0.0, score_func=score)
    for layer in model.layers:
        block = _Unannounced(cfg)
        block.load_state_dict(layer.mlp.state_dict())
        for e in block.experts[1:]:
            e.load_state_dict(block.experts[0].state_dict())
        layer.mlp = block
    return model


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_upcycled_identical_experts_train_like_the_dense_model(score):
    """With identical experts every renormalised top-k routing gives the same output (the probe tried softmax
    first and kept it); only the block's own rule trains right once the experts drift apart. Three SGD steps, loss and every gradient each step."""
    dense = _upcycled(score)
    model = moe_compile(copy.deepcopy(dense))
    assert {b.router.score_func for b in model.program.blocks.values()} == {score}
    opt_d = torch.optim.SGD(dense.parameters(), lr=0.5)
    opt_m = torch.optim.SGD(model.parameters(), lr=0.5)
    for x in make_batches(1, batch=2, seq=16, seed=0) * 3:
        ld = dense(input_ids=x, labels=x).loss
        lm = model(input_ids=x, labels=x).loss
        ld.backward()
        lm.backward()
        assert abs(lm.item() - ld.item()) <= 1e-5 * abs(ld.item())
        gd, gm = grads_of(dense), model.full_grads()
        scale = max(g.abs().max().item() for g in gd.values())  # the routers' gradients start at ~0 exactly
        for name, g in gd.items():
            assert (gm[name] - g).abs().max().item() <= 1e-5 * scale, name
        for opt in (opt_d, opt_m):
            opt.step()
            opt.zero_grad(set_to_none=True)
    experts = dense.layers[0].mlp.experts
    assert rel_err(experts[3].w1.weight, experts[0].w1.weight) > 1e-3  # the experts did drift apart


def test_probe_leaves_the_model_weights_bit_identical():
    from moe_compile.frontend import recognize

    model = _upcycled("sigmoid")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    recognize(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


class _DetachedWeights(MoEFeedForward):
    """Mixture weights detached (no gradient into the router through them): the output is the same as the
    plain block's, the gradients are not."""

    def forward(self, hidden):
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        scores = torch.softmax(self.router(x).float(), dim=-1)
        w, idx = torch.topk(scores, self.top_k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).detach()
        return self.expert_mix(x, idx, w.to(x.dtype)).reshape(shape)


def test_detached_mixture_weights_are_refused():
    model = build_model("tiny", lb_coef=0.0, z_coef=0.0)
    block = _DetachedWeights(TinyMoEConfig(vocab_size=256, lb_coef=0.0, z_coef=0.0))
    block.load_state_dict(model.layers[1].mlp.state_dict())
    model.layers[1].mlp = block
    with pytest.raises(UnsupportedFeatureError, match=r"layers\.1\.mlp: the compiled form reproduces the block's "
                                                      r"output on a probe batch but not its gradients"):
        moe_compile(model)


def test_a_router_gradient_zero_in_exact_arithmetic_is_not_a_mismatch():
    """Top-1 renormalised: every mixture weight is 1, so the router's gradient is rounding noise in the block
    and in its compiled form alike; the probe must not call that a different backward."""
    model = build_model("tiny", top_k=1, lb_coef=0.0, z_coef=0.0)
    dense = copy.deepcopy(model)
    cm = moe_compile(model)
    x = make_batches(1)[0]
    dense(input_ids=x, labels=x).loss.backward()
    cm(input_ids=x, labels=x).loss.backward()
    gd, gm = grads_of(dense), cm.full_grads()
    scale = max(g.abs().max().item() for g in gd.values())
    assert max((gm[n] - g).abs().max().item() for n, g in gd.items()) <= 1e-5 * scale


@pytest.mark.parametrize("biased", [False, True])
def test_routed_experts_input_gradient_with_frozen_experts(biased):
    """The eager routed-experts op skips the expert weights' gradients when none is wanted (frozen experts,
    the probe's backward); the input's and mixture weights' gradients still match plain torch ops."""
    g = torch.Generator().manual_seed(0)
    t, d, h, n, k = 12, 8, 6, 4, 2
    x = torch.randn(t, d, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g, requires_grad=True)
    w_in, w_out = torch.randn(n, 2 * h, d, generator=g), torch.randn(n, d, h, generator=g)
    b = (torch.randn(n, 2 * h, generator=g), torch.randn(n, d, generator=g)) if biased else ()
    y = torch.ops.moe.routed_experts(x, idx, w, w_in, w_out, "silu", True, n, 0, "blk", *b)
    cot = torch.randn(t, d, generator=g)
    gx, gw = torch.autograd.grad((y * cot).sum(), [x, w])
    ref = torch.zeros(t, d)
    for tok in range(t):
        for j in range(k):
            e = int(idx[tok, j])
            pre = w_in[e] @ x[tok] + (b[0][e] if biased else 0)
            out = w_out[e] @ (F.silu(pre[:h]) * pre[h:]) + (b[1][e] if biased else 0)
            ref = ref.index_add(0, torch.tensor([tok]), (w[tok, j] * out)[None])
    rx, rw = torch.autograd.grad((ref * cot).sum(), [x, w])
    assert rel_err(gx, rx) < 1e-5 and rel_err(gw, rw) < 1e-5


class _UpFirstExperts(torch.nn.Module):
    """Input-major fused experts [N, d, 2h] whose first half is *up* (no reading the compiler has): with
    h a multiple of the probe weights' period, a periodic random fill made both halves equal and the
    block settled as gate-first, compiling a different model."""

    def __init__(self, n, d, h):
        super().__init__()
        self.num_experts = n
        self.gate_up_proj = torch.nn.Parameter(torch.randn(n, d, 2 * h) * d**-0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(n, h, d) * h**-0.5)
        self.act_fn = torch.nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            tok, pos = torch.where(top_k_index == e)
            up, gate = (hidden_states[tok] @ self.gate_up_proj[e]).chunk(2, dim=-1)
            out.index_add_(0, tok, (self.act_fn(gate) * up) @ self.down_proj[e] * top_k_weights[tok, pos, None])
        return out


def test_a_gate_up_order_the_compiler_lacks_is_refused():
    from moe_compile.errors import RecognitionError
    from moe_compile.models.hf import tiny_family_model

    torch.manual_seed(0)
    model = tiny_family_model("mixtral", seed=0, intermediate_size=64)
    for layer in model.model.layers:
        ex = layer.mlp.experts
        layer.mlp.experts = _UpFirstExperts(ex.num_experts, ex.hidden_dim, 64)
    with pytest.raises(RecognitionError, match=r"model\.layers\.0\.mlp: .*no supported routing reproduces its output"):
        moe_compile(model)


def test_ernie_score_correction_bias_one_module_down():
    """Ernie 4.5 keeps its selection bias in gate.moe_statics ([1, N]); it was not found, so a model with a
    non-zero bias (any pretrained one) was refused by the probe. Now read: matches the dense model."""
    from moe_compile.models.hf import tiny_family_model

    model = tiny_family_model("ernie4_5_moe", seed=0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("moe_statics.e_score_correction_bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    ref = copy.deepcopy(model)
    ids = make_batches(1, seed=2)[0]
    cm = moe_compile(model)
    assert all(s.router.bias_attr == "gate.moe_statics.e_score_correction_bias" for s in cm.blocks.values())
    assert_step_matches_dense(cm, ref, ids)
    cm.close()


def test_an_fp32_router_in_a_bf16_model():
    """A bf16 model whose routers stay fp32 (their input cast up): the canonical router called the fp32
    Linear on bf16 rows (a dtype error, reported as "a router must ... be a Linear"), and the probe held
    the fp32 router's gradient, computed from bf16 values, to fp32's tolerance."""
    model = build_model("tiny").to(torch.bfloat16)
    for layer in model.layers:
        layer.mlp.router.float().register_forward_pre_hook(lambda m, args: (args[0].to(m.weight.dtype),))
    ref = copy.deepcopy(model)
    ids = make_batches(1, seed=4)[0]
    cm = moe_compile(model)
    loss = cm(input_ids=ids, labels=ids).loss
    want = ref(input_ids=ids, labels=ids).loss
    assert abs(loss.item() - want.item()) <= 1e-2 * abs(want.item())
    assert cm.model.layers[0].mlp.router.weight.dtype == torch.float32
    cm.close()


class _TupleRouter(torch.nn.Module):
    """A hand-written router returning (logits, renormalised top-k weights, indices)."""

    def __init__(self, weight: torch.Tensor, top_k: int) -> None:
        super().__init__()
        self.weight, self.top_k = torch.nn.Parameter(weight.detach().clone()), top_k

    def forward(self, x):
        logits = F.linear(x, self.weight)
        w, idx = logits.softmax(-1).topk(self.top_k, -1)
        return logits, w / w.sum(-1, keepdim=True), idx


def test_a_tuple_router_with_a_module_list_of_experts():
    """Components mode replaced the experts module with one grouped op, which the block's own loop
    indexes expert by expert ("'ExpertWeights' object is not subscriptable", reported as an unmodelled
    router interface); an nn.ModuleList of experts now means block mode. Matches the dense model."""
    model = build_model("tiny", lb_coef=0.0, z_coef=0.0)
    for layer in model.layers:
        blk = layer.mlp
        blk.router = _TupleRouter(blk.router.weight, blk.top_k)

        class Looping(type(blk)):
            def forward(self, hidden):
                x = hidden.reshape(-1, hidden.shape[-1])
                _, w, idx = self.router(x)
                return self.expert_mix(x, idx, w).reshape(hidden.shape), x.new_zeros(())

        blk.__class__ = Looping
    ref = copy.deepcopy(model)
    ids = make_batches(1, seed=6)[0]
    cm = moe_compile(model)
    assert {s.mode for s in cm.blocks.values()} == {"block"}
    assert_step_matches_dense(cm, ref, ids)
    cm.close()


def test_probes_restore_each_modules_own_mode():
    """The randomness probe (training mode) and the pipeline's call-order probe (eval mode) set the mode of
    the whole block or model; a submodule the user had put in another mode than its parent (a frozen part
    in eval inside a training model) came back in its parent's mode, and the call-order forward's update
    of a buffer stayed."""
    from moe_compile.passes.call_order import first_run_phases

    from .test_errors import _count_load

    model = build_model("tiny")
    model.train()
    model.layers[0].mlp.experts[1].eval()
    model.layers[1].attn.eval()
    modes = {n: m.training for n, m in model.named_modules()}
    _count_load(model.layers[1].mlp)  # a buffer its forward updates: the call-order forward's update is undone
    phases = first_run_phases(model, "layers", len(model.layers))
    assert phases["embed"] == "before" and phases["lm_head"] == "after", phases
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert not model.layers[1].mlp.expert_load.any()
    model = build_model("tiny")
    model.train()
    model.layers[0].mlp.experts[1].eval()
    model.layers[1].attn.eval()
    moe_compile(model).close()
    after = {n: m.training for n, m in model.named_modules() if n in modes}  # experts are replaced: not kept
    assert after == {n: modes[n] for n in after} and not after["layers.1.attn"] and after["layers.0.attn"]


def test_an_attribute_the_replaced_code_read_is_checked_before_each_run():
    """A plain attribute read by code the compiled form replaced (a block-mode forward's temperature, an HF
    router's top_k) keeps its compile-time value inside the program: changing it afterwards used to be
    ignored silently. Now a run refuses it by name, and putting the value back makes runs work again."""
    from moe_compile.errors import OptionError
    from moe_compile.models.hf import tiny_hf_model

    model = build_model("tiny", lb_coef=0.0, z_coef=0.0)
    for layer in model.layers:
        blk = layer.mlp
        blk.temperature, blk.stat_lr, blk.updates = 1.0, 1e-3, 0

        class Tempered(type(blk)):
            def forward(self, hidden):
                x = hidden.reshape(-1, hidden.shape[-1])
                w, idx = (self.router(x).float() / self.temperature).softmax(-1).topk(self.top_k, -1)
                w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
                return self.expert_mix(x, idx, w).reshape(hidden.shape), x.new_zeros(())

            def between_steps(self):  # the user's code, still running: what it reads or updates is live
                self.updates += 1
                return self.stat_lr * self.updates

        blk.__class__ = Tempered
    ref = copy.deepcopy(model)
    ids = make_batches(1, seed=7)[0]
    with torch.no_grad():
        before = ref(ids).logits
        ref.layers[0].mlp.temperature = 0.5
        assert rel_err(ref(ids).logits, before) > 1e-3  # the attribute matters to the model
    ref.layers[0].mlp.temperature = 1.0
    cm = moe_compile(model)
    assert {s.mode for s in cm.blocks.values()} == {"block"}
    model.layers[0].mlp.temperature = 0.5
    for run in (lambda: cm(ids, labels=ids), lambda: cm.train_step(input_ids=ids, labels=ids)):
        with pytest.raises(OptionError, match=r"layers\.0\.mlp\.temperature was 1\.0 when compiling and is 0\.5"):
            run()
    model.layers[0].mlp.temperature = 1.0
    model.layers[0].mlp.stat_lr = 5e-4  # read by a method the compiled form does not replace: not checked
    model.layers[0].mlp.between_steps()
    assert_step_matches_dense(cm, ref, ids)
    cm.close()

    hf = tiny_hf_model("olmoe", layers=1, d=32, experts=4, top_k=2, hidden=16)
    cm = moe_compile(hf)
    hf.model.layers[0].mlp.gate.top_k = 1
    with pytest.raises(OptionError, match=r"mlp\.gate\.top_k was 2 when compiling and is 1"):
        cm(input_ids=ids[:, :8], labels=ids[:, :8])
    cm.close()
