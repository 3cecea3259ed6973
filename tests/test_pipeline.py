"""Pipeline parallelism: compiled stages under torch.distributed.pipelining schedules vs the dense model.

Reference: a plain copy of the dense model runs every data-parallel replica's batch as m microbatches
and back-propagates the mean over replicas of the microbatches' mean loss (all labels valid, so every
microbatch weighs 1/m). Loss and every gradient agree to 1e-5 of each tensor's scale; forward-only
evaluation returns the dense model's whole-batch logits and loss on every rank.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from moe_compile import MeshSpec, moe_compile
from moe_compile.errors import IRError, MeshError, OptionError, RuntimeFault
from moe_compile.passes.split_stages import outside_phases, plan_split

from .common import build_model, cli_train, core_and_rest, grads_of, make_batches, metric_rows, rel_err
from .harness import run_ranks

TOL = 1e-5


def dense_reference(model, replicas: list[torch.Tensor], m: int):
    ref = copy.deepcopy(model)
    losses = [sum(ref(input_ids=x, labels=x).loss for x in b.chunk(m)) / m for b in replicas]
    torch.stack(losses).mean().backward()
    return [x.item() for x in losses], grads_of(ref)


def _model(name: str, layers: int, **kw):
    if name.startswith("family:"):  # a transformers family's tiny config (moe-compile families' models)
        from moe_compile.models.hf import tiny_family_model

        return tiny_family_model(name[len("family:"):], seed=0)
    if name == "llama4_tuned":  # two layers as it is
        return build_model(name, **kw)
    return build_model(name, **({"n_layers": layers} if name.startswith("tiny") else {"layers": layers}), **kw)


def pipeline_worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    out = []
    for case in cases:
        spec = MeshSpec.parse(case["mesh"]).resolve(world)
        model = _model(case["model"], case.get("layers", 2), **case.get("model_kw", {}))
        m = case["m"]
        batches = make_batches(spec.dp, 4, 16, seed=3)
        ref_losses, ref_grads = dense_reference(model, batches, m)
        with torch.no_grad():
            dense_eval = copy.deepcopy(model)
            ref_eval = {}
            for j, b in enumerate(batches):
                o = dense_eval(input_ids=b, labels=b)
                ref_eval[j] = (o.logits, o.loss)
        cm = moe_compile(model, spec, microbatches=m, schedule=case["schedule"], **case.get("options", {}))
        dp_rank = spec.dense_coords(rank)[1]
        b = batches[dp_rank]
        loss = cm.train_step(input_ids=b, labels=b)
        held = weight_storage(cm)
        grads = cm.full_grads()
        worst = max(grads, key=lambda n: rel_err(grads[n], ref_grads[n]))
        plan = cm.lease_plan()
        with torch.no_grad():
            ev = cm(input_ids=b, labels=b)
        out.append({
            "case": case, "loss": loss.item(), "ref_loss": ref_losses[dp_rank],
            "grad_err": rel_err(grads[worst], ref_grads[worst]), "worst": worst,
            "names": set(grads) == set(ref_grads),
            "eval_logits_err": rel_err(ev.logits, ref_eval[dp_rank][0]),
            "eval_loss": (ev.loss.item(), ref_eval[dp_rank][1].item()),
            "in_flight": dict(plan.in_flight) if plan is not None else None,
            "stage": spec.dense_coords(rank)[0], "held": held, "after_eval": weight_storage(cm),
        })
        cm.close()
    return out


def weight_storage(cm) -> dict[str, int]:
    """Bytes of parameter storage this rank holds for its own stages' parameters and for the others'
    (each distinct storage counted once), and the own parameters' logical bytes."""
    own, other, seen = 0, 0, set()
    logical = 0
    for n, p in cm.model.named_parameters():
        key = p.untyped_storage().data_ptr()
        if cm.owns(n):
            logical += p.numel() * p.element_size()
        if key in seen:
            continue
        seen.add(key)
        if cm.owns(n):
            own += p.untyped_storage().nbytes()
        else:
            other += p.untyped_storage().nbytes()
    foreign = sum(1 for n, _ in cm.model.named_parameters() if not cm.owns(n))
    return {"own": own, "other": other, "logical": logical, "foreign_params": foreign}


def check(results: list[list[dict]], in_flight: dict[str, dict] | None = None, tol: float = TOL) -> None:
    for rank, per in enumerate(results):
        for r in per:
            tag = (rank, r["case"], r["worst"])
            for held in (r["held"], r["after_eval"]):  # the other stages' weights hold one element each
                assert held["foreign_params"] > 0 and held["other"] <= 8 * held["foreign_params"], (tag, held)
                assert held["own"] == held["logical"], (tag, held)
            assert abs(r["loss"] - r["ref_loss"]) <= tol * max(1.0, abs(r["ref_loss"])), (tag, r)
            assert r["names"], tag
            assert r["grad_err"] <= tol, (tag, r["grad_err"])
            assert r["eval_logits_err"] <= tol, (tag, r["eval_logits_err"])
            a, b = r["eval_loss"]
            assert abs(a - b) <= tol * max(1.0, abs(b)), (tag, a, b)
            want = (in_flight or {}).get(r["case"]["schedule"])
            if want is not None:  # this rank's stages, hand-computed for the schedule
                assert r["in_flight"] == {s: h for s, h in want.items() if s % 2 == r["stage"]}, (tag, r["in_flight"])


# H_s for pp=2: GPipe runs all m forwards first; 1F1B keeps pp − s; interleaved (v=2, m=4) by hand
# from its warm-up (stage s of 4 has 4 − s forwards before its first backward)
IN_FLIGHT = {"gpipe": {0: 2, 1: 2}, "1f1b": {0: 2, 1: 1}, "interleaved_1f1b": {0: 4, 1: 3, 2: 2, 3: 1}}


EP_SCHEDULE_CASES = {
    "core": [{"model": "tiny", "mesh": "pp=2,ep_mp=2", "schedule": "1f1b", "m": 4},
             {"model": "tiny", "mesh": "pp=2,ep_mp=2", "schedule": "interleaved_1f1b", "m": 4, "layers": 4}],
    "rest": [{"model": "tiny", "mesh": "pp=2,ep_mp=2", "schedule": "gpipe", "m": 2},
             {"model": "olmoe_aux", "mesh": "pp=2,ep_mp=2", "schedule": "1f1b", "m": 4},
             {"model": "tiny", "mesh": "pp=2,ep_mp=2", "schedule": "1f1b", "m": 2, "layers": 3,
              "model_kw": {"dense_layers": (0,)}, "options": {"pp_split": ["layers.1"]}}],
}


