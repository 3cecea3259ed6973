"""Context parallelism: each CP rank runs its shard of the sequence, folded into the expert pool.

Reference: a plain copy of the dense model on the whole sequences (every data-parallel replica's
batch), gradient of the mean of the replicas' losses. Every rank of a CP group passes the same
batch; its loss must be the whole-sequence loss, and the reduced gradients the dense ones (fp32, 1e-5
of each tensor's scale).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from moe_compile import MeshSpec, moe_compile
from moe_compile.api import _check_context_parallel
from moe_compile.errors import OptionError, UnsupportedFeatureError
from moe_compile.runtime.context_parallel import shard_positions

from .common import (
    build_model,
    cli_train,
    core_and_rest,
    grads_of,
    make_batches,
    metric_rows,
    rel_err,
    skew_to_first_experts,
)
from .harness import run_ranks

TOL = 1e-5


def _model(name: str):
    if name == "tiny":
        return build_model("tiny", lb_coef=0.0, z_coef=0.0)
    if name == "tiny_aux":  # its blocks compute load-balancing and z losses themselves
        return build_model("tiny")
    if name in ("qwen3_moe", "deepseek_v2", "deepseek_v3"):
        from moe_compile.models.hf import tiny_family_model

        torch.manual_seed(0)
        return tiny_family_model(name, seed=0)
    if name == "dbrx_aux":  # its router returns logits alone; the canonical block calls it (recorded there)
        from moe_compile.models.hf import tiny_family_model

        return tiny_family_model("dbrx", seed=0, output_router_logits=True)
    return build_model(name)


def cp_worker(rank: int, world: int, names: tuple[str, ...], mesh: str, seq: int, skewed: bool = False) -> dict:
    spec = MeshSpec.parse(mesh).resolve(world)
    out = {}
    for name in names:
        model = _model(name)
        if skewed:  # every token to the first EP rank's experts
            from moe_compile.frontend.recognize import find_candidates

            skew_to_first_experts(model, find_candidates(model)[0].experts.num_experts // spec.ep_mp)
        vocab = model.config.vocab_size if hasattr(model, "config") else 256
        batches = [b % vocab for b in make_batches(spec.dp, 2, seq, seed=11)]
        ref = copy.deepcopy(model)
        ref_losses = [ref(input_ids=b, labels=b).loss for b in batches]
        torch.stack(ref_losses).mean().backward()
        ref_grads = grads_of(ref)
        cm = moe_compile(model, spec)
        dp = spec.dense_coords(rank)[1]
        b = batches[dp]
        res = cm(input_ids=b, labels=b)
        res.loss.backward()
        grads = cm.full_grads()
        worst = max(grads, key=lambda n: rel_err(grads[n], ref_grads[n]))
        counts = cm.expert_counts()
        aux = getattr(res, "aux_loss", None)
        out[name] = {"loss": res.loss.item(), "ref": ref_losses[dp].item(), "err": rel_err(grads[worst], ref_grads[worst]),
                     "aux": None if aux is None else (aux.item(), ref(input_ids=b, labels=b).aux_loss.item()),
                     "worst": worst, "names": set(grads) == set(ref_grads), "logits": tuple(res.logits.shape),
                     "empty": sum(int((c["requested"] == 0).sum()) for c in counts.values())}
        cm.close()
    return out


def check(results, seq: int, cp: int) -> None:
    for rank, per in enumerate(results):
        for name, r in per.items():
            assert abs(r["loss"] - r["ref"]) <= TOL * abs(r["ref"]), (rank, name, r)
            assert r["names"] and r["err"] <= TOL, (rank, name, r)
            assert r["logits"][1] == seq // cp, r  # each rank keeps its shard
            if r["aux"] is not None:  # the load-balancing loss: the whole sequences', as the loss above
                assert abs(r["aux"][0] - r["aux"][1]) <= TOL * abs(r["aux"][1]), (rank, name, r)


@pytest.mark.parametrize("names", core_and_rest(("olmoe_aux", "tiny_aux"),
                                                 ("tiny", "olmoe", "mixtral", "qwen3_moe", "llama4_tuned")))
def test_cp2_ep2_four_ranks(names):
    """cp=2 × ep_mp=2: the tiny LM, OLMoE, Mixtral and Qwen3-MoE on 32-token sequences; OLMoE with its
    load-balancing loss (output_router_logits, coefficient 0.05) and the tiny LM with the load-balancing
    and z losses its blocks compute, both refused before: a shard's router statistics gave other values
    (runtime/cp_balance_loss.py and canonical._block_aux_loss gather the router logits). Llama 4 with
    attention temperature tuning from position 3 on (floor_scale=4): its NoPE layers take query positions
    from the length of what they see, the shard's 16 (passes/cp_positions.py gives them the global ones;
    without it the gradients were off by 6% (q_proj), the loss by 4e-7, and sequences of 16 tokens or more
    were refused)."""
    check(run_ranks(cp_worker, 4, names, "cp=2,ep_mp=2", 32), 32, 2)


def accumulation_worker(rank: int, world: int) -> list[float]:
    """cp=2: three forward/backward passes of one batch without zeroing, then a train_step over them."""
    model = _model("olmoe")
    b = make_batches(1, 2, 16, seed=3)[0]
    ref = copy.deepcopy(model)
    ref(input_ids=b, labels=b).loss.backward()
    want = grads_of(ref)
    cm = moe_compile(model, MeshSpec.parse("cp=2").resolve(world))
    errs = []
    for k in (1, 2, 3):
        cm(input_ids=b, labels=b).loss.backward()
        got = cm.full_grads()
        errs.append(max(rel_err(got[n], k * want[n]) for n in want))
    cm.train_step(input_ids=b, labels=b)  # its gradients add to the three passes' too
    got = cm.full_grads()
    errs.append(max(rel_err(got[n], 4 * want[n]) for n in want))
    cm.close()
    return errs


def test_cp2_gradients_accumulate_over_backwards_without_zeroing():
    """The dense gradients were summed over the CP group at every reduction, with what earlier ones had
    already reduced: 1×, 3×, 7× the reference after three backwards (dp and ep_dp took means: 1×, 2×, 3×)."""
    for errs in run_ranks(accumulation_worker, 2):
        assert max(errs) <= TOL, errs


@pytest.mark.parametrize("names", core_and_rest(("tiny",), ("olmoe",)))
def test_cp2_skewed_routing(names):
    """Every token of every shard routes to the first EP rank's experts (the other rank's idle)."""
    results = run_ranks(cp_worker, 4, names, "cp=2,ep_mp=2", 16, True)
    check(results, 16, 2)
    assert all(r["empty"] > 0 for per in results for r in per.values())


def test_cp2_mla_attention_keeps_its_in_place_key_writes():
    """DeepSeek-V2/V3's MLA attention writes its keys into a new_empty buffer with slice copy_'s that
    nothing reads: the CP pass's dead-code elimination dropped them, and attention read uninitialised
    keys (losses off by 1e-4–1e-3 from run to run, gradients up to 1e34 or NaN). Also DBRX with its
    load-balancing loss (its recorder saw no router logits: a crash under capture, at cp = 1 too)."""
    check(run_ranks(cp_worker, 2, ("deepseek_v3", "deepseek_v2", "dbrx_aux"), "cp=2", 16), 16, 2)


@pytest.mark.slow
def test_cp2_two_ranks():
    check(run_ranks(cp_worker, 2, ("tiny", "olmoe", "mixtral"), "cp=2", 16), 16, 2)


class _ShiftsItself(nn.Module):
    """A user's causal LM wrapper that shifts labels itself and takes the mean (no shift_labels, no
    num_items_in_batch: swallowed by **kwargs)."""

    def __init__(self, reads_shift_labels: bool) -> None:
        super().__init__()
        self.lm, self.reads_shift_labels = _model("tiny"), reads_shift_labels

    def forward(self, input_ids, labels=None, position_ids=None, shift_labels=None, **kwargs):
        logits = self.lm(input_ids=input_ids, position_ids=position_ids).logits
        if self.reads_shift_labels and shift_labels is not None:
            target, lg = shift_labels, logits
        else:
            target, lg = labels[:, 1:], logits[:, :-1]
        return torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), target.reshape(-1)), logits


def unsharded_cp_worker(rank: int, world: int) -> list[str]:
    spec, msgs = MeshSpec.parse("cp=2").resolve(world), []
    b = make_batches(1, 2, 8)[0]
    model = _model("olmoe")
    dense = copy.deepcopy(model)
    cm = moe_compile(model, spec)
    # asked per call (accepted and silently a shard's statistics, then refused): the whole sequences' loss
    got = cm(input_ids=b, labels=b, output_router_logits=True).loss.item()
    msgs.append(abs(got - dense(input_ids=b, labels=b, output_router_logits=True).loss.item()))
    cm.close()
    for reads in (False, True):
        cm = moe_compile(_ShiftsItself(reads), spec)
        try:
            cm(input_ids=b, labels=b)
        except UnsupportedFeatureError as e:
            msgs.append(str(e))
        cm.close()
    # an attention listed as making positions from its length (Llama 4's flags), with no arange to replace:
    # exact below the position where that matters, refused from there on (not silently off)
    model = _model("tiny")
    model.layers[0].attn.attn_temperature_tuning, model.layers[0].attn.use_rope = True, 0
    model.layers[0].attn.floor_scale = 16
    dense = copy.deepcopy(model)
    cm = moe_compile(model, spec)
    msgs.append(abs(cm(input_ids=b, labels=b).loss.item() - dense(input_ids=b, labels=b).loss.item()))
    long = make_batches(1, 2, 16)[0]
    try:
        cm(input_ids=long, labels=long)
    except UnsupportedFeatureError as e:
        msgs.append(str(e))
    cm.close()
    return msgs


def test_context_parallel_refuses_what_a_shard_would_compute_wrongly():
    """Each was accepted and silently off at cp=2: the load-balancing loss asked per call (a shard's router
    statistics: loss 7.56 for 6.55 on Mixtral; refused since, and now the whole sequences'), a model that
    shifts the already-shifted shard labels again or averages its shard (loss 11.1 for 5.6). And a module
    listed as making positions from its length whose arange passes/cp_positions.py cannot find."""
    for msgs in run_ranks(unsharded_cp_worker, 2):
        assert len(msgs) == 5, msgs
        assert msgs[0] <= 1e-5 * 6, msgs[0]  # the dense model's loss with its load-balancing term
        assert "reads labels and not shift_labels" in msgs[1]
        assert "ignores num_items_in_batch" in msgs[2]
        assert msgs[3] <= 1e-5 * 6, msgs[3]  # S = 8: the dense model's loss
        assert msgs[4].startswith("layers.0.attn: context parallelism (cp=2)") and "reaches position 15" in msgs[4]


@pytest.mark.slow
def test_cp4_ep2_eight_ranks():
    check(run_ranks(cp_worker, 8, ("tiny", "olmoe"), "cp=4,ep_mp=2", 32), 32, 4)


def halo_worker(rank: int, world: int) -> dict:
    """cp=world: this rank's two chunks of a [B, S, C] sequence (S = 2cp chunks of 4), each after the 3 tokens
    before it (ops.context_parallel.chunks_with_halos), and the gradient of Σ w·out over the whole group,
    with w a fixed weight per (chunk, place); the tails each rank received in forward and backward."""
    from unittest import mock

    import torch.distributed as dist

    from moe_compile.ops.context_parallel import chunks_with_halos
    from moe_compile.runtime.context import RuntimeContext, register_context, release_context
    from moe_compile.runtime.stats import RuntimeStats
    from moe_compile.runtime.transport import LocalTransport

    ctx = register_context(RuntimeContext(LocalTransport(RuntimeStats()), cp_group=dist.group.WORLD))
    seq = torch.arange(2 * 8 * world * 3, dtype=torch.float64).reshape(2, 8 * world, 3)  # [B, S, C]
    x = seq[:, shard_positions(8 * world, world, rank)].clone().requires_grad_(True)
    received, exchange = [], dist.all_to_all_single

    def counted(output, *args, **kwargs):
        received.append(output.shape[0])
        return exchange(output, *args, **kwargs)

    with mock.patch.object(dist, "all_to_all_single", counted):
        out = chunks_with_halos(x, 1, 3, ctx, world)  # [2 chunks, B, 3 + 4, C]
        w = torch.randn(2 * world, *out.shape[1:], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        (out * torch.stack([w[rank], w[2 * world - 1 - rank]])).sum().backward()
    release_context(ctx)
    return {"out": out.detach(), "grad": x.grad, "seq": seq, "w": w, "received": received}


@pytest.mark.parametrize("world", [2, 4])
def test_halos_come_from_the_neighbouring_ranks(world):
    """Each chunk's halo (the tokens before it in the sequence; zeros before chunk 0) now travels only
    between neighbouring ranks (moe_cp::halo_exchange: two tails per rank, not the group's 2cp): each rank's
    chunks with their halos against slices of the whole sequence, and the gradient against one worked out
    from the whole sequence by hand: a token's is its own weight plus that of each halo place it fills.
    At cp=4 ranks 1 and 2 trade with both sides, and rank 3's second chunk reads its own first chunk's tail."""
    outs = run_ranks(halo_worker, world)
    # one exchange each way, of a tail from each neighbour there is (ranks 0 and cp−1 have one)
    assert [o["received"] for o in outs] == [[1, 1]] + [[2, 2]] * (world - 2) + [[1, 1]], outs
    seq, w = outs[0]["seq"], outs[0]["w"]
    grad = torch.zeros_like(seq)
    for c in range(2 * world):  # chunk c: tokens 4c … 4c + 3, after 4c − 3 … 4c − 1
        grad[:, 4 * c:4 * c + 4] += w[c][:, 3:]
        lo = max(4 * c - 3, 0)
        grad[:, lo:4 * c] += w[c][:, 3 - (4 * c - lo):3]
    for rank, out in enumerate(outs):
        for i, c in enumerate((rank, 2 * world - 1 - rank)):
            want = torch.cat([torch.zeros(2, max(3 - 4 * c, 0), 3, dtype=seq.dtype), seq[:, max(4 * c - 3, 0):4 * c + 4]], 1)
            assert torch.equal(out["out"][i], want), (rank, c)
        assert torch.allclose(out["grad"], grad[:, shard_positions(8 * world, world, rank)]), rank


def test_shard_positions_are_load_balanced_chunks():
    """S=16, cp=2: four chunks of 4; rank 0 takes chunks 0 and 3, rank 1 chunks 1 and 2."""
    assert shard_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    together = torch.cat([shard_positions(24, 3, r) for r in range(3)])
    assert sorted(together.tolist()) == list(range(24))
    with pytest.raises(OptionError, match="sequence length 10 is not divisible by 2·cp = 4"):
        shard_positions(10, 2, 0)


def bad_cp_worker(rank: int, world: int) -> list[str]:
    spec = MeshSpec.parse("cp=2").resolve(world)
    msgs = []
    tiny = build_model("tiny")  # its blocks compute lb / z losses: refused before, the whole sequences' now
    want = copy.deepcopy(tiny)(input_ids=make_batches(1, 2, 8)[0], labels=make_batches(1, 2, 8)[0]).loss.item()
    cm = moe_compile(tiny, spec)
    msgs.append(abs(cm(input_ids=make_batches(1, 2, 8)[0], labels=make_batches(1, 2, 8)[0]).loss.item() - want))
    cm.close()
    # its load-balancing loss is the whole sequences' across pipeline stages too (refused before; the
    # numbers: test_pipeline.test_load_balancing_losses_under_pipeline_and_context_parallelism)
    _check_context_parallel(build_model("olmoe_aux"), MeshSpec.parse("pp=2,cp=2,dp=1"))
    msgs.append("accepted at pp > 1")
    from moe_compile.models.hf import tiny_family_model

    conv = _model("tiny")
    conv.layers[0].mix = torch.nn.Conv1d(conv.config.d_model, conv.config.d_model, 3, padding=2)
    unknown = tiny_family_model("deepseek_v32", seed=0)  # indexed layers whose indexer is not of the DSA form
    for layer in unknown.model.layers:
        del layer.self_attn.indexer.index_topk
    hidden = tiny_family_model("qwen3_next", seed=0)  # a linear-attention layer whose mixer is not found
    hidden.model.layers[0].gdn = hidden.model.layers[0].linear_attn
    del hidden.model.layers[0].linear_attn
    for model in (hidden, unknown, conv):
        try:  # token mixers other than full causal attention would see one rank's shard only
            moe_compile(model, spec)
        except UnsupportedFeatureError as e:
            msgs.append(str(e))
    model = _model("tiny")
    dense = copy.deepcopy(model)
    cm = moe_compile(model, spec)
    b = make_batches(1, 2, 10)[0]
    square = torch.ones(2, 1, 8, 8, dtype=torch.bool)  # a 4-D mask: its key and query axes would both need cutting
    for kw in ({"input_ids": b, "labels": b},
               {"input_ids": b[:, :8], "labels": b[:, :8], "attention_mask": square},
               {"input_ids": b[:, :8], "labels": b[:, :8], "position_ids": torch.arange(6).expand(2, -1)},
               {"input_ids": b[:, :8], "use_cache": True},
               {"input_ids": b[:, :8], "labels": b[:, :8], "token_type_ids": torch.zeros_like(b[:, :8])}):
        try:
            cm(**kw)
        except OptionError as e:
            msgs.append(str(e))
    good = b[:, :8]  # a train_step whose CP shard rank 1 alone refuses: both refuse, then both train on
    mine = dict(input_ids=good, labels=good)
    if rank == 1:
        mine["attention_mask"] = square
    try:
        cm.train_step(**mine)
    except OptionError as e:
        msgs.append(str(e))
    step_loss = cm.train_step(input_ids=good, labels=good).item()
    msgs.append(abs(step_loss - dense(input_ids=good, labels=good).loss.item()) / abs(step_loss))
    cm.close()
    cm = moe_compile(_model("olmoe"), spec)  # return_dict=False: the tuple's loss is the whole sequence's too
    x = make_batches(1, 2, 8, seed=2)[0]
    whole = cm(input_ids=x, labels=x).loss.item()
    as_tuple = cm(input_ids=x, labels=x, return_dict=False)[0].item()
    shifted = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], 1)  # transformers' own shift
    shifted[0, 3] = -100  # and a masked target: given as shift_labels, sharded as they are
    dense_x = _model("olmoe")
    want = dense_x(input_ids=x, shift_labels=shifted, labels=x).loss.item()
    given = cm(input_ids=x, shift_labels=shifted).loss.item()
    cm.close()
    return msgs, (whole, as_tuple, want, given)


def against_dense(model: nn.Module, spec, **batch) -> tuple[float, float, float]:
    """(loss, the dense model's loss, worst gradient error) of one compiled forward and backward. A gradient
    more than TOL off the fp32 dense one counts as TOL when it is closer to an fp64 run of the dense model
    than the fp32 dense one is: fp32 rounding, summed in another order (DeepSeek-V4's hyper-connection
    scale: 1.8e-5 off fp64 in the fp32 dense model, 1.3e-5 at cp=2)."""
    exact = copy.deepcopy(model)
    ref = copy.deepcopy(model)
    want = ref(**batch)
    want.loss.backward()
    cm = moe_compile(model, spec)
    got = cm(**batch)
    got.loss.backward()
    grads, ref_grads = cm.full_grads(), grads_of(ref)
    cm.close()
    errs = {n: rel_err(grads[n], ref_grads[n]) for n in ref_grads}
    if max(errs.values()) > TOL:
        exact = exact.double()
        if hasattr(exact, "set_experts_implementation"):
            exact.set_experts_implementation("eager")  # grouped_mm has no fp64 kernel
        try:
            exact(**batch).loss.backward()
        except Exception:  # noqa: BLE001 - no fp64 run: the fp32 verdict stands
            return got.loss.item(), want.loss.item(), max(errs.values())
        exact_grads = grads_of(exact)
        for n, e in errs.items():
            if e > TOL and rel_err(grads[n].double(), exact_grads[n]) <= rel_err(ref_grads[n].double(), exact_grads[n]):
                errs[n] = TOL
    return got.loss.item(), want.loss.item(), max(errs.values())


def masks_worker(rank: int, world: int, part: str) -> dict:
    """cp=2: padded and packed batches of OLMoE with its load-balancing loss, against the dense model."""
    spec = MeshSpec.parse("cp=2").resolve(world)
    b = make_batches(1, 2, 16, seed=5)[0]
    right, left = torch.ones_like(b), torch.ones_like(b)
    right[0, -5:] = 0
    left[1, :7] = 0
    packed = torch.stack([torch.cat([torch.arange(5), torch.arange(11)]), torch.cat([torch.arange(9), torch.arange(7)])])
    cases = {"right_padding": {"attention_mask": right, "use_cache": False},
             "left_padding": {"attention_mask": left, "use_cache": False},
             "packed": {"position_ids": packed, "use_cache": False},
             # transformers keeps packed sequences apart only without an attention_mask and a cache
             "packed_with_a_mask": {"position_ids": packed, "attention_mask": torch.ones_like(b), "use_cache": False},
             "packed_with_a_cache": {"position_ids": packed}}
    core = ("left_padding", "packed", "packed_with_a_mask")
    out = {}
    for case, kw in cases.items():
        if (case in core) != (part == "core"):
            continue
        labels = b.masked_fill(kw.get("attention_mask", torch.ones_like(b)) == 0, -100)
        out[case] = against_dense(_model("olmoe_aux"), spec, input_ids=b, labels=labels, **kw)
    return out


@pytest.mark.parametrize("part", core_and_rest("core", "rest"))
def test_cp2_padding_and_packed_sequences(part):
    """Refused before (attention_mask with padding; position_ids that restart): the attention's mask over
    the gathered keys is the whole sequence's as transformers makes it (padding keys masked; packed
    sequences kept apart where the position ids restart, only without an attention_mask and a cache), and
    the load-balancing loss leaves the padding out. Loss and every gradient as the dense model's; the packed
    case's loss differs from the unpacked ones' by 2e-3, left padding's from no masking by more."""
    for out in run_ranks(masks_worker, 2, part):
        for case, (got, want, err) in out.items():
            assert abs(got - want) <= TOL * abs(want) and err <= TOL, (case, got, want, err)
        if part == "core":
            assert abs(out["packed"][1] - out["packed_with_a_mask"][1]) > 1e-3, out  # the case tests something


def _padded_cases(world: int, seed: int, cases, mesh: str = "cp=2", **config) -> dict:
    """``mesh`` (cp=2), 2 sequences of 32 tokens: each (case, family, padded) against the dense model of a
    tiny ``family`` config (``config`` overrides), the second sequence left-padded by 9 where ``padded``."""
    from moe_compile.models.hf import tiny_family_model

    spec = MeshSpec.parse(mesh).resolve(world)
    b = make_batches(1, 2, 32, seed=seed)[0]
    left = torch.ones_like(b)
    left[1, :9] = 0
    out = {}
    for case, family, padded in cases:
        model = tiny_family_model(family, seed=0, **config)
        x = b % model.config.vocab_size
        kw = {"attention_mask": left} if padded else {}
        labels = x.masked_fill(kw.get("attention_mask", torch.ones_like(x)) == 0, -100)
        out[case] = against_dense(model, spec, input_ids=x, labels=labels, use_cache=False, **kw)
    return out


WINDOW_CASES = {"core": (("gemma4_text", "gemma4_text", False), ("mixtral_padded", "mixtral", True)),
                "rest": (("mixtral", "mixtral", False), ("exaone_moe", "exaone_moe", False))}


def window_worker(rank: int, world: int, part: str) -> dict:
    """cp=2, sliding window 4 over 32 tokens: Mixtral (every layer slides), Gemma 4 and EXAONE-MoE (sliding
    and full layers alternate), Mixtral on a left-padded batch and on packed sequences too (one restarts at
    token 14, inside the halo of chunk 2: tokens 13–15); in "core" also the keys each compiled Mixtral
    attention is given and the halos exchanged for them."""
    from moe_compile.models.hf import tiny_family_model

    out = _padded_cases(world, 7, WINDOW_CASES[part], sliding_window=4)
    if part != "core":
        return out
    spec = MeshSpec.parse("cp=2").resolve(world)
    b = make_batches(1, 2, 32, seed=7)[0]
    packed = torch.stack([torch.cat([torch.arange(14), torch.arange(18)]), torch.arange(32)])
    model = tiny_family_model("mixtral", seed=0, sliding_window=4)
    x = b % model.config.vocab_size
    out["mixtral_packed"] = against_dense(model, spec, input_ids=x, labels=x, position_ids=packed, use_cache=False)
    unpacked = tiny_family_model("mixtral", seed=0, sliding_window=4)
    out["unpacked_loss"] = unpacked(input_ids=x, labels=x, use_cache=False).loss.item()
    cm = moe_compile(tiny_family_model("mixtral", seed=0, sliding_window=4), spec)
    cm(input_ids=x, labels=x, use_cache=False)
    nodes = cm.program.graphs["forward"].graph.nodes
    out["keys"] = [tuple(n.args[1].meta["val"].shape) for n in nodes if "scaled_dot_product" in str(n.target)]
    out["exchanged"] = [tuple(n.args[0].meta["val"].shape) for n in nodes if "moe_cp.halo_exchange" in str(n.target)]
    out["kv_gathers"] = [n for n in nodes if "moe_cp.all_gather" in str(n.target) and n.meta["val"].dim() >= 3]
    c = cm.model.config
    out["config"] = (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    cm.close()
    out["kv_gathers"] = len(out["kv_gathers"])
    return out


@pytest.mark.parametrize("part", core_and_rest("core", "rest"))
def test_cp2_sliding_window_attention(part):
    """Refused before: sliding-window layers under context parallelism. The CP mask applies the config's
    window by global token index on its sliding layers (every layer without config.layer_types). With
    window 4 over 32 tokens the dense losses differ from full attention's by 1e-4 to 2e-2; loss and every
    gradient as the dense model's. Each chunk's queries attend to that chunk after the 3 keys before it,
    sent by the neighbouring rank: 16 + 2·3 keys per rank, not the sequence's 32 gathered
    (moe_cp::halo_exchange, moe_cp::window_mask; until 2026-12-07 every sliding layer gathered them all),
    and they travel with their own K/V heads, repeated for GQA after (before, repeated to the query's)."""
    for out in run_ranks(window_worker, 2, part):
        if part == "core":
            layers, heads, kv_heads, hd = out.pop("config")
            assert kv_heads < heads, (kv_heads, heads)  # GQA: the case tests that K/V travel unrepeated
            # SDPA is given K/V repeated to the query heads, as transformers repeats them
            assert out.pop("keys") == [(2, heads, 16 + 2 * 3, hd)] * layers, out
            # K, V (their own heads) and the positions: the 3 tokens before each of the 2 chunks
            assert sorted(out.pop("exchanged")) == sorted([(2, 2, 3)] + [(2, 2, kv_heads, 3, hd)] * 2 * layers), out
            assert out.pop("kv_gathers") == 0, out
            assert abs(out.pop("unpacked_loss") - out["mixtral_packed"][1]) > 1e-3, out  # the packing matters
        for case, (got, want, err) in out.items():
            assert abs(got - want) <= TOL * abs(want) and err <= TOL, (case, got, want, err)


def window4_worker(rank: int, world: int) -> dict:
    """cp=4, 32 tokens (chunks of 4), sliding window 4: Mixtral, and GPT-OSS (sinks) left-padded."""
    return _padded_cases(world, 7, (("mixtral", "mixtral", False), ("gpt_oss_padded", "gpt_oss", True)),
                         mesh="cp=4", sliding_window=4)


@pytest.mark.slow
def test_cp4_sliding_window_attention():
    """cp=4: the middle ranks' chunks take their halos from both neighbours, and the last rank's second
    chunk from its own first. Loss and every gradient as the dense model's."""
    for out in run_ranks(window4_worker, 4):
        for case, (got, want, err) in out.items():
            assert abs(got - want) <= TOL * abs(want) and err <= TOL, (case, got, want, err)


def chunks_worker(rank: int, world: int) -> dict:
    """cp=2, Llama 4 with attention chunks of 4 over 32 tokens (layer 0 chunked with RoPE, layer 1 full NoPE
    attention): a plain batch, a left-padded one (chunks start after the padding) and packed sequences
    (chunks start at each sequence's position 0); the dense loss of the plain batch with chunks of 32."""
    from moe_compile.models.hf import tiny_family_model

    spec = MeshSpec.parse("cp=2").resolve(world)
    b = make_batches(1, 2, 32, seed=9)[0] % 200
    left = torch.ones_like(b)
    left[1, :7] = 0
    packed = torch.stack([torch.cat([torch.arange(11), torch.arange(21)]), torch.arange(32)])
    out = {}
    for case, kw in (("plain", {}), ("left_padding", {"attention_mask": left}), ("packed", {"position_ids": packed})):
        model = tiny_family_model("llama4_text", seed=0, attention_chunk_size=4, no_rope_layers=[1, 0])
        labels = b.masked_fill(kw.get("attention_mask", torch.ones_like(b)) == 0, -100)
        out[case] = against_dense(model, spec, input_ids=b, labels=labels, use_cache=False, **kw)
    whole = tiny_family_model("llama4_text", seed=0, attention_chunk_size=32, no_rope_layers=[1, 0])
    out["unchunked"] = whole(input_ids=b, labels=b, use_cache=False).loss.item()
    return out


def test_cp2_chunked_attention():
    """Refused before: Llama 4's chunked attention layers under context parallelism. The CP mask applies
    the config's attention_chunk_size on its chunked layers over the whole sequence, from the left padding
    on and per packed sequence as transformers' chunked mask does; loss and every gradient as the dense
    model's."""
    for out in run_ranks(chunks_worker, 2):
        assert abs(out["plain"][1] - out.pop("unchunked")) > 1e-3, out  # the chunks change the loss
        for case, (got, want, err) in out.items():
            assert abs(got - want) <= TOL * abs(want) and err <= TOL, (case, got, want, err)


def convs_worker(rank: int, world: int, part: str) -> dict:
    """cp=2: LFM2-MoE (short causal convolution layers beside attention layers) on a plain and a
    left-padded batch, against the dense model; Zaya (its attention's convolutions after its own padding,
    a delayed value state: run with halos) likewise, refused with projection biases and for chunks
    shorter than its reach. ``part``: "core" LFM2-MoE, "rest" Zaya."""
    from moe_compile.models.hf import tiny_family_model

    spec = MeshSpec.parse("cp=2").resolve(world)
    b = make_batches(1, 2, 32, seed=10)[0] % 200
    left = torch.ones_like(b)
    left[1, :5] = 0
    out = {}
    if part == "rest":
        return _zaya_cases(spec, b, left)
    for case, kw in (("plain", {}), ("left_padding", {"attention_mask": left}), ("chunks_of_one", {})):
        model = tiny_family_model("lfm2_moe", seed=0)
        out["kernel"] = model.model.layers[0].conv.conv.kernel_size[0]
        x = b[:, :4] if case == "chunks_of_one" else b  # chunks shorter than the kernel: the whole sequence
        labels = x.masked_fill(kw.get("attention_mask", torch.ones_like(x)) == 0, -100)
        out[case] = against_dense(model, spec, input_ids=x, labels=labels, use_cache=False, **kw)
    model = tiny_family_model("lfm2_moe", seed=0)
    cm = moe_compile(model, spec)
    cm(input_ids=b, labels=b, use_cache=False)
    nodes = cm.program.graphs["forward"].graph.nodes
    # (gathered shape, dim) of each all-gather: no whole input; the shape each halo exchange returns
    out["gathers"] = [(tuple(n.meta["val"].shape), n.args[1]) for n in nodes if "moe_cp.all_gather" in str(n.target)]
    out["halos"] = [tuple(n.meta["val"].shape) for n in nodes if "moe_cp.halo_exchange" in str(n.target)]
    out["conv_layers"] = sum(1 for m in model.modules() if isinstance(m, torch.nn.Conv1d))
    cm.close()
    return out


def _zaya_cases(spec, b: torch.Tensor, left: torch.Tensor) -> dict:
    """Zaya against the dense model with a fresh cache and left-padded, and its two refusals' messages."""
    from moe_compile.models.hf import tiny_family_model

    out = {}
    # a fresh cache, as transformers makes in training when use_cache is not False, and without one
    for case, kw in (("zaya", {}), ("zaya_left_padding", {"attention_mask": left, "use_cache": False})):
        model = tiny_family_model("zaya", seed=0)
        labels = b.masked_fill(kw.get("attention_mask", torch.ones_like(b)) == 0, -100)
        out[case] = against_dense(model, spec, input_ids=b, labels=labels, **kw)
    try:
        moe_compile(tiny_family_model("zaya", seed=0, attention_bias=True), spec)
    except UnsupportedFeatureError as e:
        out["zaya biases"] = str(e)
    cm = moe_compile(tiny_family_model("zaya", seed=0), spec)
    try:  # chunks of one token, each reading the two before it
        cm(input_ids=b[:, :4], labels=b[:, :4], use_cache=False)
    except UnsupportedFeatureError as e:
        out["zaya chunks_of_one"] = str(e)
    finally:
        cm.close()
    return out


@pytest.mark.parametrize("part", core_and_rest("core", "rest"))
def test_cp2_short_causal_convolutions(part):
    """Refused before: LFM2's convolution layers under context parallelism. Each short causal convolution
    (kernel 3 here; tokens at every shard boundary read the last tokens of another rank's chunk) convolves
    each of this rank's chunks behind the k − 1 tokens before it, sent by the neighbouring rank
    (passes/cp_convs.py; until 2026-12-06 it gathered the whole input, until 2026-12-07 every chunk's end); chunks of one token shorter than
    that take the whole sequence. Zaya's convolutional attention (refused before) runs on each chunk with
    the two tokens before it (models/hf_halos.py; with zero halos its gradients were 120% off). Loss and
    every gradient as the dense model's. Other convolutions are still refused."""
    for out in run_ranks(convs_worker, 2, part):
        if part == "rest":
            assert "q_proj.bias" in out.pop("zaya biases"), out
            assert "sequence chunks of 1 tokens" in out.pop("zaya chunks_of_one"), out
        else:
            k, gathers, convs, halos = out.pop("kernel"), out.pop("gathers"), out.pop("conv_layers"), out.pop("halos")
            assert k > 1, out
            # one exchange per conv, of the k − 1 tokens before each of the rank's 2 chunks: [2, B, C, k − 1]
            assert len(halos) == convs > 0 and all(h[0] == 2 and h[-1] == k - 1 for h in halos), halos
            assert not any(dim == 2 and len(shape) == 3 for shape, dim in gathers), gathers  # no [B, C, S] input
        for case, (got, want, err) in out.items():
            assert abs(got - want) <= TOL * abs(want) and err <= TOL, (case, got, want, err)


def test_pp2_cp2_short_causal_convolutions():
    """pp=2 × cp=2: LFM2-MoE's first stage holds its convolution layer and no attention, so its graph has no
    position ids to tell the shard's length from; the convolution was left on the shard (a gradient 110%
    off, silently). The stage's token ids tell it now; loss and every gradient as the dense model's."""
    from moe_compile.families import sweep_worker

    for rank, results in enumerate(run_ranks(sweep_worker, 4, ["lfm2_moe"], "pp=2,cp=2")):
        assert [r.status for r in results] == ["compiled"], (rank, [r.summary() for r in results])


SINK_CASES = {"core": (("gpt_oss", "gpt_oss", False), ("gpt_oss_padded", "gpt_oss", True)),
              "rest": (("mimo_v2_flash", "mimo_v2_flash", False), ("granitemoe_swa", "granitemoe_swa", False))}


def sinks_worker(rank: int, world: int, part: str) -> dict:
    """cp=2, sliding window 4 over 32 tokens: attention with sinks (no SDPA form in transformers) as
    moe_cp::sink_attention: GPT-OSS (sliding and full layers alternate), on a left-padded batch too,
    MiMo-V2-Flash (sinks on its sliding layers only, value heads narrower than the query's) and
    GraniteMoE-SWA (the sink as a sigmoid scale of the output)."""
    return _padded_cases(world, 8, SINK_CASES[part], sliding_window=4)


@pytest.mark.parametrize("part", core_and_rest("core", "rest"))
def test_cp2_attention_with_sinks(part):
    """Refused before: attention with sinks (GPT-OSS, MiMo-V2-Flash, GraniteMoE-SWA, Flint) under context
    parallelism, as their eager matmul-softmax form has no SDPA node to shard. Under cp > 1 the model runs
    it as one op the CP pass gathers K/V for (models/hf_sinks.py); loss and every gradient (the sinks' too)
    as the dense model's eager attention, with windows and padding."""
    for out in run_ranks(sinks_worker, 2, part):
        for case, (got, want, err) in out.items():
            assert abs(got - want) <= TOL * abs(want) and err <= TOL, (case, got, want, err)


def indexed_worker(rank: int, world: int, part: str) -> dict:
    """cp=2, each query's indexer picking 4 of 32 keys (the tiny configs' index_topk): DeepSeek-V3.2 on a plain
    and a left-padded batch, HY-V4 (its second layer reuses the first layer's picks) and Dots3-Note (an
    indexed layer beside a sliding one of window 4, and of window 64, where transformers makes that layer
    no mask); the dense loss of DeepSeek-V3.2 with all 32 keys picked. ``part``: "core" DeepSeek-V3.2, "rest"
    the others and Qwen4-Exp (below)."""
    from moe_compile.models.hf import tiny_family_model

    b = make_batches(1, 2, 32, seed=11)[0]
    if part == "core":
        out = _padded_cases(world, 11, (("deepseek_v32", "deepseek_v32", False),
                                        ("deepseek_v32_padded", "deepseek_v32", True)))
        for topk in (4, 32):
            m = tiny_family_model("deepseek_v32", seed=0, index_topk=topk)
            x = b % m.config.vocab_size
            out[f"dense_{topk}"] = m(input_ids=x, labels=x, use_cache=False).loss.item()
        return out
    out = _padded_cases(world, 11, (("hy_v4", "hy_v4", False), ("dots3_note_text_wide", "dots3_note_text", False)))
    out.update(_padded_cases(world, 11, (("dots3_note_text", "dots3_note_text", False),), sliding_window=4))
    qsa = {"layer_types": ["indexed_attention"] * 2}  # (its delta-rule layers: within fp32's error of the CP sums)
    out.update(_padded_cases(world, 11, (("qwen4_exp", "qwen4_exp_text", False),
                                         ("qwen4_exp_padded", "qwen4_exp_text", True)), **qsa))
    for budget in (8, 32):
        m = tiny_family_model("qwen4_exp_text", seed=0, indexer_budget=budget, **qsa)
        x = b % m.config.vocab_size
        out[f"qsa_dense_{budget}"] = m(input_ids=x, labels=x, use_cache=False).loss.item()
    return out


# DeepSeek-V4's tiny config with its compressed layers at work over 32 tokens: layer 0 HCA (windows of 8),
# layer 1 CSA (windows of 4, each entry also reading the previous window's half; its indexer keeps 2 entries
# of up to 8 per query), both over a sliding window of 8 keys (the tiny defaults: HCA 128, window 64)
V4_COMPRESSED = dict(compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                     sliding_window=8, index_topk=2)


def compressed_worker(rank: int, world: int, part: str) -> dict:
    """cp=2: DeepSeek-V4 (V4_COMPRESSED). "core": a plain batch, the dense losses with each feature taken
    away (all entries picked, no window, no entry closed), and the shapes of the indexer's scores and of
    what is all-gathered in the compiled forward; "rest": a left-padded batch, one without a window (no
    mask made), one whose HCA windows (16) are longer than the chunks (8 tokens: pooled whole), and the
    compressors pooling without their halo windows and on the shard alone (models/hf_compressed.py)."""
    from unittest import mock

    from moe_compile.models import hf_compressed
    from moe_compile.models.hf import tiny_family_model

    if part == "core":
        out = _padded_cases(world, 11, (("deepseek_v4", "deepseek_v4", False),), **V4_COMPRESSED)
        b = make_batches(1, 2, 32, seed=11)[0]
        away = {"all_picked": dict(index_topk=32), "no_window": dict(sliding_window=64),
                "no_entries": dict(compress_rates={k: 64 for k in V4_COMPRESSED["compress_rates"]})}
        for name, kw in {"dense": {}, **away}.items():
            m = tiny_family_model("deepseek_v4", seed=0, **{**V4_COMPRESSED, **kw})
            x = b % m.config.vocab_size
            out[name] = m(input_ids=x, labels=x, use_cache=False).loss.item()
        cm = moe_compile(tiny_family_model("deepseek_v4", seed=0, **V4_COMPRESSED), MeshSpec.parse("cp=2").resolve(world))
        x = b % cm.model.config.vocab_size
        cm(input_ids=x, labels=x, use_cache=False)
        # the indexer's scores [B, queries, index heads, T entries] (T = 32 / 4 CSA windows)
        score = (cm.model.config.index_n_heads, 32 // V4_COMPRESSED["compress_rates"]["compressed_sparse_attention"])
        nodes = cm.program.graphs["forward"].graph.nodes
        vals = [n.meta.get("val") for n in nodes]
        out["index_scores"] = sorted({tuple(v.shape) for v in vals if isinstance(v, torch.Tensor) and v.dim() == 4
                                      and tuple(v.shape[2:]) == score})
        out["gathered"] = sorted({tuple(n.args[0].meta["val"].shape) for n in nodes
                                  if n.target is torch.ops.moe_cp.all_gather.default})
        out["exchanged"] = sorted({tuple(n.args[0].meta["val"].shape) for n in nodes
                                   if n.target is torch.ops.moe_cp.halo_exchange.default})
        out["head_dims"] = (cm.model.config.head_dim, cm.model.config.index_head_dim)
        cm.close()
        return out
    out = _padded_cases(world, 11, (("deepseek_v4_padded", "deepseek_v4", True),), **V4_COMPRESSED)
    # a window longer than the sequence and no padding: transformers makes no mask (models/hf_compressed._a_mask)
    out.update(_padded_cases(world, 11, (("deepseek_v4_no_mask", "deepseek_v4", False),),
                             **{**V4_COMPRESSED, "sliding_window": 64}))
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}
    out.update(_padded_cases(world, 11, (("hca_pooled_whole", "deepseek_v4", False),),
                             **{**V4_COMPRESSED, "compress_rates": rates}))
    forms = hf_compressed._pooling_forms
    with mock.patch.object(hf_compressed, "_pooling_forms", lambda c: {k: (m, d, False) for k, (m, d, _) in forms(c).items()}):
        out["no_halo"] = _padded_cases(world, 11, (("no_halo", "deepseek_v4", False),), **V4_COMPRESSED)["no_halo"]
    with mock.patch.object(hf_compressed, "_pools_shard", lambda shard, rates: False), \
            mock.patch.object(hf_compressed, "_whole_projection", lambda m, args, y: None):
        out["on_shard"] = _padded_cases(world, 11, (("on_shard", "deepseek_v4", False),), **V4_COMPRESSED)["on_shard"]
    return out


@pytest.mark.parametrize("part", core_and_rest("core", "rest"))
@pytest.mark.long(2)
def test_cp2_compressed_attention(part):
    """Refused before: DeepSeek-V4's compressed attention layers (CSA and HCA) under context parallelism, as
    each module's compressor pools windows of the tokens it is given and its indexer picks among those
    entries. Under cp > 1 each rank pools its own chunks' windows (CSA's after the window before each chunk)
    and gathers the entries, or, where a chunk holds no whole windows, pools the whole sequence's
    projections; its indexer scores this shard's queries, and the attention reads the entries after the
    whole sequence's sliding keys (models/hf_compressed.py). Loss and every gradient as the dense model's, on
    a left-padded batch too; the indexer scores this shard's queries only, and no projection is gathered
    whole. Without the halo windows the gradients were 58% off, with the compressor pooling the shard
    alone 485%."""
    for out in run_ranks(compressed_worker, 2, part):
        if part == "core":
            # the indexer scores this shard's 16 queries of 32 (2 sequences, 4 index heads, 8 CSA entries);
            # when the compressor ran on the whole sequence, all 32 on every rank
            assert out.pop("index_scores") == [(2, 32 // 2, 4, 8)], out
            hd, ihd = out.pop("head_dims")
            # all-gathered: the positions [B, S/cp], each layer's sliding keys [B, 1, S/cp, hd], HCA's 32/8/2
            # entries and CSA's (and its indexer's) 32/4/2 per rank; not the projections [B, S/cp, 2·hd].
            # From the neighbouring ranks: CSA's halos [2 chunks, B, m = 4, 2·hd] (the window before each
            # chunk, both projections)
            assert hd == ihd == 16, (hd, ihd)  # the tiny config's, which the shapes below spell out
            assert out.pop("gathered") == sorted({(2, 16), (2, 1, 16, hd), (2, 2, hd), (2, 4, hd)}), out
            assert out.pop("exchanged") == [(2, 2, 4, 2 * hd)], out
            dense = out.pop("dense")
            for feature in ("all_picked", "no_window", "no_entries"):  # each changes the loss: the case tests it
                assert abs(out.pop(feature) - dense) > 1e-3, (feature, dense, out)
        else:
            for wrong in ("no_halo", "on_shard"):  # wrong without them, so the hooks are what make it right
                got, want, err = out.pop(wrong)
                assert err > 0.5, (wrong, got, want, err)
        for case, (got, want, err) in out.items():
            assert abs(got - want) <= TOL * abs(want) and err <= TOL, (case, got, want, err)


def linear_worker(rank: int, world: int, cp: int = 2, part: str = "all") -> dict:
    """cp=2 (or 4), 32 tokens: linear-attention layers beside attention layers, passing states between the
    ranks' sequence chunks. Delta rules: Kimi-Linear (Kimi delta attention with short convolutions, MLA
    attention without positions) on a plain and a left-padded batch, Lara (gated delta rule beside
    sliding-window layers); MiniMax's lightning attention (one decay per head) on both batches. At cp=4 the
    padded batches (their states pass over 8 chunks, 2 wholly padding) and Lara, and Kimi-Linear at
    cp=2 × ep_mp=2; at cp=2 also MiniMax with its state passing taken away: the whole-sequence fallback
    (models/hf_mixers.py). ``whole``: the mixers each program runs whole. (Qwen3-Next and Qwen3.5-MoE are
    within fp32's error of the CP order of sums, not of one dense pass, at 1e-5: the families sweep checks
    them so.) ``part`` at cp=2: "core" Kimi-Linear and MiniMax padded, "rest" Lara, MiniMax plain and the
    fallback; "all" both."""
    from unittest import mock

    from moe_compile.models import hf_state_passing
    from moe_compile.models.hf import tiny_family_model

    cases = (("kimi_linear", "kimi_linear", False), ("kimi_linear_padded", "kimi_linear", True),
             ("lara_mini", "lara_mini", False), ("minimax", "minimax", False), ("minimax_padded", "minimax", True))
    if cp == 4:
        cases = (*cases[1:3], cases[4])
    elif part != "all":
        cases = [c for c in cases if (c[0] in ("lara_mini", "minimax")) == (part == "rest")]
    out = _padded_cases(world, 12, cases, mesh=f"cp={cp}")
    if cp == 4:  # the same four ranks as cp=2 × ep_mp=2: every rank's program must match its EP group's
        out.update(_padded_cases(world, 12, (("kimi_linear_ep", "kimi_linear", False),), mesh="cp=2,ep_mp=2"))
    spec = MeshSpec.parse(f"cp={cp}").resolve(world)
    for family in ("kimi_linear", "minimax") if part != "rest" else ():
        cm = moe_compile(tiny_family_model(family, seed=0), spec)
        out[f"whole {family}"] = cm.program.cp_whole_mixers
        cm.close()
    if cp == 2 and part != "core":
        with mock.patch.object(hf_state_passing, "use_lightning_states", lambda m, cp, path: False):
            out.update(_padded_cases(world, 12, (("minimax_whole", "minimax", True),)))
            cm = moe_compile(tiny_family_model("minimax", seed=0), spec)
            out["whole minimax_whole"] = cm.program.cp_whole_mixers
            cm.close()
    return out


def _check_linear(out: dict) -> None:
    assert out.pop("whole kimi_linear", ()) == (), out  # its delta rule passes states: sharded
    assert out.pop("whole minimax", ()) == (), out  # lightning attention passes states: sharded
    if "whole minimax_whole" in out:  # without its state passing: the fallback runs the mixer whole
        assert out.pop("whole minimax_whole") == ("model.layers.1.self_attn",), out
    for case, (got, want, err) in out.items():
        assert abs(got - want) <= TOL * abs(want) and err <= TOL, (case, got, want, err)


@pytest.mark.parametrize("part", core_and_rest("core", "rest"))
@pytest.mark.long(2)
def test_cp2_linear_attention(part):
    """Refused before: linear-attention layers under context parallelism (their state runs from token to
    token across the shards). A delta rule runs on each rank's own chunks from the states they enter with,
    scanned over the CP group's chunk summaries (models/hf_state_passing.py); MiniMax's lightning attention
    (ran whole before 2026-12-07) runs its module's forward on its chunks from the states they enter with
    (models/hf_lightning_states.py); a mixer that passes no states runs on the CP group's gathered input in
    sequence order and keeps this rank's tokens (models/hf_mixers.py). Loss and every gradient as the dense
    model's, so each chunk gets the gradient that later chunks send back (with zero entering states
    Kimi-Linear's loss was 1.5e-3 off, its gradients 110%; MiniMax's gradients 81% and 95% off)."""
    for out in run_ranks(linear_worker, 2, 2, part):
        _check_linear(out)


@pytest.mark.slow
def test_cp4_linear_attention_passes_states_over_eight_chunks():
    """cp=4: each rank's two chunks of 4 tokens enter with the states scanned over all 8 chunks (delta rules,
    lightning attention and Mamba scans; left-padded batches, 2 of whose chunks are wholly padding). And
    cp=2 × ep_mp=2, whose EP groups span CP ranks: their programs differed (a rank's dead scan steps were
    eliminated), a RuntimeFault "lease plans differ between the ranks of the EP group"."""
    for out in run_ranks(linear_worker, 4, 4):
        _check_linear(out)
    for out in run_ranks(mamba_worker, 4, 4):  # Mamba-2's chunks of 4 tokens: shorter than its scan's 16
        _check_mamba(out)


def mamba_worker(rank: int, world: int, cp: int = 2, part: str = "all") -> dict:
    """cp=2 (or 4), 32 tokens: Mamba layers beside attention and MoE layers, their scans sharded with states
    passed between the ranks' chunks. Jamba (Mamba-1: per-channel decays, associative_scan under vmap) on a
    plain and a left-padded batch; Mamba-2 in Nemotron-H (left-padded) and GraniteMoE-Hybrid. ``whole``:
    the mixers each program runs whole. ``part`` at cp=2: "core" Jamba, "rest" Mamba-2; "all" both."""
    from moe_compile.models.hf import tiny_family_model

    cases = (("jamba", "jamba", False), ("jamba_padded", "jamba", True), ("nemotron_h_padded", "nemotron_h", True),
             ("granitemoehybrid", "granitemoehybrid", False))
    if cp == 4:  # the padded ones
        cases = cases[1:3]
    elif part != "all":
        cases = [c for c in cases if (c[1] == "jamba") == (part == "core")]
    out = _padded_cases(world, 12, cases, mesh=f"cp={cp}")
    spec = MeshSpec.parse(f"cp={cp}").resolve(world)
    for family in sorted({family for _, family, _ in cases}):
        cm = moe_compile(tiny_family_model(family, seed=0), spec)
        out[f"whole {family}"] = cm.program.cp_whole_mixers
        cm.close()
    return out


def _check_mamba(out: dict) -> None:
    for key in [k for k in out if k.startswith("whole ")]:
        assert out.pop(key) == (), (key, out)  # its scan passes states: sharded
    for case, (got, want, err) in out.items():
        assert abs(got - want) <= TOL * abs(want) and err <= TOL, (case, got, want, err)


@pytest.mark.parametrize("part", core_and_rest("core", "rest"))
@pytest.mark.long
def test_cp2_mamba_layers_pass_states(part):
    """Refused before (Jamba, GraniteMoE-Hybrid) or run on the whole sequence (Nemotron-H's mixer): Mamba
    layers under context parallelism. Each rank scans its own chunks from a zero state, and adds what the
    state each chunk enters with contributes (its decays from the same discretised steps), the states
    scanned over the CP group's chunk summaries with diagonal transitions (models/hf_mamba_states.py).
    Loss and every gradient as the dense model's; with the entering states zeroed the gradients were 14%
    (GraniteMoE-Hybrid) to 99% (Jamba) off."""
    for out in run_ranks(mamba_worker, 2, 2, part):
        _check_mamba(out)


@pytest.mark.parametrize("part", core_and_rest("core", "rest"))
def test_cp2_indexed_attention(part):
    """Refused before: DeepSeek-V3.2's sparse attention (an indexer's top-k keys per query) under context
    parallelism, as each module builds its index mask over the keys it holds. Under cp > 1 the module takes
    the whole sequence's keys and mask in sequence order (models/hf_indexed.py), so the indexer picks over
    all 32 keys as on one device; loss and every gradient as the dense model's, with padding, a layer that
    reuses the picks and a sliding layer beside. HY-V4's attention has sinks too, which run as the sink
    implementation (models/hf_sinks.py): transformers hands it the picks as `indices`, which it dropped.
    Qwen4-Exp's QSA indexer (2 blocks of 4 keys per query, plus its incomplete tail), plain and
    left-padded: its static form (models/hf_qsa.py) pools the whole sequence's keys at their positions."""
    for out in run_ranks(indexed_worker, 2, part):
        if part == "core":
            assert abs(out.pop("dense_4") - out.pop("dense_32")) > 1e-3, out  # the picks change the loss
        else:
            assert abs(out.pop("qsa_dense_8") - out.pop("qsa_dense_32")) > 1e-3, out  # Qwen4-Exp's QSA picks too
        for case, (got, want, err) in out.items():
            assert abs(got - want) <= TOL * abs(want) and err <= TOL, (case, got, want, err)


def mixed_batches_worker(rank: int, world: int) -> list:
    """cp=2, forward only: rank 1 passes another batch than rank 0 (a loader sharded by global rank)."""
    spec = MeshSpec.parse("cp=2").resolve(world)
    cm = moe_compile(_model("olmoe"), spec)
    b = make_batches(2, 2, 16, seed=4)[rank]
    out = []
    try:
        cm(input_ids=b, labels=b)
    except OptionError as e:
        out.append(str(e))
    same = make_batches(2, 2, 16, seed=4)[0]
    out.append(cm(input_ids=same, labels=same).loss.item())  # the next call runs
    cm.close()
    return out


def test_cp_forward_refuses_different_batches_in_a_cp_group():
    """cm(...) at cp=2 with a different batch on each rank attended across the two sequences and returned a
    loss of a mix of them, without an error (train_step compared batches; a plain forward did not)."""
    results = run_ranks(mixed_batches_worker, 2)
    for r in results:
        assert "the ranks of this context-parallel group passed different batches" in r[0], r
    assert results[0][1] == results[1][1]


def no_positions_worker(rank: int, world: int) -> dict:
    """cp=2: Nemotron-H (NoPE attention: reads no position ids) against the dense model; Qwen3-MoE with the
    position_ids it is given dropped (transformers then makes them from the length it sees, the shard's)."""
    from moe_compile.models.hf import tiny_family_model

    spec = MeshSpec.parse("cp=2").resolve(world)
    out = {}
    model = tiny_family_model("nemotron_h", seed=0)
    b = make_batches(1, 2, 16, seed=6)[0] % model.config.vocab_size
    out["nope"] = against_dense(model, spec, input_ids=b, labels=b)

    def refusal(model: nn.Module, batch: torch.Tensor) -> str | None:
        try:
            cm = moe_compile(model, spec)
        except UnsupportedFeatureError as e:  # refused before anything is built
            return str(e)
        try:
            cm(input_ids=batch, labels=batch)
        except UnsupportedFeatureError as e:
            return str(e)
        finally:
            cm.close()
        return None

    model = tiny_family_model("qwen3_moe", seed=0)
    inner = model.model.forward
    model.model.forward = lambda *a, position_ids=None, **kw: inner(*a, **kw)
    out["refused"] = refusal(model, b)
    biased = _model("tiny")  # attention with an additive bias (ALiBi-like) through SDPA's attn_mask
    attn = biased.layers[0].attn

    def with_bias(x):
        bsz, s, d = x.shape
        q, k, v = attn.qkv(x).view(bsz, s, 3, attn.n_heads, d // attn.n_heads).permute(2, 0, 3, 1, 4)
        i = torch.arange(s, dtype=x.dtype)
        bias = (-(i[:, None] - i[None, :]).abs()).masked_fill(i[None, :] > i[:, None], float("-inf"))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return attn.proj(o.transpose(1, 2).reshape(bsz, s, d))

    attn.forward = with_bias
    out["bias"] = refusal(biased, b)
    for case in ("eager", "sinks"):  # one layer of the user's own in the matmul-softmax form, with sinks or not
        model = _model("tiny")
        attn = model.layers[0].attn
        attn.sinks = nn.Parameter(torch.zeros(attn.n_heads))

        def eager(x, attn=attn, sinks=case == "sinks"):
            bsz, s, d = x.shape
            q, k, v = attn.qkv(x).view(bsz, s, 3, attn.n_heads, d // attn.n_heads).permute(2, 0, 3, 1, 4)
            w = (q @ k.transpose(-1, -2)).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
            if sinks:
                w = torch.cat([w, attn.sinks.view(1, -1, 1, 1).expand(bsz, -1, s, 1)], -1)
            p = w.softmax(-1)[..., :s]
            return attn.proj((p @ v).transpose(1, 2).reshape(bsz, s, d))

        attn.forward = eager
        out[case] = refusal(model, b)
    return out


@pytest.mark.long
def test_cp2_models_without_position_ids():
    """Refused before: a model that reads no position ids (NoPE attention, as Nemotron-H's) is exact under
    CP; the causal mask takes the shard's global positions. One that makes positions from the length it
    sees is still refused, naming the arange; an additive float mask given to SDPA (a bias the whole
    sequence's causal mask replaced, silently) is refused, as is a layer of the model's own attending by
    matmul-softmax beside SDPA layers (it ran on the shard alone, silently), with sinks or not."""
    for out in run_ranks(no_positions_worker, 2):
        got, want, err = out["nope"]
        assert abs(got - want) <= TOL * abs(want) and err <= TOL, out
        assert "reads none and makes positions from the length it sees (arange(8)" in out["refused"], out
        assert out["bias"].startswith("layers.0.attn: attention with an additive torch.float32 mask"), out
        assert out["eager"].startswith("layers.0.attn: attention computed as matmul-softmax"), out
        assert out["sinks"].startswith("layers.0.attn: attention with sinks (a learned per-head logit beside the "
                                       "keys) computed as matmul-softmax"), out


def test_attention_without_an_sdpa_form_is_refused_before_any_stage_is_built():
    """A transformers model with no SDPA form (_supports_sdpa=False) and no sinks (which run as
    moe_cp::sink_attention) is refused from the model before anything is built: at pp=2 × cp=2 a stage
    without such attention was once refused with the advice to run attention through SDPA, which the
    model cannot do. Models with sinks pass the check."""
    from moe_compile.models.hf import tiny_family_model

    spec = MeshSpec.parse("pp=2,cp=2").resolve(4)
    model = tiny_family_model("mixtral", seed=0)
    model._supports_sdpa = False
    with pytest.raises(UnsupportedFeatureError) as e:
        _check_context_parallel(model, spec)
    assert str(e.value).startswith("MixtralForCausalLM: attention (the model declares _supports_sdpa=False"), e.value
    for family in ("mimo_v2_flash", "gpt_oss"):
        _check_context_parallel(tiny_family_model(family, seed=0), spec)


def test_a_kv_cache_passed_as_cache_is_refused():
    """transformers 5.x names the cache argument `cache`: passed so, it reached the model, which filled it
    with this rank's keys (checked were use_cache, past_key_values and cache_position only)."""
    from transformers import DynamicCache

    from moe_compile.runtime.context_parallel import shard_batch

    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(OptionError, match="a KV cache"):
        shard_batch({"input_ids": ids, "cache": DynamicCache()}, 2, 0)
    assert shard_batch({"input_ids": ids, "cache": None}, 2, 0)["input_ids"].shape == (2, 4)


@pytest.mark.long
def test_context_parallel_bad_input_is_a_clear_error():
    for rank, (msgs, (whole, as_tuple, want, given)) in enumerate(run_ranks(bad_cp_worker, 2)):
        assert len(msgs) == 12, msgs
        assert msgs[0] <= TOL * 6, msgs[0]  # the dense model's loss (≈ 5.5), its blocks' aux losses included
        assert msgs[1] == "accepted at pp > 1"
        assert "layers of kind ['linear_attention']" in msgs[2]
        assert "layers of kind ['indexed_attention']" in msgs[3]
        assert "layers.0.mix is a convolution" in msgs[4]
        assert "sequence length 10 is not divisible by 2·cp = 4" in msgs[5]
        assert "attention_mask must be the 2-D padding mask of input_ids' shape (2, 8) (got (2, 1, 8, 8))" in msgs[6]
        assert "position_ids must have input_ids' shape (2, 8) (got shape (2, 6))" in msgs[7]
        assert "a KV cache (use_cache=True" in msgs[8]
        assert "['token_type_ids'] ((2, 8)) look per-token and would not be sharded" in msgs[9]
        assert ("attention_mask must be the 2-D" if rank == 1 else "rank 1 refused its batch") in msgs[10], msgs[10]
        assert "no rank started the step" in msgs[10], msgs[10]
        assert msgs[11] <= TOL, msgs[11]  # the next step: the dense model's loss on every CP rank
        assert as_tuple == whole, (as_tuple, whole)
        assert abs(given - want) <= 1e-5 * abs(want), (given, want)


@pytest.mark.slow
def test_train_cp2_then_resume_on_cp1(tmp_path):
    """OLMoE trained 2 steps on cp=2 × ep_mp=2 (optimizer, clipping), resumed on one rank: every step's
    loss and gradient norm follow the one-rank run (same data: a CP group shares its replica's batch)."""
    cli_train(tmp_path, 1, "dp=1", 4, "ref.jsonl", "--hf", "olmoe")
    cli_train(tmp_path, 2, "cp=2,ep_mp=2", 2, "run.jsonl", "--hf", "olmoe", "--ckpt", str(tmp_path / "ck"))
    out = cli_train(tmp_path, 1, "dp=1", 4, "run.jsonl", "--hf", "olmoe", "--ckpt", str(tmp_path / "ck"), "--resume")
    assert "resumed from" in out, out
    got, want = metric_rows(tmp_path / "run.jsonl"), metric_rows(tmp_path / "ref.jsonl")
    assert [s for s, _, _ in got] == [1, 2, 3, 4]
    for (s, loss, norm), (_, rl, rn) in zip(got, want):
        assert abs(loss - rl) <= 1e-5 * abs(rl) and abs(norm - rn) <= 1e-4 * abs(rn), (s, loss, rl, norm, rn)


def capture_refusal_worker(rank: int, world: int) -> list[str]:
    """Refusals the CP pass raises while the graph is captured (inside dynamo's backend call): eager
    attention (no SDPA to rewrite; also beside linear-attention layers) and attention dropout. They came out
    as dynamo's BackendCompilerFailed, not the moe_compile error inside it."""
    spec = MeshSpec.parse("cp=2").resolve(world)
    x = make_batches(1, 2, 8, seed=2)[0]
    out = []
    for kw in ({"attn_implementation": "eager"}, {"attention_dropout": 0.1}):
        model = build_model("olmoe")
        if "attn_implementation" in kw:
            model.config._attn_implementation = kw["attn_implementation"]
        else:
            for mod in model.modules():  # the attention modules read it from the config when built
                if hasattr(mod, "attention_dropout"):
                    mod.attention_dropout = kw["attention_dropout"]
            model.train()  # HF passes dropout_p to SDPA only in training mode
        cm = moe_compile(model, spec)
        try:
            cm(input_ids=x, labels=x).loss.backward()
            out.append("no error")
        except Exception as e:  # noqa: BLE001 - the test checks its type
            out.append(f"{type(e).__name__}: {e}")
        cm.close()
    from moe_compile.models.hf import tiny_family_model

    # linear-attention layers (run on the whole sequence) beside eager attention, which would see the shard
    # alone: the graph has no SDPA node, and it ran silently before
    model = tiny_family_model("kimi_linear", seed=0)
    model.config._attn_implementation = "eager"
    cm = moe_compile(model, spec)
    try:
        cm(input_ids=x, labels=x, use_cache=False)
        out.append("no error")
    except Exception as e:  # noqa: BLE001 - the test checks its type
        out.append(f"{type(e).__name__}: {e}")
    cm.close()
    return out


def test_refusals_found_while_capturing_are_moe_compile_errors():
    for msgs in run_ranks(capture_refusal_worker, 2):
        assert msgs[0].startswith("UnsupportedFeatureError") and "rewrites scaled_dot_product_attention" in msgs[0], msgs
        assert msgs[1].startswith("UnsupportedFeatureError") and "attention dropout 0.1" in msgs[1], msgs
        assert msgs[2].startswith("UnsupportedFeatureError: model.layers.1.self_attn: attention computed as "
                                  "matmul-softmax"), msgs


def same_batch_worker(rank: int, world: int) -> list:
    out = []
    for mesh, opts in (("cp=2", {}), ("pp=2", {"microbatches": 2})):
        model = _model("olmoe")
        dense = copy.deepcopy(model)
        cm = moe_compile(model, MeshSpec.parse(mesh).resolve(world), **opts)
        mine = make_batches(2, 2, 8, seed=5)[rank]  # a loader sharded by global rank: each rank its own batch
        try:
            cm.train_step(input_ids=mine, labels=mine)
        except OptionError as e:
            out.append(str(e))
        same = make_batches(2, 2, 8, seed=5)[0]  # then the same batch: the step runs and is the dense model's
        loss = cm.train_step(input_ids=same, labels=same).item()
        out.append(abs(loss - dense(input_ids=same, labels=same).loss.item()) / abs(loss))
        cm.close()
    return out


def test_ranks_of_one_pipeline_or_cp_group_pass_the_same_batch():
    """Each rank of a CP group or a pipeline passing its own batch trained on a mix of them (one batch's
    shard attending to another's; stage 0's ids with the last stage's labels) with no error. Refused on
    every rank now, and the next step is clean."""
    for msgs in run_ranks(same_batch_worker, 2):
        assert len(msgs) == 4, msgs
        for m in (msgs[0], msgs[2]):
            assert "pipeline or context-parallel group passed different batches" in m and "no rank started" in m
        assert msgs[1] <= TOL and msgs[3] <= TOL, msgs


class _OwnAuxLoss(nn.Module):
    """A model that computes its own load-balancing term, not through transformers' function."""

    def forward(self, input_ids, labels=None, output_router_logits=False, **kwargs):
        aux_loss = input_ids.float().mean()
        return aux_loss


def test_load_balancing_loss_the_cp_group_cannot_gather_is_named():
    """cp_balance_loss wraps transformers' load_balancing_loss_func; a forward that assigns an aux_loss
    without it would use a shard's statistics, so output_router_logits is refused for it (accepted for
    every transformers family that computes the loss through the function, or none)."""
    from moe_compile.models.hf import tiny_family_model
    from moe_compile.runtime.cp_balance_loss import unsupported_balance_loss

    why = unsupported_balance_loss(_OwnAuxLoss())
    assert why and "_OwnAuxLoss.forward computes an aux_loss without transformers' load_balancing_loss_func" in why
    for family in ("olmoe", "deepseek_v3", "hy_v3"):  # the function; no loss at all; "aux_loss=None"
        assert unsupported_balance_loss(tiny_family_model(family)) is None, family


def lb_variants_worker(rank: int, world: int) -> dict:
    from transformers import OlmoeForCausalLM

    class MyOlmoeForCausalLM(OlmoeForCausalLM):  # a user's subclass: its forward's module has no load_balancing_loss_func
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    base = build_model("olmoe_aux")
    model = MyOlmoeForCausalLM(base.config)
    model.load_state_dict(base.state_dict())
    dense = copy.deepcopy(model)
    b = make_batches(1, 2, 16, seed=4)[0] % model.config.vocab_size
    want = dense(input_ids=b, labels=b)
    cm = moe_compile(model, MeshSpec.parse("cp=2").resolve(world))
    got = cm(input_ids=b, labels=b)
    tup = cm(input_ids=b, labels=b, return_dict=False)
    tup_nolab = cm(input_ids=b, return_dict=False)
    cm.close()
    return {"loss": (got.loss.item(), want.loss.item()), "aux": (got.aux_loss.item(), want.aux_loss.item()),
            "tuple": (tup[0].item(), tup[1].item()), "tuple_aux_only": tup_nolab[0].item()}


@pytest.mark.long
def test_load_balancing_loss_of_a_subclass_and_as_a_tuple():
    """Found in review: a subclass of a transformers CausalLM (its forward's module holds no
    load_balancing_loss_func) ran its parent's on each shard, aux 4.12 for 2.06; return_dict=False left
    each rank's aux/cp in the tuple (1.03). Both are the whole sequences' now."""
    for r in run_ranks(lb_variants_worker, 2):
        (loss, want), (aux, want_aux) = r["loss"], r["aux"]
        assert abs(loss - want) <= TOL * want and abs(aux - want_aux) <= TOL * want_aux, r
        assert abs(r["tuple"][0] - want) <= TOL * want and abs(r["tuple"][1] - want_aux) <= TOL * want_aux, r
        assert abs(r["tuple_aux_only"] - want_aux) <= TOL * want_aux, r


def test_the_matmul_softmax_guard_asks_for_scores_of_a_product():
    """The guard against attention computed as matmul-softmax on a shard looked at shapes alone: DeepSeek-V4's
    hyper-connections softmax a [B, S/cp, 4, 4] mixing matrix viewed from a linear layer's output, so at
    S/cp = 4 (the families sweep's 16 tokens at cp=4) the model was refused. Scores made by a product of
    the shard's queries and keys, [B, H, S/cp, S/cp], still are."""
    from torch.fx.passes.shape_prop import ShapeProp

    from moe_compile.passes.context_parallel import _refuse_eager_attention

    class Mixing(nn.Module):  # the hyper-connections' form
        def __init__(self):
            super().__init__()
            self.fn = nn.Linear(8, 16)

        def forward(self, x):
            return torch.softmax(self.fn(x).view(2, 4, 4, 4) * 2.0 + 1.0, dim=-1)

    class Scores(nn.Module):  # attention's
        def forward(self, q, k):
            return (q @ k.transpose(-1, -2)).softmax(-1)

    def guard(module: nn.Module, path: str, *args) -> None:
        gm = torch.fx.symbolic_trace(module)
        ShapeProp(gm).propagate(*args)
        for n in gm.graph.nodes:
            if "tensor_meta" in n.meta:
                n.meta["val"] = torch.empty(n.meta["tensor_meta"].shape)
            n.meta["nn_module_stack"] = {path: (path, type(module))}
        _refuse_eager_attention(list(gm.graph.nodes), 4, 4)

    guard(Mixing(), "model.layers.0.attn_hc", torch.randn(2, 4, 8))  # not attention: no error
    with pytest.raises(UnsupportedFeatureError, match="attention computed as matmul-softmax under context parallelism"):
        guard(Scores(), "model.layers.0.self_attn", torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8))
