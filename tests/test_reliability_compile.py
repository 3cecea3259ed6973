"""Reliability: a CompiledMoE next to the user's own torch.compile of another instance of its model
class in one process (a reference or an eval copy), in either order. Both keep working, and the
CompiledMoE still equals the dense model (fp32, relative 1e-5).

Dynamo keeps its cache entries, recompile counts and frame decisions (skip, run-only) on code objects,
and a model's forward code is shared by every instance of its class; the CompiledMoE must not depend
on what the other compile leaves there, nor change the dynamo settings that compile runs under."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo.config as dc
from torch._C._dynamo.eval_frame import reset_code
from torch._dynamo.eval_frame import skip_code

from moe_compile import moe_compile
from moe_compile.models import tiny_hf_model

from .common import VOCAB, dense_reference, grads_of, make_batches, rel_err

TOL = 1e-5
DYNAMO_SETTINGS = ("recompile_limit", "accumulated_recompile_limit", "fail_on_recompile_limit_hit")


def _model() -> torch.nn.Module:
    return tiny_hf_model("olmoe", seed=0, vocab=VOCAB, d=32, hidden=64)


def _shared_codes() -> list:
    """The code objects of OLMoE's forwards and of transformers' forward decorators around them: shared
    by every instance of the classes (the decorators' by every transformers model)."""
    from transformers import OlmoeForCausalLM, OlmoeModel

    codes = []
    for fn in (OlmoeForCausalLM.forward, OlmoeModel.forward):
        while fn is not None:
            codes.append(fn.__code__)
            fn = getattr(fn, "__wrapped__", None)
    return codes


@pytest.fixture
def shared_codes():
    """What a test's compiles leave on the shared code objects is dropped afterwards (the rest of the
    process must not inherit a run-only or skipped forward)."""
    yield _shared_codes()
    for code in _shared_codes():
        reset_code(code)


def _probes() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (1, s), generator=g) for s in (5, 6, 7)]


def _eval_matches_eager(compiled, module: torch.nn.Module, probes: list[torch.Tensor]) -> None:
    module.eval()
    with torch.no_grad():
        for x in probes:
            got, want = compiled(input_ids=x).logits, module(input_ids=x).logits
            assert rel_err(got, want) <= TOL
    module.train()


def _train_step_matches(compiled, module: torch.nn.Module, ids: torch.Tensor, ref) -> None:
    """One forward+backward of the user's compiled copy equals the dense reference."""
    ref_loss, ref_grads = ref
    module.zero_grad(set_to_none=True)
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    assert abs(loss.item() - ref_loss[0]) <= TOL * abs(ref_loss[0])
    grads = grads_of(module)
    assert max(rel_err(grads[n], g) for n, g in ref_grads.items()) <= TOL


def _cm_step_matches(cm, ids: torch.Tensor, ref) -> None:
    ref_loss, ref_grads = ref
    cm.zero_grad(set_to_none=True)
    loss = cm(input_ids=ids, labels=ids).loss
    loss.backward()
    assert abs(loss.item() - ref_loss[0]) <= TOL * abs(ref_loss[0])
    grads = cm.full_grads()
    bad = {n: rel_err(grads[n], g) for n, g in ref_grads.items() if rel_err(grads[n], g) > TOL}
    assert not bad, f"gradients differ from the dense model: {bad}"


def test_other_compile_first_exhausting_its_recompile_limit(shared_codes):
    # The user's compiled eval copy recompiles past the limit they set: dynamo stops compiling the
    # class's forward code (run-only). A CompiledMoE built afterwards still compiles, and both keep
    # working alternately.
    model = _model()
    ids = make_batches(1)[0]
    ref = dense_reference(model, [ids])
    other = copy.deepcopy(model)
    with dc.patch(recompile_limit=2):
        c_other = torch.compile(other, backend="aot_eager", dynamic=False)
        _train_step_matches(c_other, other, ids, ref)
        _eval_matches_eager(c_other, other, _probes())  # the second probe shape is one too many
        cm = moe_compile(model)
        _cm_step_matches(cm, ids, ref)
        assert cm.program.compiles == 1
        _train_step_matches(c_other, other, ids, ref)
        _eval_matches_eager(c_other, other, _probes())
        _cm_step_matches(cm, ids, ref)
    assert cm.program.compiles == 1


def test_moe_compile_first_leaves_the_other_compile_alone(shared_codes):
    # moe_compile changes no process-wide dynamo setting: the user's own compile of another instance
    # still falls back to eager past its recompile limit (no hard FailOnRecompileLimitHit); the
    # CompiledMoE recompiles for a new shape under its own limit, whatever the user set.
    model = _model()
    ids, ids2 = make_batches(1)[0], make_batches(1, seq=24, seed=1)[0]
    ref, ref2 = dense_reference(model, [ids]), dense_reference(model, [ids2])
    other = copy.deepcopy(model)
    before = {k: getattr(dc, k) for k in DYNAMO_SETTINGS}
    cm = moe_compile(model)
    _cm_step_matches(cm, ids, ref)
    c_other = torch.compile(other, backend="aot_eager", dynamic=False)
    _train_step_matches(c_other, other, ids, ref)
    _cm_step_matches(cm, ids, ref)
    with dc.patch(recompile_limit=2):
        _eval_matches_eager(c_other, other, _probes())
        _cm_step_matches(cm, ids2, ref2)
    _train_step_matches(c_other, other, ids, ref)
    _cm_step_matches(cm, ids, ref)
    assert cm.program.compiles == 2  # one per input shape
    assert {k: getattr(dc, k) for k in DYNAMO_SETTINGS} == before


def test_forward_frames_another_compile_gave_up_on(shared_codes):
    # A compile of another instance that breaks its graph where dynamo cannot resume (a loop, a
    # try/finally: transformers' output capturing, the decoder-layer loop) leaves those forward codes
    # skipped for the whole process. Simulated here on every shared forward code: the CompiledMoE is
    # still captured whole (not from frames below transformers' output capturing) and equals the model.
    model = _model()
    ids = make_batches(1)[0]
    ref = dense_reference(model, [ids])
    for code in shared_codes:
        skip_code(code)
    cm = moe_compile(model)
    _cm_step_matches(cm, ids, ref)
    assert cm.program.compiles == 1