@pytest.mark.parametrize("part", core_and_rest("core", "rest"))
@pytest.mark.long
def test_pipeline_ep_schedules_four_ranks(part):
    """pp=2 × ep_mp=2: GPipe, 1F1B, Interleaved1F1B on the tiny LM, 1F1B on OLMoE (with its load-balancing
    loss: the router logits of stage 0 travel to the last stage across the boundary), and a first stage
    that holds only a dense layer."""
    check(run_ranks(pipeline_worker, 4, EP_SCHEDULE_CASES[part]), IN_FLIGHT)


@pytest.mark.slow
def test_pipeline_keeps_nodes_captured_for_their_effect():
    """Jamba's Mamba mixer runs associative_scan through torch.func.vmap on CPU: the captured graph opens
    a vmap level and closes it with a node nothing reads. The stage split dropped that node (no stage
    needed its value), the level stayed open, and stage 0's compiled function hit a functorch INTERNAL
    ASSERT while the stages compiled; now the stages match the dense model."""
    check(run_ranks(pipeline_worker, 2, [{"model": "family:jamba", "mesh": "pp=2", "schedule": "1f1b", "m": 2}]))


@pytest.mark.slow
def test_pipeline_metadata_inference_runs_on_zeros():
    """torch's PipelineStage infers the boundary metadata by running every stage once on activations it
    materialises from metadata with torch.empty: hy_v4's second stage computes scatter indices from them
    and failed out of bounds ('index -8388609 is out of bounds for dimension 2') on the first step.
    Those activations are zeros now, and the pipeline matches the dense model (its hyper-connection
    weights' gradients to 2e-5: fp32 summation order across the two stages)."""
    check(run_ranks(pipeline_worker, 2, [{"model": "family:hy_v4", "mesh": "pp=2", "schedule": "1f1b", "m": 2}]),
          tol=2e-5)


@pytest.mark.slow
def test_pipeline_dense_stages_two_ranks():
    """pp=2 without expert parallelism (each stage's experts whole), GPipe and 1F1B, OLMoE too."""
    cases = [
        {"model": "tiny", "mesh": "pp=2", "schedule": "1f1b", "m": 2},
        {"model": "olmoe", "mesh": "pp=2", "schedule": "gpipe", "m": 2},
        {"model": "tiny_stacked_sigmoid_shared", "mesh": "pp=2", "schedule": "interleaved_1f1b", "m": 2, "layers": 4},
    ]
    check(run_ranks(pipeline_worker, 2, cases))


@pytest.mark.slow
def test_pipeline_eight_ranks():
    """pp=2, ep_dp=2, ep_mp=2: two data-parallel replicas per stage, experts reduced over ep_dp."""
    cases = [{"model": "tiny", "mesh": "pp=2,ep_dp=2,ep_mp=2", "schedule": "1f1b", "m": 2}]
    check(run_ranks(pipeline_worker, 8, cases), IN_FLIGHT)


def mxfp8_worker(rank: int, world: int) -> dict:
    """MXFP8 experts on pp=2 × ep_mp=2 vs the same options on ep_mp=2 alone (checked against torchao
    elsewhere): the schedule must not change a bit of the quantised program's gradient."""
    import torch.distributed as dist

    model = _model("tiny", 2)
    b = make_batches(1, 4, 32, seed=5)[0]
    out = {}
    for mesh in ("pp=2,ep_mp=2", "ep_mp=2,dp=4"):
        cm = moe_compile(copy.deepcopy(model), MeshSpec.parse(mesh).resolve(world), microbatches=2, mxfp8="experts")
        loss = cm.train_step(input_ids=b, labels=b)
        out[mesh] = (loss.item(), cm.full_grads())
        cm.close()
        dist.barrier()
    (la, ga), (lb, gb) = out.values()
    return {"loss": (la, lb), "err": max(rel_err(ga[n], gb[n]) for n in gb)}


@pytest.mark.slow
def test_pipeline_mxfp8():
    for r in run_ranks(mxfp8_worker, 4):
        assert abs(r["loss"][0] - r["loss"][1]) <= 1e-6 * abs(r["loss"][1]), r
        assert r["err"] <= 1e-5, r


def lease_guard_worker(rank: int, world: int, mode: str) -> str:
    """A plan one instance too small for 1F1B's stage 0 (the reference system's bug): rejected at
    compile time; with the verifier bypassed, the runtime guard stops stage 0's second forward in
    flight (run directly, as the schedule's warm-up would, so no peer is left waiting)."""
    from moe_compile import schedules

    model = _model("tiny", 2)
    cm = moe_compile(model, MeshSpec.parse("pp=2,ep_mp=2").resolve(world), microbatches=4, schedule="1f1b")
    pipe = cm.pipeline
    pipe.schedule = dataclasses.replace(pipe.schedule, in_flight={0: 1, 1: 1})
    verify = schedules.verify_schedule
    if mode == "runtime":
        schedules.verify_schedule = lambda *a, **k: None
    b = make_batches(1, 4, 16)[0]
    try:
        if mode == "compile":
            cm.train_step(input_ids=b, labels=b)
        else:
            mb = {"input_ids": b[:1], "labels": b[:1]}
            pipe._build(mb)
            if pipe.pp_rank == 0:
                first = pipe.stages[0].module(**mb)  # kept alive: its backward has not run
                second = pipe.stages[0].module(**mb)
                return f"no error ({first.shape}, {second.shape})"
    except (IRError, RuntimeFault, RuntimeError) as e:
        msg = f"{type(e).__name__}: {e}"
        cause = e.__cause__
        while cause is not None:
            msg += f" <- {type(cause).__name__}: {cause}"
            cause = cause.__cause__
        return msg
    finally:
        schedules.verify_schedule = verify
    return "no error"


def test_lease_plan_one_instance_short_is_a_compile_time_error():
    msgs = run_ranks(lease_guard_worker, 4, "compile")
    for rank, msg in enumerate(msgs):
        if rank < 2:  # stage 0: its own error, naming schedule, stage, payload and step
            assert "lease plan rejected for schedule 1f1b" in msg and "stage 0" in msg, msg
            assert "dispatch.recv" in msg and "at step" in msg, msg
        else:  # stage 1 learns it before the schedule starts (no rank is left blocked)
            assert "no rank started the schedule" in msg, msg


