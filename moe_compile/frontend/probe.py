"""The probe that checks the canonical forwards (:mod:`.canonical`) against the user's blocks.

Before anything is sharded, the probe runs the block's own forward and the canonical one on the same
random batch; semantics that attributes leave open (score function, renormalisation, fp32 weights,
whether a scaling attribute is the router's, whether the weights scale the expert input, and which
reading of the expert tensors applies: layout, gate/up order, activation offset) are settled by which
candidate reproduces the block, and no match is an error naming the block. A block whose router returns
logits only (DBRX) or whose experts take pre-weighted rows alone (Llama 4) runs in "block" mode.

Outputs alone do not pin the semantics down: with the model's own expert weights identical (sparse
upcycling) or zero, routings that differ only in how they weight the experts give the same output, and
mixture weights detached in the block's forward change its gradients only. So the probe runs on random
expert weights (the model's own restored afterwards), and a candidate whose output matches must also
match one backward's gradients (hidden states and router weight) before it is kept.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools

import torch
import torch.nn as nn

from ..errors import MoECompileError, RecognitionError, UnsupportedFeatureError
from .canonical import _bias, install, uninstall
from .kept_state import kept_state
from .recognize import Candidate
from .router_input import custom_backward
from .spec import MoEBlockSpec, RouterSpec
from .structure import LB_ATTRS, Z_ATTRS

PROBE_TOKENS = 48
EXPERT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PROBE_LOGIT_STD = 2.0  # spread of the router logits on the probe batch
PROBE_VOCAB = 4 * PROBE_TOKENS  # token ids of the probe batch of a hash router: 0 .. PROBE_VOCAB − 1


# -- probe -------------------------------------------------------------------------------------


def _close(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0, low: bool = False) -> tuple[bool, float]:
    """Max error relative to the larger magnitude, against fp32's tolerance or a 16-bit one (either tensor
    16-bit, or ``low``: computed from 16-bit values, e.g. an fp32 router's gradient in a bf16 block)."""
    if a.shape != b.shape and a.numel() == b.numel():  # [B, S, d] against a block returning [B·S, d]
        a = a.reshape(b.shape)
    if a.shape != b.shape:
        return False, float("inf")
    tol = 1e-4 if a.dtype == torch.float32 and b.dtype == torch.float32 and not low else 3e-2
    scale = max(a.abs().max().item(), b.abs().max().item(), floor) + 1e-12  # symmetric: one of them may be zero
    err = (a.float() - b.float()).abs().max().item() / scale
    return err <= tol, err


def _split(out: object, where: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(out, torch.Tensor):
        return out, None
    if isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out) and out[1].dim() == 0:
        return out[0], out[1]
    if isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out):
        # (output, router scores) (gpt-oss; components mode: the block's own forward builds both from ours)
        # or (output, router logits) (Llama 4; block mode: spec.returns_logits)
        return out[0], None
    raise RecognitionError(
        f"{where}: forward returns {type(out).__name__}; a MoE block must return a tensor or (tensor, aux_loss scalar)"
    )


@contextlib.contextmanager
def _probe_router(c: Candidate, gen: torch.Generator):
    """Random router weights (logits of spread PROBE_LOGIT_STD) and score-correction bias for the probe,
    the model's own restored afterwards. Near-zero logits (a zero-initialised router, as AFMoE's) would
    let routings that differ only away from 0 pass: softmax and sigmoid renormalised over the top-2 agree
    at 0 and differ 2x in gradient; a zero bias would hide where the bias is added."""
    router = getattr(c.block, c.router_attr)
    w = _bias(router, c.weight_attr)
    tensors = [w] + ([_bias(c.block, c.bias_attr)] if c.bias_attr else [])
    if c.logit_bias_attr:  # a zero router bias would hide whether it is added
        tensors.append(_bias(router, c.logit_bias_attr))
    scales = [getattr(router, a) for a in (c.router_extras.get("input_scale_attr"), c.router_extras.get("expert_scale_attr"),
                                           c.router_extras.get("weight_scale_attr"))
              if a]  # ones would hide whether (and where) they multiply
    table = _bias(router, c.router_extras["hash_table_attr"]) if c.router_extras.get("hash_table_attr") else None
    saved = [t.detach().clone() for t in tensors + scales + ([table] if table is not None else [])]
    try:
        with torch.no_grad():
            n, d = w.shape
            w.copy_(torch.randn(n, d, generator=gen).to(w) * (PROBE_LOGIT_STD / d**0.5))
            if table is not None:  # K distinct experts for the tokens the probe uses (a zero table would send
                v = min(table.shape[0], PROBE_VOCAB)  # every token to expert 0 twice)
                rows = torch.rand(v, n, generator=gen).argsort(dim=-1)[:, : table.shape[1]]
                table[:v] = rows.to(table)
            for t in tensors[1:]:
                t.copy_(torch.randn(t.shape, generator=gen).to(t) * 0.5)
            for t in scales:
                t.copy_(1 + 0.5 * torch.randn(t.shape, generator=gen).to(t))
        yield
    finally:
        with torch.no_grad():
            for t, v in zip(tensors + scales + ([table] if table is not None else []), saved, strict=True):
                t.copy_(v)