@pytest.mark.slow
def test_lease_reuse_under_the_schedule_is_caught_at_run_time():
    msgs = run_ranks(lease_guard_worker, 4, "runtime")
    for m in msgs[:2]:  # stage 0's ranks
        assert "2 forwards in flight, but the lease plan provisions 1" in m, msgs


# -- the split and its errors (no ranks) --------------------------------------------------------------


def _blocks(model):
    from moe_compile.frontend import recognize

    return [s for s, _ in recognize(model)]


def test_default_split_balances_cost_not_layer_count():
    """Three MoE layers and a dense one: the LM head (vocab × d) counts on the last stage, so the
    balanced cut leaves the last stage fewer layers than a count split would."""
    model = build_model("tiny", n_layers=4, vocab_size=4096)
    split = plan_split(model, _blocks(model), 2)
    assert split.layer_stage == (0, 0, 0, 1), split
    assert split.owner["embed.weight"] == 0 and split.owner["lm_head.weight"] == 1
    assert plan_split(model, _blocks(model), 2, ["layers.2"]).layer_stage == (0, 0, 1, 1)


def test_split_errors_name_the_rule():
    model = build_model("tiny", n_layers=2)
    with pytest.raises(MeshError, match="2 decoder layers, too few to cut into 3"):
        plan_split(model, _blocks(model), 3)
    with pytest.raises(MeshError, match="pp_split entry 'layers.9'"):
        plan_split(model, _blocks(model), 2, ["layers.9"])
    tied = build_model("olmoe", tie_word_embeddings=True)  # refused before; held by both stages now
    assert plan_split(tied, _blocks(tied), 2).tied == {"model.embed_tokens.weight": (0, 1), "lm_head.weight": (0, 1)}


def bad_input_worker(rank: int, world: int) -> list[str]:
    msgs = []
    spec = MeshSpec.parse("pp=2").resolve(world)
    for kw in ({"schedule": "zbv"}, {"schedule": "1f1b", "microbatches": 1}):
        try:
            moe_compile(_model("tiny", 2), spec, **kw)
        except OptionError as e:
            msgs.append(str(e))
    model = _model("tiny", 2)
    ref_loss, ref_grads = masked_microbatch_reference(model)
    cm = moe_compile(model, spec, microbatches=2)
    b = make_batches(1, 3, 16)[0]
    b4 = make_batches(1, 4, 16)[0]
    for call in (lambda: cm.train_step(input_ids=b, labels=b), lambda: cm(input_ids=b, labels=b),
                 lambda: cm.train_step(input_ids=b4)):
        try:
            call()
        except OptionError as e:
            msgs.append(str(e))
    return msgs, masked_microbatch_errors(cm, ref_loss, ref_grads)


def masked_microbatch_reference(model):
    """A batch of 4 as 2 microbatches, the second with no loss tokens (labels all -100): the step is the
    first microbatch's (weight 1; the second weighs 0), so its dense loss and gradients are the reference."""
    ref = copy.deepcopy(model)
    x = make_batches(1, 4, 16, seed=5)[0]
    loss = ref(input_ids=x[:2], labels=x[:2]).loss
    loss.backward()
    return loss.item(), grads_of(ref)


def masked_microbatch_errors(cm, ref_loss: float, ref_grads: dict) -> tuple[float, float]:
    x = make_batches(1, 4, 16, seed=5)[0]
    labels = x.clone()
    labels[2:] = -100
    loss = cm.train_step(input_ids=x, labels=labels, **({} if cm.pipeline is not None else {"microbatches": 2}))
    grads = cm.full_grads()
    return abs(loss.item() - ref_loss) / abs(ref_loss), max(rel_err(grads[n], ref_grads[n]) for n in ref_grads)


def test_pipeline_bad_input_is_a_clear_error():
    for msgs, (loss_err, grad_err) in run_ranks(bad_input_worker, 2):
        assert len(msgs) == 5, msgs
        assert "ScheduleZBVZeroBubble" in msgs[0]
        assert "needs microbatches ≥ pp" in msgs[1]
        assert "3 sequences does not split into microbatches=2" in msgs[2]
        assert "torch.no_grad()" in msgs[3]
        assert "a pipelined train_step needs labels=" in msgs[4]
        # a microbatch without loss tokens: a finite loss (was NaN: its 0/0 loss times weight 0)
        assert loss_err <= TOL and grad_err <= TOL, (loss_err, grad_err)


# -- faults: a failed step leaves nothing behind, and no stage waits on a rank that raised ------------


def failed_build_worker(rank: int, world: int) -> list[dict]:
    """The first train_step fails in the stage warm-up on rank 0 (an injected fault); the next one, with
    another batch size, builds afresh and equals the dense model."""
    from moe_compile.runtime import pipeline_runtime

    out = []
    for schedule, layers in (("1f1b", 2), ("interleaved_1f1b", 4)):
        model = _model("tiny", layers)
        b4, b8 = make_batches(1, 4, 16, seed=1)[0], make_batches(1, 8, 16, seed=3)[0]
        ref_losses, ref_grads = dense_reference(model, [b8], 2)
        cm = moe_compile(model, MeshSpec.parse("pp=2").resolve(world), microbatches=2, schedule=schedule)
        forward = pipeline_runtime.StageModule.forward

        def fail(self, *a, **kw):
            raise RuntimeError("injected warm-up fault")

        if rank == 0:
            pipeline_runtime.StageModule.forward = fail
        try:
            cm.train_step(input_ids=b4, labels=b4)
            first = "no error"
        except (RuntimeError, RuntimeFault) as e:
            first = str(e)
        finally:
            pipeline_runtime.StageModule.forward = forward
        loss = cm.train_step(input_ids=b8, labels=b8)
        grads = cm.full_grads()
        out.append({"schedule": schedule, "first": first, "loss_err": abs(loss.item() - ref_losses[0]),
                    "grad_err": max(rel_err(grads[n], ref_grads[n]) for n in ref_grads)})
        cm.close()
    return out


@pytest.mark.slow
def test_a_failed_first_step_leaves_no_stage_behind():
    for rank, per in enumerate(run_ranks(failed_build_worker, 2, timeout=240)):
        for r in per:
            assert ("injected warm-up fault" if rank == 0 else "no rank started the schedule") in r["first"], r
            # was a shape error (1f1b) / KeyError: 4 (interleaved): the failed build's stages were kept
            assert r["loss_err"] <= TOL * 6 and r["grad_err"] <= TOL, (rank, r)


def token_range_worker(rank: int, world: int) -> dict:
    """pp=2: a good step, then batches with a token id or a label beyond the vocabulary: every rank
    raises before the schedule (stage 1 used to wait forever in a receive), and a later step is right."""
    model = _model("tiny", 2)
    good, later = make_batches(1, 4, 16, seed=3)[0], make_batches(1, 4, 16, seed=4)[0]
    ref_losses, ref_grads = dense_reference(model, [later], 2)
    cm = moe_compile(model, MeshSpec.parse("pp=2").resolve(world), microbatches=2)
    cm.train_step(input_ids=good, labels=good)
    bad_ids = good.clone()
    bad_ids[3, 5] = 10_000
    bad_labels = good.clone()
    bad_labels[:, 2] = -100  # the ignore index is fine ...
    if rank == 1:
        bad_labels[1, 7] = 256  # ... one past the vocabulary is not (rank 1's copy only: the verdict is shared)
    # refusals of rank 1's batch alone (rank 0 passes the good one): no labels, a batch that does not
    # split into the microbatches, another shape than the first step's — rank 0 used to wait in a receive
    own = [dict(input_ids=good), dict(input_ids=good[:3], labels=good[:3]),
           dict(input_ids=good[:, :8], labels=good[:, :8])]
    batches = [dict(input_ids=bad_ids, labels=good), dict(input_ids=good, labels=bad_labels)]
    batches += [b if rank == 1 else dict(input_ids=good, labels=good) for b in own]
    msgs = []
    for kw in batches:
        try:
            cm.train_step(**kw)
            msgs.append("no error")
        except OptionError as e:
            msgs.append(str(e))
    if cm.ddp is not None:
        cm.ddp.zero_grad()
    for p in cm.model.parameters():
        p.grad = None
    loss = cm.train_step(input_ids=later, labels=later)
    grads = cm.full_grads()
    cm.close()
    return {"msgs": msgs, "loss_err": abs(loss.item() - ref_losses[0]),
            "grad_err": max(rel_err(grads[n], ref_grads[n]) for n in ref_grads)}


@pytest.mark.slow
def test_out_of_vocabulary_batch_stops_every_stage():
    for rank, r in enumerate(run_ranks(token_range_worker, 2, timeout=120)):
        ids, labels, *own = r["msgs"]
        assert "input_ids hold token id 10000, outside the model's vocabulary [0, 256)" in ids, r
        if rank == 1:
            assert "labels hold 256, outside the model's vocabulary [0, 256)" in labels, r
        else:
            assert "rank 1's labels fall outside the model's vocabulary" in labels, r
        want = ["needs labels=", "does not split into microbatches=2", "differ from the first step's"]
        for msg, w in zip(own, want, strict=True):
            assert (w if rank == 1 else "rank 1 refused its batch") in msg and "no rank started" in msg, (msg, r)
        assert r["loss_err"] <= TOL * 6 and r["grad_err"] <= TOL, (rank, r)


def mixed_eval_batches_worker(rank: int, world: int) -> list:
    """pp=2, forward-only evaluation: rank 1 (the last stage) passes another batch than rank 0."""
    cm = moe_compile(_model("tiny", 2), MeshSpec.parse("pp=2").resolve(world), microbatches=2)
    batches = make_batches(2, 2, 16, seed=4)
    out = []
    with torch.no_grad():
        try:
            cm(input_ids=batches[rank], labels=batches[rank])
        except OptionError as e:
            out.append(str(e))
        out.append(cm(input_ids=batches[0], labels=batches[0]).loss.item())  # the next call runs
    cm.close()
    return out


def test_pipeline_evaluation_refuses_different_batches_in_a_pipeline():
    """cm(...) at pp > 1 (forward-only evaluation) ran stage 0 on rank 0's ids and the last stage's loss on
    rank 1's labels, and returned that mix without an error (train_step compared batches, evaluation did not)."""
    results = run_ranks(mixed_eval_batches_worker, 2, timeout=300)
    for r in results:
        assert "the ranks of this pipeline group passed different batches" in r[0], r
    assert results[0][1] == results[1][1] and math.isfinite(results[0][1])


def dropless_warmup_worker(rank: int, world: int) -> dict:
    """pp=2 × ep_mp=2, dropless: the rows each EP rank received, per stage, over two steps."""
    from moe_compile.runtime.dropless import find_dropless_state

    spec = MeshSpec.parse("pp=2,ep_mp=2").resolve(world)
    cm = moe_compile(_model("tiny", 2), spec, microbatches=2)
    b = make_batches(spec.dp, 4, 16, seed=3)[spec.dense_coords(rank)[1]]
    for _ in range(2):
        cm.train_step(input_ids=b, labels=b)
    st = find_dropless_state(cm.program.ctx_id)
    out = {"stage": spec.dense_coords(rank)[0], "high_water": st.high_water, "growths": len(st.growths),
           "factor": st.factor, "headroom": st.headroom}
    cm.close()
    return out


def dense_rows_received(model, batches: list[torch.Tensor], m: int, ep: int) -> dict[int, int]:
    """Layer → the most routed rows one EP rank receives in any microbatch: the dense model's top-k
    choices, the EP group's ranks holding batches[0..ep) and experts in contiguous blocks of E/ep."""
    import types

    picks: dict[int, list] = {}
    for i, layer in enumerate(model.layers):
        block = layer.mlp

        def mix(self, x, idx, weights, _orig=block.expert_mix, _i=i):
            picks.setdefault(_i, []).append(idx.clone())
            return _orig(x, idx, weights)

        block.expert_mix = types.MethodType(mix, block)
    with torch.no_grad():
        for j in range(m):
            for b in batches[:ep]:
                model(input_ids=b.chunk(m)[j])
    per = model.layers[0].mlp.num_experts // ep
    return {i: max(int(torch.cat(idx[j * ep:(j + 1) * ep]).reshape(-1).div(per, rounding_mode="floor")
                       .bincount(minlength=ep).max()) for j in range(m)) for i, idx in picks.items()}


@pytest.mark.slow
def test_pipeline_warmup_does_not_grow_the_dropless_capacity():
    model = _model("tiny", 2)
    want = dense_rows_received(copy.deepcopy(model), make_batches(2, 4, 16, seed=3), 2, 2)
    for r in run_ranks(dropless_warmup_worker, 4, timeout=240):
        # stage s holds layer s; zero activations (the warm-up) and torch's metadata inference send
        # 128 and 112 of the 128 rows to one rank: counted, they grew the factor 3/2 → 2 on stage 1
        assert r["high_water"] == want[r["stage"]], (r, want)
        assert r["growths"] == 0 and r["factor"] == r["headroom"], r