PROBE_PERIOD = 64  # a probe weight's row c-th entry: a[c mod P] + b[c div P], P = PROBE_PERIOD


def _random_like(p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Uniform values of std ≈ 1/√fan-in (0.5 for a bias) shaped like ``p``, from few random numbers: entry c
    of a row is a[c mod P] + b[c div P] with a, b random per row, so no two columns of a row are equal (a
    repeated block alone made the gate and up halves of an input-major [N, d, 2h] tensor identical when
    P divides h) and every row is random — rows carry the expert index in every layout ([N, r, c] and
    flattened [N·r, c]), so the experts differ whatever the reading. A full random tensor costs 20× the
    random numbers: 5 s per OLMoE-7B layer on a CPU core."""
    g = gen if p.device.type == "cpu" else torch.Generator(device=p.device).manual_seed(
        int(torch.randint(1 << 31, (1,), generator=gen)))
    cols = p.shape[-1]
    bound = (1.5 / (cols if p.dim() > 1 else 4.0)) ** 0.5  # two uniform terms: each of half the variance
    period = min(cols, PROBE_PERIOD)
    blocks = -(-cols // period)
    a = torch.empty(*p.shape[:-1], 1, period, device=p.device).uniform_(-bound, bound, generator=g)
    b = torch.empty(*p.shape[:-1], blocks, 1, device=p.device).uniform_(-bound, bound, generator=g)
    return (a + b).to(p.dtype).flatten(-2)[..., :cols].contiguous()


@contextlib.contextmanager
def _probe_experts(c: Candidate, gen: torch.Generator, cache: dict | None):
    """Random routed-expert weights for the probe: identical experts (sparse upcycling) or zero ones would
    let routings that weight the experts differently give the same output. The parameters' storage is
    swapped (``.data``), not copied, so the model's own values come back untouched; they also stop
    requiring gradients meanwhile (the probe's backward needs the hidden states' and router's only).
    ``cache`` keeps the random tensors for the next blocks of the same structure (the i-th parameter of each;
    a block's own tensors are drawn apart), writing them once per model."""
    params = [p for p in getattr(c.block, c.experts_attr).parameters() if p.is_floating_point()]
    saved = [(p.data, p.requires_grad) for p in params]
    cache = {} if cache is None else cache
    try:
        for i, p in enumerate(params):
            key = (i, tuple(p.shape), p.dtype, p.device)
            if key not in cache:
                cache[key] = _random_like(p, gen)
            p.data = cache[key]
            p.requires_grad_(False)
        yield
    finally:
        for p, (v, rg) in zip(params, saved, strict=True):
            p.data = v
            p.requires_grad_(rg)


def _grads(run, x: torch.Tensor, cot: torch.Tensor, params: list[torch.Tensor], where: str) -> list[torch.Tensor]:
    """Gradients of ⟨run(x), cot⟩ (+ its aux loss) with respect to x and ``params``; an unused one as zeros."""
    xr = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        out, aux = _split(run(xr.clone()), where)  # not the leaf: a router may scale its input in place (DBRX)
        loss = (out.reshape(cot.shape).float() * cot).sum() + (aux.float() if aux is not None else 0.0)
        gs = torch.autograd.grad(loss, [xr, *params], allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(gs, [xr, *params], strict=True)]


def _returns_logits(out: object) -> bool:
    return isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor) and out[1].dim() > 0


def _reference(c: Candidate, x: torch.Tensor, mode: str, call=None):
    """The block's own output on the probe batch (``call(x)``, the block by default), and (components mode)
    the order of its router's tuple, read from what the router returned: indices are the integer tensor,
    logits the float [T, N] one, weights the float [T, K] one."""
    router = getattr(c.block, c.router_attr)
    seen: list[object] = []
    saved = router.__dict__.get("forward")
    if mode == "components":
        own = router.forward
        router.forward = lambda *a, **k: seen.append(own(*a, **k)) or seen[-1]
    try:
        raw = (call or c.block)(x)
        ref, ref_aux = _split(raw, c.path)
    except MoECompileError:
        raise
    except Exception as e:  # noqa: BLE001 - the block's own forward needs more than hidden states
        raise RecognitionError(
            f"{c.path}: the block's own forward fails on a probe batch of hidden states alone "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); a MoE block must compute "
            f"forward(hidden_states) on [batch, sequence, d] hidden states, as a decoder layer calls it (blocks that "
            "also need token ids or other inputs, or take only flattened [tokens, d] rows, are not supported)") from e
    finally:
        router.__dict__.pop("forward", None)
        if saved is not None:
            router.forward = saved
    order = _router_order(c, seen[0]) if seen else ("logits", "weights", "indices")
    return ref, ref_aux, order, raw[1] if mode == "block" and _returns_logits(raw) else None


def _pair(c: Candidate, x2: torch.Tensor, order: tuple[str, str, str] | None = None):
    """(experts(x2, router(x2)), the router's output order): router then experts as a components-mode
    block calls them, for a block whose own forward needs more than hidden states (Gemma 4's decoder
    layer holds the router and experts beside its attention)."""
    try:
        out = getattr(c.block, c.router_attr)(x2)
        order = order or _router_order(c, out)
        got = dict(zip(order, out, strict=True))
        return getattr(c.block, c.experts_attr)(x2, got["indices"], got["weights"]), order
    except MoECompileError:
        raise
    except Exception as e:  # noqa: BLE001
        raise RecognitionError(f"{c.path}: router then experts fail on a probe batch ({type(e).__name__})") from e


def _router_order(c: Candidate, out: object) -> tuple[str, ...]:
    where = f"{c.path}.{c.router_attr}"
    if c.router_extras.get("logits_from_forward") and isinstance(out, tuple) and len(out) > 3:
        out = out[:3]  # a router network's further outputs (state for the next layer) pass through
    if (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
            and sorted(t.is_floating_point() for t in out) == [False, True]):
        return tuple("weights" if t.is_floating_point() else "indices" for t in out)  # no logits (LongCat-Flash)
    if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)):
        kind = type(out).__name__ if not isinstance(out, tuple) else f"a {len(out)}-tuple"
        raise UnsupportedFeatureError(
            f"{where}: the router returns {kind}; a router module must return (logits, weights, indices) or "
            "(weights, indices) in some order (a router returning logits only, with top-k in the block's "
            "forward, is not supported)")
    n = c.experts.num_experts + c.router_extras.get("identity_experts", 0) + c.router_extras.get("null_experts", 0)
    k = c.top_k
    ints = [i for i, t in enumerate(out) if not t.is_floating_point()]
    logits = [i for i, t in enumerate(out) if t.is_floating_point() and t.shape[-1] == n]
    weights = [i for i, t in enumerate(out) if t.is_floating_point() and t.shape[-1] == k]
    if len(ints) != 1:
        raise UnsupportedFeatureError(f"{where}: the router returns {[str(t.dtype) for t in out]}: no single "
                                      "integer tensor of expert indices")
    if n == k or len(logits) != 1 or len(weights) != 1:
        return ("logits", "weights", "indices")  # not distinguishable by shape: the transformers order
    order = {ints[0]: "indices", logits[0]: "logits", weights[0]: "weights"}
    return tuple(order[i] for i in range(3))