def test_train_step_at_pp1_is_gradient_accumulation():
    """One rank: train_step over m=4 microbatches equals the dense mean of the microbatch losses."""
    model = _model("tiny", 2)
    b = make_batches(1, 4, 16, seed=9)[0]
    ref_losses, ref_grads = dense_reference(model, [b], 4)
    cm = moe_compile(model, None, microbatches=4)
    loss = cm.train_step(input_ids=b, labels=b)
    grads = cm.full_grads()
    assert abs(loss.item() - ref_losses[0]) <= TOL * abs(ref_losses[0])
    assert max(rel_err(grads[n], ref_grads[n]) for n in ref_grads) <= TOL
    model = _model("tiny", 2)
    ref = masked_microbatch_reference(model)
    cm = moe_compile(model, None)
    assert max(masked_microbatch_errors(cm, *ref)) <= TOL


# -- training and checkpoints across a changed pp -------------------------------------------------


@pytest.mark.slow
def test_train_and_resume_across_pp(tmp_path):
    """The compiled loop (AdamW, FP32 main weights, ZeRO-1 per stage, global clipping) on pp=2 × ep_mp=2
    follows the pp=1 run step for step (same dp=2, same data); a pp=2 checkpoint resumes on pp=1 and a
    pp=1 checkpoint on pp=2, optimizer state included."""
    ref = "dp=2,ep_mp=2"
    pp = ("--microbatches", "2", "--layers", "2")
    cli_train(tmp_path, 4, "pp=2,ep_mp=2", 2, "a.jsonl", *pp, "--ckpt", str(tmp_path / "a"))
    cli_train(tmp_path, 2, ref, 2, "b.jsonl", *pp, "--ckpt", str(tmp_path / "b"))
    out = cli_train(tmp_path, 2, ref, 4, "a.jsonl", *pp, "--ckpt", str(tmp_path / "a"), "--resume")
    assert "resumed from" in out and "pp=1" in out, out
    out = cli_train(tmp_path, 4, "pp=2,ep_mp=2", 4, "b.jsonl", *pp, "--ckpt", str(tmp_path / "b"), "--resume",
                 "--schedule", "gpipe")
    assert "resumed from" in out and "pp=2" in out, out
    a, b = metric_rows(tmp_path / "a.jsonl"), metric_rows(tmp_path / "b.jsonl")  # a: pp=2 then pp=1; b: the reverse
    assert [s for s, _, _ in a] == [s for s, _, _ in b] == [1, 2, 3, 4], (a, b)
    for (s, loss, norm), (_, rl, rn) in zip(a, b):
        assert abs(loss - rl) <= 1e-5 * abs(rl) and abs(norm - rn) <= 1e-4 * abs(rn), (s, loss, rl, norm, rn)


def test_explain_reports_each_stage_under_the_schedule(tmp_path):
    """explain on pp=2 compiles both stages in one process: H_s per stage as the schedule gives it, the
    schedule-aware lease pools smaller than one instance per microbatch on stage 0, each stage's graphs
    drawn as its own stage, and the bubble (pp−1)/(m+pp−1)."""
    import json

    from moe_compile.explain import explain

    res = explain(mesh="pp=2,dp=2,ep_mp=2", out_dir=tmp_path, model="tiny", micro_batches=4, seq_len=32,
                  dtype="float32", png=False)
    pl = json.loads((tmp_path / "ledger.json").read_text())["pipeline"]
    assert pl == json.loads(json.dumps(res.pipeline))
    assert abs(pl["bubble_fraction"] - 1 / 5) < 1e-12
    rows = {r["stage"]: r for r in pl["stages"]}
    assert {s: r["H_s"] for s, r in rows.items()} == {0: 2, 1: 1}
    assert rows[0]["layers"] == [0] and rows[1]["layers"] == [1]
    for r in rows.values():  # every stage's backward reads its dispatch receive rows: a lease each
        assert r["lease_high_water"]["lease"] == r["H_s"], r
        assert r["saved_bytes_per_microbatch"] > 0 and r["activation_high_water"] >= r["saved_bytes_per_microbatch"]
    assert rows[0]["lease_bytes"] < rows[0]["lease_bytes_one_per_microbatch"]
    assert rows[0]["P_local"] + rows[1]["P_local"] < sum(p.numel() for p in build_model("tiny").parameters())
    for s in (0, 1):
        assert f"pipeline stage {s} (pp=2)" in (tmp_path / f"stage{s}_partitioned.dot").read_text()
    assert "Pipeline stages" in (tmp_path / "report.html").read_text()
    import re

    svg = (tmp_path / "schedule.svg").read_text()  # the lease walk over the schedule, drawn
    used: dict[int, set[int]] = {}
    for stage, inst in re.findall(r'data-kind="F" data-stage="(\d+)" data-microbatch="\d+" data-instance="(\d+)"', svg):
        used.setdefault(int(stage), set()).add(int(inst))
    assert {s: len(v) for s, v in used.items()} == {0: 2, 1: 1}
    # a rank of the other stage plans the same rows: a stage this rank does not hold was compiled without
    # its owner's gradient buckets, so its backward returned every gradient at its end and its high-water
    # counted them (stage 1 from rank 0 was 2.85 GB over its own rank's figure for OLMoE-1B-7B at seq 256)
    other = explain(mesh="pp=2,dp=2,ep_mp=2", out_dir=tmp_path / "rank2", model="tiny", rank=2, micro_batches=4,
                    seq_len=32, dtype="float32", png=False)
    assert other.pipeline == res.pipeline, (other.pipeline["stages"], res.pipeline["stages"])


def test_schedule_lease_instances_by_hand():
    """1F1B, pp=2, m=4, rank 0 (stage 0): F0 F1 claim instances 0 and 1; B0 frees 0, so F2 takes 0; B1 frees
    1 for F3 — the walk the verifier proves, as the schedule picture draws it."""
    from moe_compile.schedules import ScheduleOrder
    from moe_compile.viz.schedule import schedule_instances

    cells = schedule_instances(ScheduleOrder.build("1f1b", 2, 4).order)
    rank0 = [c[0] for (r, _), c in sorted(cells.items()) if r == 0]
    assert [(k, mb, i) for k, _, mb, i in rank0] == [("F", 0, 0), ("F", 1, 1), ("B", 0, 0), ("F", 2, 0), ("B", 1, 1),
                                                     ("F", 3, 1), ("B", 2, 0), ("B", 3, 1)]


def masked_labels(b: torch.Tensor, everything: bool = False) -> torch.Tensor:
    """Loss tokens spread unevenly over the CP shards (cp=2, 16 tokens: shard 0 holds positions 0–3 and
    12–15, shard 1 positions 4–11) and the 2 microbatches: in the second, shard 1 has none. ``everything``:
    no loss token at all."""
    if everything:
        return torch.full_like(b, -100)
    labels = b.clone()
    labels[0, 6:10] = -100
    labels[1, 1:4] = -100
    labels[2:, 3:] = -100  # targets of positions 0 and 1 only
    return labels


def weighted_reference(model, b: torch.Tensor, labels: torch.Tensor, m: int):
    """The step's loss: microbatch j's loss (its token mean and its load-balancing term) weighted by its
    share of the batch's loss tokens, as train_step defines it; and its gradients."""
    ref = copy.deepcopy(model)
    n = [(y[:, 1:] != -100).sum().item() for y in labels.chunk(m)]
    w = [k / sum(n) for k in n] if sum(n) else [1 / m] * m  # no loss tokens: the load-balancing terms' mean
    loss = sum(ref(input_ids=x, labels=y).loss * wj for x, y, wj in zip(b.chunk(m), labels.chunk(m), w))
    loss.backward()
    return loss.item(), grads_of(ref)


def pp_cp_worker(rank: int, world: int, mesh: str, names: tuple[str, ...], masked: bool = False) -> list[dict]:
    """pp=2 × cp=2: each stage's ranks hold sequence shards; every rank of the pipeline and CP group
    passes the same batch (``masked``: with labels masked unevenly over the shards)."""
    out = []
    spec = MeshSpec.parse(mesh).resolve(world)
    for name in names:
        model = _model(name, 2, **({"lb_coef": 0.0, "z_coef": 0.0} if name == "tiny" else {}))
        batches = make_batches(spec.dp, 4, 16, seed=4)
        b = batches[spec.dense_coords(rank)[1]]
        labels = masked_labels(b, masked == "all") if masked else b
        if masked:
            ref_loss, ref_grads = weighted_reference(model, b, labels, 2)
        else:
            ref_losses, ref_grads = dense_reference(model, batches, 2)
            ref_loss = ref_losses[spec.dense_coords(rank)[1]]
        with torch.no_grad():  # forward-only reference: the weights train_step reads (no optimizer step)
            dense = copy.deepcopy(model)(input_ids=b, labels=labels)
        cm = moe_compile(model, spec, microbatches=2, schedule="1f1b")
        loss = cm.train_step(input_ids=b, labels=labels)
        grads = cm.full_grads()
        worst = max(grads, key=lambda n: rel_err(grads[n], ref_grads[n]))
        with torch.no_grad():  # forward-only: this rank's shard of the logits, the whole sequences' loss
            ev = cm(input_ids=b, labels=labels)
            pos = cm.cp_positions(b.shape[1])
            with pytest.raises(OptionError, match="position_ids cannot be passed"):  # later stages derive them
                cm(input_ids=b, labels=b, position_ids=torch.arange(b.shape[1]).expand_as(b))
        out.append({"name": name, "loss": loss.item(), "ref": ref_loss,
                    "err": rel_err(grads[worst], ref_grads[worst]), "worst": worst,
                    "eval_logits_err": rel_err(ev.logits, dense.logits[:, pos]),
                    "eval_loss": (ev.loss.item(), dense.loss.item())})
        cm.close()
    return out


def check_pp_cp(results) -> None:
    for rank, per in enumerate(results):
        for r in per:
            if math.isnan(r["ref"]):  # no loss token: the token loss is NaN in both, the gradients are the aux's
                assert math.isnan(r["loss"]) and r["err"] <= TOL, (rank, r)
                continue
            assert abs(r["loss"] - r["ref"]) <= TOL * abs(r["ref"]), (rank, r)
            assert r["err"] <= TOL, (rank, r)
            assert r["eval_logits_err"] <= TOL, (rank, r)
            a, b = r["eval_loss"]
            assert abs(a - b) <= TOL * abs(b), (rank, r)


@pytest.mark.parametrize("names", core_and_rest(("tiny", "llama4_tuned"), ("olmoe", "family:nemotron_h")))
@pytest.mark.long
def test_pipeline_with_context_parallelism(names):
    """pp=2 × cp=2 (4 ranks, one replica): 1F1B over the sequence shards, the tiny LM, OLMoE and Llama 4
    with attention temperature tuning (a NoPE layer on each stage: the later stage's positions come from
    no graph input) and Nemotron-H (NoPE; its later stage holds an MoE layer and no attention, refused as
    "no SDPA" before); then forward-only evaluation of the same batch: each rank's shard of the dense model's
    logits and its loss."""
    check_pp_cp(run_ranks(pp_cp_worker, 4, "pp=2,cp=2", names))


@pytest.mark.slow
def test_load_balancing_losses_under_pipeline_and_context_parallelism():
    """pp=2 × cp=2 with load-balancing losses (refused before): OLMoE's transformers loss
    (output_router_logits) and the tiny LM's in-block lb and z losses, with labels masked unevenly over the
    shards and microbatches (one shard of the second microbatch without loss tokens). Each CP rank adds the
    whole sequences' aux; the schedule's token-share weights make it the microbatch's (cp_balance_loss.py).
    Step loss and gradients match the dense model's token-share-weighted microbatch losses, and evaluation
    its loss on the whole batch."""
    check_pp_cp(run_ranks(pp_cp_worker, 4, "pp=2,cp=2", ("olmoe_aux", "tiny_aux"), True))