def _experts_take_hidden_only(c: Candidate) -> bool:
    """The experts module's own forward takes the hidden states alone (Llama 4 runs every expert on
    pre-weighted rows), or there is none to call (a plain nn.ModuleList, which the block's forward
    indexes expert by expert), so the block cannot call a canonical experts(x, idx, weights): "block" mode."""
    ex = getattr(c.block, c.experts_attr)
    if type(ex).forward is nn.Module.forward:
        return isinstance(ex, nn.ModuleList)
    kinds = [p.kind for p in inspect.signature(ex.forward).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    return kinds in ([inspect.Parameter.POSITIONAL_ONLY], [inspect.Parameter.POSITIONAL_OR_KEYWORD])


def _router_returns_logits_only(c: Candidate, x: torch.Tensor) -> bool:
    try:
        return isinstance(getattr(c.block, c.router_attr)(x), torch.Tensor)
    except Exception:  # noqa: BLE001 - a router needing more than hidden states: the probe reports it
        return False


def _refuse_random(c: Candidate, probe, x: torch.Tensor) -> None:
    """The block's own forward in training mode on one batch: twice under one RNG seed, then under
    another. Outputs that differ only with the seed mean dropout or router noise, which the canonical
    form does not reproduce. (Runs that differ under one seed are not random draws, e.g. a kernel that
    adds in another order each time: not judged here.) Checked in training mode whatever mode the model
    is in now (a model compiled in eval mode is trained later); modes and buffers come back as they were."""
    devices = [x.device.index or 0] if x.device.type == "cuda" else []
    try:
        with kept_state(c.block), torch.random.fork_rng(devices=devices):
            c.block.train()
            outs = []
            for seed in (11, 11, 12):
                torch.manual_seed(seed)
                outs.append(_split(probe(x), c.path)[0])
    except MoECompileError:
        raise
    except Exception:  # noqa: BLE001 - a forward that fails here fails the probe below with its own message
        return
    a, again, b = outs
    if torch.equal(a, again) and not torch.allclose(a, b, rtol=0, atol=0, equal_nan=True):
        raise UnsupportedFeatureError(
            f"{c.path}: the block's forward is random in training mode (two runs on one batch under other seeds "
            f"differ by {(a.float() - b.float()).abs().nan_to_num().max().item():.3g}): dropout or router noise "
            "(jitter) inside the MoE block is not supported; set it to 0 (e.g. the expert dropout or "
            "router_jitter_noise of the config)")


def _with_token_ids(c: Candidate, mode: str, gen: torch.Generator, device: torch.device):
    """For a hash-routed block: the block called on a probe batch with random token ids (those of the rows
    :func:`_probe_router` fills), through the argument its forward takes them in; None for other blocks."""
    table = c.router_extras.get("hash_table_attr")
    if not table:
        return None
    where = f"{c.path}.{c.router_attr}"
    if mode != "components":
        raise UnsupportedFeatureError(f"{where}: a hash router (routing by token id) in a block whose forward the "
                                      "compiler replaces (its router must be called by the block with the token ids)")
    arg = next((p.name for p in inspect.signature(c.block.forward).parameters.values() if "ids" in p.name), None)
    if arg is None:
        raise UnsupportedFeatureError(f"{where}: a hash router (routing by token id) in a block whose forward takes no "
                                      "token ids to pass it")
    vocab = min(_bias(getattr(c.block, c.router_attr), table).shape[0], PROBE_VOCAB)
    ids = torch.randint(0, vocab, (1, PROBE_TOKENS), generator=gen).to(device)
    return lambda inp: c.block(inp, **{arg: ids})


def settle(c: Candidate, cache: dict | None = None) -> MoEBlockSpec:
    """Fix the routing semantics (and which reading of the experts applies) of a candidate by the
    probe, or from attributes alone on meta; the candidate keeps the expert reading that matched.
    ``cache``: one dict across a model's blocks (see :func:`_probe_experts`)."""
    mode = "components" if c.router_kind == "hf" and not _experts_take_hidden_only(c) else "block"
    if c.router_extras.get("shared_scored"):  # its router returns the shared gammas too: the block's forward is ours
        mode = "block"
    outputs = ("logits", "weights", "indices")
    returns_logits = calls_router = False

    def spec_for(v, o: tuple, returns_aux: bool, checked: bool) -> MoEBlockSpec:
        scaling, on_input, sf, rn, fp, bias_on = o
        r = RouterSpec(c.experts.num_experts, c.top_k, sf, rn, scaling, fp, c.bias_attr, c.lb_coef, c.z_coef,
                       *c.groups, weight_attr=c.weight_attr, outputs=outputs, logit_bias_attr=c.logit_bias_attr,
                       weights_on_input=on_input, bias_on=bias_on, call_router=calls_router, **c.router_extras)
        return MoEBlockSpec(
            path=c.path, index=0, mode=mode, router_attr=c.router_attr, experts_attr=c.experts_attr,
            experts=v.experts, shared_attr=c.shared_attr, shared_gate_attr=c.shared_gate_attr,
            shared_hidden=c.shared_hidden, param_views=v.views, router=r, returns_aux=returns_aux,
            returns_logits=returns_logits, checked=checked,
        )

    def options() -> list[tuple]:
        # a scaling attribute on the block may be the block's own multiply in its forward (MiniMax-M3), not
        # the router's; in "block" mode the weights may scale the expert input, not its output (Llama 4).
        # The attribute readings come first: a block they reproduce settles as before these alternatives.
        scalings = (c.scaling, 1.0) if mode == "components" and c.scaling != 1.0 else (c.scaling,)
        on_inputs = (False, True) if mode == "block" else (False,)
        bias_ons = ("scores", "logits") if c.bias_attr else ("scores",)  # where the correction bias is added
        return list(itertools.product(scalings, on_inputs, c.score_funcs, c.renorms, c.fp32_options, bias_ons))

    variants = c.expert_variants()
    w_in, _ = c.full_weights()
    if w_in.is_meta:  # explain: from attributes, and what the block's forward returns on a meta batch
        x = torch.empty(1, PROBE_TOKENS, c.experts.d_model, device="meta", dtype=w_in.dtype)
        if mode == "components" and _router_returns_logits_only(c, x):
            mode, calls_router = "block", True  # (DBRX: logits alone)
        try:  # its router's tuple order, and its router logits beside its output (Llama 4)
            _, _, outputs, second = _reference(c, x, mode)
            returns_logits = second is not None
        except Exception:  # noqa: BLE001 - a forward meta tensors cannot run (data-dependent): the defaults
            pass
        fn = custom_backward(getattr(c.block, c.router_attr), c.experts.d_model)
        if fn is not None:  # what the probe on real weights refuses (PhiMoE): no batch here to try it on
            raise UnsupportedFeatureError(
                f"{c.path}.{c.router_attr}: the router computes its weights through a custom autograd Function "
                f"({fn}) with a backward of its own (e.g. PhiMoE's sparsemixer gradient estimator, sampled in "
                "training); no supported routing reproduces it")
        return spec_for(variants[0], options()[0], c.lb_coef > 0 or c.z_coef > 0, checked=False)
    if w_in.dtype not in EXPERT_DTYPES:  # the canonical form's grouped GEMMs would fail on the probe batch
        raise UnsupportedFeatureError(
            f"{c.path}: expert weights in {w_in.dtype}; the grouped expert GEMMs (torch._grouped_mm) take "
            f"{', '.join(str(d) for d in EXPERT_DTYPES)}: cast the model first (e.g. model.float())")
    block = c.block
    if mode == "block":  # the canonical forward replaces the block's and reads only the hidden states
        extra = [p.name for p in list(inspect.signature(block.forward).parameters.values())[1:]
                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.default is p.empty]
        if extra:  # (optional ones: the canonical forward refuses them when a caller passes one)
            raise UnsupportedFeatureError(
                f"{c.path}: the block's forward takes {extra} besides the hidden states; its compiled form reads "
                "only the hidden states (an MoE block taking a mask or other inputs is not supported)")
    gen = torch.Generator(device="cpu").manual_seed(1234)
    x = torch.randn(1, PROBE_TOKENS, c.experts.d_model, generator=gen).to(w_in.device, w_in.dtype)
    call = _with_token_ids(c, mode, gen, x.device)
    with torch.no_grad(), _probe_router(c, gen), _probe_experts(c, gen, cache):
        if mode == "components" and _router_returns_logits_only(c, x):
            # (DBRX) top-k is in the block's forward: the canonical forward replaces it and calls the router
            mode, calls_router = "block", True
        try:
            ref, ref_aux, outputs, ref_second = _reference(c, x, mode, call)
            returns_logits = ref_second is not None  # the canonical block returns its router logits there
            probe = call or block
        except RecognitionError as own_fails:
            if mode != "components" or call is not None or isinstance(own_fails, UnsupportedFeatureError):
                raise
            try:  # a decoder layer holding router and experts: probe the pair
                (ref, outputs), ref_aux, returns_logits, ref_second = _pair(c, x[0]), None, False, None
            except RecognitionError:
                raise own_fails from None
            probe = lambda inp: _pair(c, inp[0], outputs)[0]  # noqa: E731
        _refuse_random(c, probe, x)
        if ref_aux is None and (c.lb_coef or c.z_coef):
            raise RecognitionError(
                f"{c.path}: has auxiliary-loss coefficients (lb={c.lb_coef}, z={c.z_coef}) but its forward returns no "
                "aux loss; return (output, aux_loss) so the compiled block can reproduce it"
            )
        errors = []
        second_differs = None  # the output matched but the block's second output is not its router logits
        grad_differs = None  # the output matched but not the gradients
        aux_differs = None  # the output matched but not the auxiliary loss
        router = getattr(block, c.router_attr)
        params = [t for t in (_bias(router, c.weight_attr), _bias(router, c.logit_bias_attr)) if t is not None and t.requires_grad]
        cot = torch.randn(ref.shape, generator=gen).to(ref.device)
        ref_grads = _grads(probe, x, cot, params, c.path)  # the block's own backward
        # a router gradient that is zero in exact arithmetic (top-1 renormalised: every weight 1) is rounding
        # noise in both: measured against the size a gradient through the logits would have
        floor = 1e-3 * x[0].shape[0] * x.abs().max().item() * cot.abs().max().item() * ref.abs().max().item()
        for v, o in itertools.product(variants, options()):
            spec = spec_for(v, o, ref_aux is not None, checked=True)
            w_in, w_out = v.full_weights()
            token = install(block, spec, w_in, w_out, 0, v.full_biases() if v.full_biases else None)
            try:
                raw = probe(x)
                out, aux = _split(raw, c.path)
            except MoECompileError:
                raise
            except Exception as e:  # the canonical form met an interface it does not model
                raise RecognitionError(
                    f"{c.path}: recognised as an MoE block ({spec.describe()}), but its canonical form fails on a "
                    f"probe batch ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); its router "
                    f"({type(getattr(block, c.router_attr)).__name__}) or experts use an interface the compiler does "
                    "not model (a router must return (logits, weights, indices) or be a Linear)") from e
            finally:
                uninstall(block, spec, token)
            ok, err = _close(out, ref)
            if ok and ref_aux is not None:
                ok, aerr = _close(aux, ref_aux)
                err = max(err, aerr)
                if not ok:
                    aux_differs = aerr if aux_differs is None else min(aux_differs, aerr)
            if ok and ref_second is not None:
                ok, serr = _close(raw[1], ref_second)
                if not ok:
                    second_differs = serr
            if ok:  # the same output; its gradients too? (mixture weights detached in the block: not)
                token = install(block, spec, w_in, w_out, 0, v.full_biases() if v.full_biases else None)
                try:
                    grads = _grads(probe, x, cot, params, c.path)
                finally:
                    uninstall(block, spec, token)
                low = x.dtype != torch.float32
                checks = [_close(a, b, floor if i else 0.0, low)
                          for i, (a, b) in enumerate(zip(grads, ref_grads, strict=True))]
                ok, gerr = all(m for m, _ in checks), max(e for _, e in checks)
                if not ok:
                    grad_differs = gerr if grad_differs is None else min(grad_differs, gerr)
            if ok:
                c.use(v)
                return spec
            errors.append((err, spec))
    if second_differs is not None:
        raise UnsupportedFeatureError(
            f"{c.path}: forward returns (output, {tuple(ref_second.shape)} tensor) and the output is reproduced, but "
            f"the second tensor is not the router's logits (relative error {second_differs:.2e}); a MoE block may "
            "return its output, (output, aux-loss scalar) or (output, router logits)")
    fn = custom_backward(getattr(block, c.router_attr), c.experts.d_model)
    if grad_differs is not None:
        raise UnsupportedFeatureError(
            f"{c.path}: the compiled form reproduces the block's output on a probe batch but not its gradients "
            f"(closest: relative error {grad_differs:.2e}); the block's backward is not that of its forward (mixture "
            "weights or the router's input detached, a straight-through estimator"
            + (f", the custom autograd Function {fn} in its router" if fn else "") + "): not supported")
    err, best = min(errors, key=lambda e: e[0])
    if aux_differs is not None:
        raise UnsupportedFeatureError(
            f"{c.path}: the compiled form reproduces the block's output on a probe batch but not its auxiliary loss "
            f"(closest: relative error {aux_differs:.2e}; read: lb={c.lb_coef}, z={c.z_coef}); the block computes "
            "its load-balancing / z loss with coefficients or a formula the compiler does not read (it reads the "
            f"block's attributes {' / '.join(LB_ATTRS)} and {' / '.join(Z_ATTRS)}): not supported")
    if fn is not None:  # name the feature the probe could not reproduce
        raise UnsupportedFeatureError(
            f"{c.path}.{c.router_attr}: the router computes its weights through a custom autograd Function ({fn}) "
            "with a backward of its own (e.g. PhiMoE's sparsemixer gradient estimator, sampled in training); "
            f"no supported routing reproduces it (probe: closest relative error {err:.2e})")
    raise RecognitionError(
        f"{c.path}: recognised as an MoE block ({best.describe()}), but no supported routing reproduces its "
        f"output on a probe batch (closest: relative error {err:.2e}); the block computes something the compiler "
        "does not understand"
    )