def padded_pp_cp_worker(rank: int, world: int) -> tuple:
    """pp=2 × cp=2, OLMoE with its load-balancing loss on a padded batch (left and right padding)."""
    spec = MeshSpec.parse("pp=2,cp=2").resolve(world)
    model = build_model("olmoe_aux", layers=2)
    b = make_batches(1, 4, 16, seed=4)[0]
    mask = torch.ones_like(b)
    mask[0, :6], mask[3, :3], mask[2, -4:] = 0, 0, 0
    labels = b.masked_fill(mask == 0, -100)
    ref, dense = copy.deepcopy(model), copy.deepcopy(model)
    n = [(y[:, 1:] != -100).sum().item() for y in labels.chunk(2)]
    want = sum(ref(input_ids=x, labels=y, attention_mask=a, use_cache=False).loss * (k / sum(n))
               for x, y, a, k in zip(b.chunk(2), labels.chunk(2), mask.chunk(2), n))
    want.backward()
    ref_grads = grads_of(ref)
    cm = moe_compile(model, spec, microbatches=2, schedule="1f1b")
    got = cm.train_step(input_ids=b, labels=labels, attention_mask=mask, use_cache=False).item()
    grads = cm.full_grads()
    with torch.no_grad():
        ev = cm(input_ids=b, labels=labels, attention_mask=mask, use_cache=False).loss.item()
        dense_ev = dense(input_ids=b, labels=labels, attention_mask=mask, use_cache=False).loss.item()
    cm.close()
    return got, want.item(), max(rel_err(grads[k], ref_grads[k]) for k in ref_grads), ev, dense_ev


def test_padded_batch_under_pipeline_and_context_parallelism():
    """A padding attention_mask at pp=2 × cp=2 (refused under cp before): the later stage's attention masks
    the padding keys from its own shard of the mask; step loss, gradients and evaluation as the dense model's."""
    for got, want, err, ev, dense_ev in run_ranks(padded_pp_cp_worker, 4):
        assert abs(got - want) <= TOL * abs(want) and err <= TOL, (got, want, err)
        assert abs(ev - dense_ev) <= TOL * abs(dense_ev), (ev, dense_ev)


@pytest.mark.slow
def test_load_balancing_loss_of_a_batch_without_loss_tokens_under_pipeline_and_context_parallelism():
    """Every label masked: the token loss is NaN (as the dense model's) and the gradients are the load-
    balancing terms' mean over the microbatches. Each CP rank weighted its microbatches 1/m and added the
    whole aux: the gradients were cp times the dense model's."""
    results = run_ranks(pp_cp_worker, 4, "pp=2,cp=2", ("olmoe_aux",), "all")
    for rank, per in enumerate(results):
        for r in per:
            assert math.isnan(r["loss"]) and math.isnan(r["ref"]) and r["err"] <= TOL, (rank, r)


def call_options_worker(rank: int, world: int) -> dict:
    """pp=2: output_router_logits per call, the config's flag off."""
    model = build_model("olmoe", router_aux_loss_coef=0.05)
    dense = copy.deepcopy(model)
    b = make_batches(1, 4, 16, seed=4)[0]
    cm = moe_compile(model, MeshSpec.parse("pp=2").resolve(world), microbatches=2)
    out = {"eval": []}
    with torch.no_grad():
        for flag in (False, True, False):
            got = cm(input_ids=b, labels=b, output_router_logits=flag).loss.item()
            want = dense(input_ids=b, labels=b, output_router_logits=flag).loss.item()
            out["eval"].append((got, want))
    cm.train_step(input_ids=b, labels=b)
    try:
        cm.train_step(input_ids=b, labels=b, output_router_logits=True)
        out["error"] = None
    except OptionError as e:
        out["error"] = str(e)
    cm.close()
    return out


def test_pipeline_call_options_are_not_silently_those_of_the_first_call():
    """A pipeline's capture bakes in the call's non-tensor arguments: an evaluation with another
    output_router_logits than the first reused the first's graphs (loss 5.54 for 7.56 with the load-
    balancing term), and so did a train_step. Evaluation now captures per call option; a train_step with
    other options than the schedule was built for is refused, naming them."""
    for r in run_ranks(call_options_worker, 2):
        for got, want in r["eval"]:
            assert abs(got - want) <= TOL * abs(want), r
        assert r["eval"][1][1] > r["eval"][0][1] + 0.01, r  # the flag changes the dense loss
        assert r["error"] is not None and "output_router_logits" in r["error"], r


@pytest.mark.long
def test_a_layer_that_is_the_moe_block_and_per_layer_inputs_from_later_modules():
    """Gemma 4: each decoder layer is itself the MoE block (router and experts are its children), which the
    layer-list search skipped ("not inside an nn.ModuleList of layers"); the layers read per-layer inputs
    made by modules registered after them but run before the first layer, so the probe forward places
    them on the first stage (by registration they went to the last, and stage 0 read a later stage's
    value). pp=2 then matches the dense model."""
    from moe_compile.models.hf import tiny_family_model

    model = tiny_family_model("gemma4_text", seed=0)
    assert [s.path for s in _blocks(model)] == ["model.layers.0", "model.layers.1"]
    split = plan_split(model, _blocks(model), 2, phases=outside_phases(model, _blocks(model)))
    assert split.layer_stage == (0, 1) and split.by_first_run
    assert split.owner["model.embed_tokens_per_layer.weight"] == 0
    assert split.owner["model.per_layer_model_projection.weight"] == 0
    assert split.owner["model.norm.weight"] == 1 and split.owner["model.embed_tokens.weight"] == 0
    by_registration = plan_split(model, _blocks(model), 2)
    assert by_registration.owner["model.embed_tokens_per_layer.weight"] == 1
    check(run_ranks(pipeline_worker, 2, [{"mesh": "pp=2", "model": "family:gemma4_text", "m": 2,
                                          "schedule": "1f1b"}]))


def pp_ledger_worker(rank: int, world: int) -> dict:
    cm = moe_compile(_model("tiny", 2), "pp=2,ep_mp=2", microbatches=2, schedule="1f1b")
    before = cm.ledger()
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    cm.train_step(input_ids=ids, labels=ids)
    led = cm.ledger()
    with torch.no_grad():  # an evaluation compiles another forward (no backward) into the stage programs
        cm(input_ids=ids[:, :8], labels=ids[:, :8])
    after_eval = cm.ledger()
    cm.close()
    keys = ("F_fwd_token", "M_saved", "M_saved_moe_graph", "M_working")

    def figures(x):
        return {"T": x.values.get("T"), **{k: x.figures[k].value if k in x.figures else None for k in keys}}

    return {"before": figures(before), "after": figures(led), "after_eval": figures(after_eval), "notes": led.notes}


def dense_stage_ledger_worker(rank: int, world: int) -> int | None:
    model = _model("tiny", 3, dense_layers=(0,))
    cm = moe_compile(model, "pp=2", microbatches=2, schedule="1f1b", pp_split=["layers.1"])
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    cm.train_step(input_ids=ids, labels=ids)
    t = cm.ledger().values.get("T")
    cm.close()
    return t


@pytest.mark.slow
def test_ledger_after_a_real_pipeline_step(tmp_path):
    """cm.ledger() after a real pp=2 step left T, the FLOPs and every graph figure n/a (the whole program
    captured no graph; its stages did) and told the user to run a step. They now come from the rank's
    stage programs and the first step's whole-model capture, and match explain's plan of the same stage
    (meta tensors, a fake world): T = 2 sequences × 16 tokens of a microbatch, F_fwd_token equal, the
    stage row's saved activations per microbatch within 0.1%."""
    import json

    from moe_compile.explain import explain

    real = run_ranks(pp_ledger_worker, 4)
    for rank in (0, 2):  # stage 0 and stage 1
        out = tmp_path / f"r{rank}"
        explain(mesh="pp=2,dp=2,ep_mp=2", out_dir=out, model="tiny", rank=rank, micro_batches=2, batch_size=2,
                seq_len=16, dtype="float32", png=False)
        planned = json.loads((out / "ledger.json").read_text())
        row = next(r for r in planned["pipeline"]["stages"] if r["stage"] == rank // 2)
        r = real[rank]
        assert all(r["before"][k] is None for k in ("T", "M_saved")), r["before"]
        assert r["after"]["T"] == 2 * 16, r
        assert r["after"]["F_fwd_token"] == planned["F_fwd_token"] > 0, (r, planned["F_fwd_token"])
        # within 0.1% as explain at cp=2 (the last stage: explain's differentiable meta cross-entropy saves 34 B more)
        assert abs(r["after"]["M_saved"] - row["saved_bytes_per_microbatch"]) <= 0.001 * r["after"]["M_saved"], (r, row)
        assert 0 < r["after"]["M_saved_moe_graph"] <= r["after"]["M_saved"] <= r["after"]["M_working"], r
        assert any("this rank's stages [" in n for n in r["notes"]), r["notes"]
        # an evaluation after the step left the training backward beside the evaluation's forward: the
        # ledger paired them and raised (pp=1 too); its figures are the training step's
        assert r["after_eval"] == r["after"], r
    # a rank whose stages are all dense has no dispatch to read T from: it was n/a after a real step
    assert run_ranks(dense_stage_ledger_worker, 2) == [2 * 16, 2 * 16]


@pytest.mark.long
def test_train_summary_reads_the_stage_programs(tmp_path):
    """`moe-compile train` at pp > 1 summarised the whole program's graphs, which a pipeline never
    captures: "recompute full (None ops)". It reads the rank's stage programs: the ops they recompute."""
    import re

    out = cli_train(tmp_path, 2, "pp=2", 2, "m.jsonl", "--microbatches", "2", "--activation-checkpointing", "full")
    m = re.search(r"recompute full \((\w+) ops\)", out)
    assert m is not None and m.group(1).isdigit() and int(m.group(1)) > 0, out[-500:]


def tied_embeddings_worker(rank: int, world: int, mesh: str, root: str, resume: bool) -> dict:
    """OLMoE with tied input and output embeddings: 3 steps of OLMoDDPOptimizer (reduce-scattered, clipped
    at 0.5, under the gradient norm of every step), a checkpoint after the second (``resume``: from it)."""
    from moe_compile.train.checkpoint import load_checkpoint, save_checkpoint
    from moe_compile.train.optimizer import OLMoDDPOptimizer

    spec = MeshSpec.parse(mesh).resolve(world)
    model = build_model("olmoe", layers=4, tie_word_embeddings=True)
    cm = moe_compile(model, spec, microbatches=2, **({"schedule": "interleaved_1f1b"} if spec.pp > 1 else {}))
    opt = OLMoDDPOptimizer(cm, lr=1e-2, max_grad_norm=0.5, reduce_scatter=True)
    steps = [make_batches(2, 4, 16, seed=10 + i)[spec.dense_coords(rank)[1]] for i in range(3)]
    out = {"loss": [], "norm": []}
    if resume:
        load_checkpoint(root, cm, opt)
    for i in range(2 if resume else 0, 3):
        out["loss"].append(cm.train_step(input_ids=steps[i], labels=steps[i]).item())
        out["norm"].append(opt.step().grad_norm)
        opt.zero_grad()
        if i == 1 and root and not resume:  # the dp=2 reference saves nothing
            save_checkpoint(root, cm, opt, 2, 2)
    out["local"] = cm.model.lm_head.weight.detach().clone()  # this rank's copy (the full state merges them)
    out["state"] = cm.full_state_dict()
    cm.close()
    return out


@pytest.mark.slow
def test_tied_embeddings_across_pipeline_stages(tmp_path):
    """Refused before: tied input and output embeddings at pp > 1. Each of the two stages holds the weight,
    its ranks sum their parts of its gradient, and the gradient norm counts it once. pp=2 × dp=2 (interleaved,
    4 stages) trains 3 steps as dp=2 does (losses within 1e-6, gradient norms, which clip every step,
    within 1e-6; weights within 5e-5 of their scale after three AdamW steps of lr 1e-2), both stages' copies stay equal, and its checkpoint resumes on dp=2."""
    pp = run_ranks(tied_embeddings_worker, 4, "pp=2,dp=2", str(tmp_path / "ck"), False)
    dp = run_ranks(tied_embeddings_worker, 2, "dp=2", "", False)
    resumed = run_ranks(tied_embeddings_worker, 2, "dp=2", str(tmp_path / "ck"), True)
    for rank, r in enumerate(pp):
        ref = dp[spec_dp(rank)]
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(r["loss"], ref["loss"])), (r["loss"], ref["loss"])
        assert all(abs(a - b) <= 1e-6 * b for a, b in zip(r["norm"], ref["norm"])), (r["norm"], ref["norm"])
        assert min(r["norm"]) > 0.5  # every step clipped: the norm decided the update
        assert torch.equal(r["local"], pp[(rank + 2) % 4]["local"])  # stage 0's copy and stage 1's
        assert set(r["state"]) == set(ref["state"])
        assert max(rel_err(r["state"][k], ref["state"][k]) for k in ref["state"]) <= 5e-5
    for r, ref in zip(resumed, dp):
        assert abs(r["loss"][0] - ref["loss"][2]) <= 1e-6 * abs(ref["loss"][2]), (r["loss"], ref["loss"])
        assert max(rel_err(r["state"][k], ref["state"][k]) for k in ref["state"]) <= 5e-5


def spec_dp(rank: int) -> int:
    return MeshSpec.parse("pp=2,dp=2").resolve(4).dense_coords(rank)[1]
