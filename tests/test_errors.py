"""Bad input gets a clear error naming the thing and the rule — never a silent fallback."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from moe_compile import MeshSpec, moe_compile
from moe_compile.errors import MeshError, OptionError, RecognitionError, UnsupportedFeatureError
from moe_compile.models import MoEFeedForward, TinyMoEConfig

from .common import assert_step_matches_dense, build_model, make_batches, rel_err
from .harness import run_ranks

# -- meshes ----------------------------------------------------------------------------------------


def test_dense_and_moe_pools_must_match():
    with pytest.raises(MeshError, match=r"dp·cp \(4·1 = 4\) must equal ep_dp·ep_mp \(2·4 = 8\)"):
        MeshSpec(dp=4, ep_dp=2, ep_mp=4).resolve(4)


def test_ep_mp_must_divide_the_pool():
    with pytest.raises(MeshError, match=r"ep_mp=3 does not divide dp·cp = 4·1 = 4"):
        MeshSpec(ep_mp=3).resolve(4)


def test_world_size_must_match_mesh():
    with pytest.raises(MeshError, match=r"pp·dp·cp = 1·4·1 = 4 ranks, but the world has 2"):
        MeshSpec(dp=4).resolve(2)
    with pytest.raises(MeshError, match="the world has 1"):
        moe_compile(build_model("tiny"), MeshSpec(dp=2))  # single process, no torch.distributed


def test_derived_degrees_and_parse():
    m = MeshSpec.parse("dp=4,ep_mp=2").resolve(4)
    assert (m.dp, m.cp, m.pp, m.ep_dp, m.ep_mp) == (4, 1, 1, 2, 2)
    assert MeshSpec.parse("ep_mp=4").resolve(8).ep_dp == 2
    assert MeshSpec.parse("pp=2 cp=2").resolve(8).dp == 2
    assert m.moe_coords(3) == (0, 1, 1) and m.dense_coords(3) == (0, 3, 0)
    with pytest.raises(MeshError, match="cannot read 'tp=2'"):
        MeshSpec.parse("tp=2")
    with pytest.raises(MeshError, match="positive integer"):
        MeshSpec(ep_mp=0)


def bad_compile_worker(rank, world, cases):
    """Try each (model kwargs, mesh) and return the error each raised on this rank."""
    out = []
    for model_kw, mesh in cases:
        try:
            moe_compile(build_model("tiny", **model_kw), MeshSpec.parse(mesh))
            out.append(None)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out.append((type(e).__name__, str(e)))
    return out


@pytest.mark.slow
def test_multi_rank_mesh_errors():
    cases = [({"num_experts": 3, "top_k": 1}, "ep_mp=2"), ({"n_layers": 1}, "pp=2"), ({}, "cp=2")]
    for errors in run_ranks(bad_compile_worker, 2, cases):
        (t0, m0), (t1, m1), ok = errors
        assert t0 == "MeshError" and "layers.0.mlp: 3 routed experts cannot be split evenly over ep_mp=2" in m0
        assert t1 == "OptionError" and "needs microbatches ≥ pp" in m1  # pp=2 with the default m=1
        assert ok is None, ok  # the tiny LM's block aux loss under cp: refused before, the whole sequences' now


# -- models ----------------------------------------------------------------------------------------


def test_no_moe_block():
    with pytest.raises(RecognitionError, match="no MoE block found in Sequential.*does not fall back"):
        moe_compile(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))


def test_router_jitter_is_unsupported():
    model = build_model("mixtral", router_jitter_noise=0.1)
    for layer in model.model.layers:
        layer.mlp.jitter_noise = 0.1
    with pytest.raises(UnsupportedFeatureError, match=r"model\.layers\.0\.mlp: router jitter noise"):
        moe_compile(model)


def test_group_limited_routing_without_topk_group_is_a_clear_error():
    model = build_model("tiny")
    model.layers[0].mlp.n_group = 4  # groups, but nothing says how many a token may use
    with pytest.raises(UnsupportedFeatureError, match=r"layers\.0\.mlp: group-limited routing with n_group=4 "
                                                      r"needs topk_group in 1\.\.4"):
        moe_compile(model)


def test_expert_bias_is_unsupported():
    model = build_model("tiny")
    model.layers[1].mlp.experts[0].w1 = nn.Linear(64, 64, bias=True)
    with pytest.raises(UnsupportedFeatureError, match=r"layers\.1\.mlp\.experts\.0: expert Linear layers with bias"):
        moe_compile(model)


class _ScaledLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def test_expert_parameters_the_compiled_ffn_would_drop_are_refused():
    """An adapter parameter inside an expert, or a Linear with its own forward, would be silently left out
    of the compiled experts (which read only the Linears' weights): refused, named."""
    model = build_model("tiny")
    model.layers[1].mlp.experts[0].lora = nn.Parameter(torch.zeros(4))
    with pytest.raises(UnsupportedFeatureError, match=r"layers\.1\.mlp\.experts\.0: FFN parameters \['lora'\]"):
        moe_compile(model)
    model = build_model("tiny")
    old = model.layers[0].mlp.experts[2].w1
    model.layers[0].mlp.experts[2].w1 = scaled = _ScaledLinear(old.in_features, old.out_features, bias=False)
    scaled.weight.data.copy_(old.weight.data)
    with pytest.raises(UnsupportedFeatureError, match=r"experts\.2: Linear layers with their own forward.*w1 \(_ScaledLinear\)"):
        moe_compile(model)


class _LayerScaled(MoEFeedForward):
    """A learned output scale initialised to ones: the probe's outputs match without it, its gradient would not."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.out_scale = nn.Parameter(torch.ones(cfg.d_model))

    def forward(self, hidden):
        y, aux = super().forward(hidden)
        return y * self.out_scale, aux


def test_a_block_parameter_the_compiled_form_does_not_read_is_refused():
    model = build_model("tiny")
    block = _LayerScaled(TinyMoEConfig(vocab_size=256))
    block.load_state_dict(model.layers[0].mlp.state_dict(), strict=False)
    model.layers[0].mlp = block
    with pytest.raises(UnsupportedFeatureError, match=r"layers\.0\.mlp: not read by the block's compiled form: parameter out_scale \("):
        moe_compile(model)


class _ReturnsProbs(MoEFeedForward):
    """Returns (output, router probabilities): a second output the canonical block would not reproduce."""

    def forward(self, hidden):
        y, _ = super().forward(hidden)
        return y, torch.softmax(self.router(hidden.reshape(-1, hidden.shape[-1])), -1)


class _ReturnsLogits(_ReturnsProbs):
    def forward(self, hidden):
        y, _ = MoEFeedForward.forward(self, hidden)
        return y, self.router(hidden.reshape(-1, hidden.shape[-1]))


def test_a_second_output_other_than_router_logits_is_refused():
    for cls, refused in ((_ReturnsProbs, True), (_ReturnsLogits, False)):
        model = build_model("tiny", lb_coef=0.0, z_coef=0.0)
        block = cls(TinyMoEConfig(vocab_size=256, lb_coef=0.0, z_coef=0.0))
        block.load_state_dict(model.layers[0].mlp.state_dict())
        model.layers[0].mlp = block
        if refused:
            with pytest.raises(UnsupportedFeatureError, match=r"layers\.0\.mlp: forward returns \(output, \(48, 8\) "
                                                              r"tensor\).*not the router's logits"):
                moe_compile(model)
        else:
            assert moe_compile(model).program.blocks["layers.0.mlp"].returns_logits


class OddMoE(MoEFeedForward):
    """Looks like an MoE but scales its output: no supported routing reproduces it."""

    def forward(self, hidden):
        y, aux = super().forward(hidden)
        return 2 * y, aux


def test_block_that_computes_something_else_is_rejected():
    model = build_model("tiny")
    odd = OddMoE(TinyMoEConfig(vocab_size=256))
    odd.load_state_dict(model.layers[0].mlp.state_dict())
    model.layers[0].mlp = odd
    with pytest.raises(RecognitionError, match=r"layers\.0\.mlp: recognised as an MoE block .* no supported routing reproduces"):
        moe_compile(model)


class DataDependent(nn.Module):
    """A dense module branching on how many of its inputs are positive (a size read from tensor values)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if torch.nonzero(x > 0).shape[0] > 3:
            x = x * 2
        return self.inner(x)


def test_data_dependent_control_flow_names_the_module():
    model = build_model("tiny")
    model.layers[0].attn_norm = DataDependent(model.layers[0].attn_norm)
    cm = moe_compile(model)
    ids = make_batches(1)[0]
    with pytest.raises(UnsupportedFeatureError, match=r"layers\.0\.attn_norm \(DataDependent\): data-dependent Python "
                                                      r"control flow .*`if torch\.nonzero"):
        cm(ids)


def data_dependent_worker(rank, world):
    """The same model under a pipeline (its own capture of the whole model) and under context parallelism."""
    out = {}
    for mesh in ("pp=2", "cp=2"):
        model = build_model("tiny", lb_coef=0.0, z_coef=0.0)
        model.layers[0].attn_norm = DataDependent(model.layers[0].attn_norm)
        cm = moe_compile(model, MeshSpec.parse(mesh), **({"microbatches": 2} if mesh == "pp=2" else {}))
        ids = make_batches(1)[0]
        try:
            if mesh == "pp=2":
                cm.train_step(input_ids=ids, labels=ids)
            else:
                cm(input_ids=ids, labels=ids)
            out[mesh] = "no error"
        except UnsupportedFeatureError as e:
            out[mesh] = str(e)
        cm.close()
    return out


def test_data_dependent_control_flow_names_the_module_under_pp_and_cp():
    for r in run_ranks(data_dependent_worker, 2):
        for mesh, msg in r.items():
            assert "layers.0.attn_norm (DataDependent): data-dependent Python control flow" in msg, (mesh, msg)


def test_aux_coefficients_without_aux_output():
    class NoAux(MoEFeedForward):
        def forward(self, hidden):
            return super().forward(hidden)[0]

    model = build_model("tiny")
    blk = NoAux(TinyMoEConfig(vocab_size=256))
    model.layers[0].mlp = blk
    with pytest.raises(RecognitionError, match="returns no aux loss"):
        moe_compile(model)


def test_missing_top_k():
    model = build_model("tiny")
    del model.layers[0].mlp.top_k
    with pytest.raises(RecognitionError, match=r"layers\.0\.mlp: top-k not understood"):
        moe_compile(model)


# -- options ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,match", [
    ({"capacity_factor": -1}, "capacity_factor=-1: must be a positive number"),
    ({"capacity_factor": float("nan")}, "capacity_factor=nan: must be a positive number"),
    ({"capacity_factor": float("inf")}, "capacity_factor=inf: must be a positive number"),
    ({"dropless_headroom": float("nan")}, "dropless_headroom=nan: must be a number ≥ 1"),
    ({"bucket_mb": "25"}, "bucket_mb='25': must be a positive number"),
    ({"transport": "carrier_pigeon"}, "transport='carrier_pigeon'"),
    ({"bogus": 1}, r"unknown moe_compile option\(s\) \['bogus'\]"),
    ({"fullgraph": "no"}, "fullgraph='no': must be True or False"),  # a truthy string was taken as True
    ({"lease_sharing": "no"}, "lease_sharing='no': must be True or False"),
    ({"debug_dir": 123}, "debug_dir=123: must be a directory path"),  # failed inside dynamo's first compile
    ({"debug_dir": __file__}, "exists and is not a directory"),
    ({"pp_split": ["layers.1"]}, r"pp_split=\['layers.1'\]: the mesh has pp=1"),  # silently ignored before
    # options the others leave without effect (accepted silently before)
    ({"capacity_factor": 1.0, "dropless_headroom": 4.0}, "dropless_headroom=4.0 sizes dropless receive buffers"),
    ({"mxfp8_scale_mode": "floor"}, "mxfp8_scale_mode='floor' without mxfp8"),
    ({"debug_pictures": True}, "debug_pictures=True renders the debug dumps, which need debug_dir"),
    ({"schedule": "gpipe"}, "schedule='gpipe': the mesh has pp=1"),
])
def test_bad_options(kw, match):
    with pytest.raises(OptionError, match=match):
        moe_compile(build_model("tiny"), **kw)


def test_defaults_passed_along_are_not_refused():
    """A wrapper that forwards every option at its default (argparse defaults, **asdict(cfg)) is fine: only
    a value the other options would ignore is refused."""
    cm = moe_compile(build_model("tiny"), schedule="1f1b", mxfp8_scale_mode="rceil", dropless_headroom=1.5,
                     capacity_factor=1.25, debug_pictures=False)
    assert cm.program.options.capacity_factor == 1.25
    cm.close()


def test_eager_logical_op_refuses_to_run_partitioned():
    """The logical routed-experts op never silently computes with a subset of experts."""
    from moe_compile.errors import RuntimeFault

    x = torch.randn(4, 8)
    idx = torch.zeros(4, 1, dtype=torch.int64)
    w = torch.ones(4, 1)
    with pytest.raises(RuntimeFault, match="blk: the logical routed-experts op ran un-partitioned with 2 of 4"):
        torch.ops.moe.routed_experts(x, idx, w, torch.randn(2, 16, 8), torch.randn(2, 8, 8), "silu", True, 4, 0, "blk")


class _IndexFirstRouter(nn.Module):
    """A router that returns (top_k_index, top_k_weights, logits), as Granite-MoE's does."""

    def __init__(self, n: int, d: int, k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, d) * 0.1)
        self.top_k = k

    def forward(self, x):
        logits = x @ self.weight.t()
        w, idx = torch.softmax(logits, -1).topk(self.top_k, -1)
        return idx, w, logits


class _FusedExperts(nn.Module):
    def __init__(self, n: int, d: int, h: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(n, 2 * h, d) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(n, d, h) * 0.1)
        self.act_fn = nn.SiLU()

    def forward(self, x, idx, w):
        out = torch.zeros_like(x)
        for k in range(idx.shape[1]):
            for e in range(self.gate_up_proj.shape[0]):
                sel = idx[:, k] == e
                g, u = (x[sel] @ self.gate_up_proj[e].t()).chunk(2, -1)
                out[sel] += w[sel, k, None] * ((self.act_fn(g) * u) @ self.down_proj[e].t())
        return out


class _IndexFirstBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router, self.experts = _IndexFirstRouter(4, 16, 2), _FusedExperts(4, 16, 8)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        idx, w, _ = self.router(x)
        return self.experts(x, idx, w).reshape(shape)


def test_router_returning_another_tuple_order_compiles():
    # Granite-MoE's order (indices, weights, logits): the probe reads the order from what the router
    # returned (integer indices, float [T, N] logits, float [T, K] weights) into RouterSpec.outputs
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _IndexFirstBlock())
    x = torch.randn(2, 5, 16)
    ref = copy.deepcopy(model)
    ref(x).sum().backward()
    cm = moe_compile(model)
    assert cm.blocks["1"].router.outputs == ("indices", "weights", "logits")
    cm(x).sum().backward()
    grads = cm.full_grads()
    for n, p in ref.named_parameters():
        assert (grads[n] - p.grad).abs().max().item() <= 1e-5 * max(p.grad.abs().max().item(), 1e-12), n
    cm.close()


@pytest.mark.parametrize("name,fusion", [("tiny", "none"), ("olmoe", "none"),
                                         pytest.param("tiny", "inductor", marks=pytest.mark.slow)])
def test_out_of_vocabulary_ids_and_labels_are_named_and_the_next_step_is_clean(name, fusion):
    """Without a pipeline an out-of-vocabulary id fails inside the compiled graph (the embedding's IndexError;
    with dense_fusion="inductor" the kernel's C++ exception aborts the process). The forward refuses it
    first, naming the value and the vocabulary as the pipelined train_step does, for ids passed by
    keyword or position, and the next forward and backward still equal the dense model's."""
    model = build_model(name)
    dense = copy.deepcopy(model)
    cm = moe_compile(model, dense_fusion=fusion)
    ids = make_batches(1)[0]
    bad_ids, bad_labels = ids.clone(), ids.clone()
    bad_ids[0, 3] = 10_000
    bad_labels[1, 5] = 256
    bad_labels[1, 0] = 999  # the shifted loss never reads the first label: not an error
    for call in (lambda: cm(input_ids=bad_ids, labels=ids), lambda: cm(bad_ids)):
        with pytest.raises(OptionError, match=r"forward: input_ids hold token id 10000, outside the model's "
                                              r"vocabulary \[0, 256\)"):
            call()
    with pytest.raises(OptionError, match=r"forward: labels hold 256, outside the model's vocabulary \[0, 256\) "
                                          r"\(and not the ignore index -100\)"):
        cm(input_ids=ids, labels=bad_labels)
    assert_step_matches_dense(cm, dense, ids)


@pytest.mark.parametrize("fusion", ["none", "inductor"])
def test_a_lookup_past_a_position_table_is_named_and_the_next_step_is_clean(fusion):
    """A sequence longer than the tiny LM's learned position table (max_seq_len), or position_ids past it:
    the plain graph's IndexError named no table, and with dense_fusion="inductor" the kernel's C++
    exception aborted the process. Each embedding lookup now checks its indices (passes/index_bounds.py),
    and the next step equals the dense model's."""

    model = build_model("tiny", max_seq_len=24)
    dense = copy.deepcopy(model)
    cm = moe_compile(model, dense_fusion=fusion)
    ids = make_batches(1)[0]  # 2 × 16
    cm(input_ids=ids, labels=ids).loss.backward()
    cm.zero_grad(set_to_none=True)
    long = make_batches(1, seq=30, seed=1)[0]
    with pytest.raises(OptionError, match=r"the embedding pos.weight has 24 rows, but this batch looks up row 29"):
        cm(input_ids=long, labels=long)
    with pytest.raises(OptionError, match=r"the embedding pos.weight has 24 rows, but this batch looks up row 40"):
        cm(input_ids=ids, labels=ids, position_ids=torch.arange(25, 41).expand_as(ids))
    assert_step_matches_dense(cm, dense, ids)
    cm.close()


def ragged_batch_worker(rank, world, transport):
    """ep_mp=2: rank 0 passes 1 sequence, rank 1 four. The symmetric transport's lease pools are sized from
    each rank's rows and must be the same on every rank: both ranks raise a moe_compile error; the next
    forward with batches of one shape matches the dense model. (The all_to_all transport runs them:
    tests/test_ragged_batches.py.)"""
    from moe_compile.errors import RuntimeFault

    model = build_model("tiny")
    ref = copy.deepcopy(model)
    batches = make_batches(world, 4, 16, seed=5)
    cm = moe_compile(model, MeshSpec.parse("ep_mp=2"), transport=transport)
    try:
        cm(input_ids=batches[rank][: 1 + 3 * rank], labels=batches[rank][: 1 + 3 * rank]).loss.backward()
        msg = "no error"
    except RuntimeFault as e:
        msg = str(e)
    for p in cm.parameters():
        p.grad = None
    loss = cm(input_ids=batches[rank], labels=batches[rank]).loss
    cm.close()
    return {"msg": msg, "loss_err": rel_err(loss.detach(), ref(input_ids=batches[rank], labels=batches[rank]).loss)}


def test_symmetric_ep_ranks_with_batches_of_different_shapes_are_refused_on_every_rank():
    for r in run_ranks(ragged_batch_worker, 2, "symmetric", timeout=180):
        assert "lease plans differ" in r["msg"] and "batches differ in shape" in r["msg"], r
        assert r["loss_err"] <= 1e-5, r


def test_compiling_a_compiled_model_again_says_so():
    """moe_compile takes ownership of its model; a second moe_compile of it said 'no expert activation
    found' (it recognised the canonical form it had installed) — it now names the cause and the fix."""
    model = build_model("tiny")
    moe_compile(model).close()
    with pytest.raises(OptionError, match="already compiled by moe_compile.*compile a fresh copy"):
        moe_compile(model)


def test_inputs_that_are_not_token_ids_are_named():
    """Float or bool ids, 1-D or empty ids, labels of another shape or dtype: dynamo's fake-tensor errors
    before (naming neither the input nor the rule); now OptionErrors naming the input, and the next call
    matches the dense model."""
    model = build_model("tiny")
    ref = copy.deepcopy(model)
    ids = make_batches(1, 2, 16, seed=1)[0]
    cm = moe_compile(model)
    cases = ((dict(input_ids=ids.float()), "input_ids of dtype torch.float32"),
             (dict(input_ids=ids.bool()), "input_ids of dtype torch.bool"),
             (dict(input_ids=ids[0]), r"input_ids of shape \[16\]: a causal LM takes a non-empty \[batch, sequence\]"),
             (dict(input_ids=ids[:0]), r"input_ids of shape \[0, 16\]"),
             (dict(input_ids=ids, labels=ids[:, :8]), r"labels of shape \[2, 8\] for input_ids of shape \[2, 16\]"),
             (dict(input_ids=ids, labels=ids.float()), "labels of dtype torch.float32"))
    for kw, match in cases:
        with pytest.raises(OptionError, match=match):
            cm(**kw)
    loss = cm(input_ids=ids, labels=ids).loss
    assert rel_err(loss.detach(), ref(input_ids=ids, labels=ids).loss.detach()) <= 1e-5
    cm.close()


def test_float64_experts_are_named():
    """fp64 expert weights: the probe's canonical form failed inside torch._grouped_mm and the error blamed
    the router's interface; it now names the dtype and the fix."""
    with pytest.raises(UnsupportedFeatureError, match=r"layers.0.mlp: expert weights in torch.float64; .*model.float\(\)"):
        moe_compile(build_model("tiny").double())


def _count_load(block: nn.Module) -> None:
    """The tiny LM's MoE block plus a per-expert load counter its forward updates (aux-loss-free balancing
    bookkeeping): the compiled form would never update it."""
    base = type(block)

    class LoadCounting(base):
        def forward(self, hidden):
            out = base.forward(self, hidden)
            with torch.no_grad():
                idx = self.router(hidden.reshape(-1, hidden.shape[-1])).topk(self.top_k, -1).indices
                self.expert_load += torch.bincount(idx.flatten(), minlength=self.expert_load.numel()).float()
            return out

    block.__class__ = LoadCounting
    block.register_buffer("expert_load", torch.zeros(block.router.weight.shape[0]))


def test_state_outside_what_the_compiled_block_reads_is_refused():
    """A router parameter the canonical router does not read (a learnable temperature), a block buffer
    (a load counter the forward updates), one expert pool shared by two blocks and one block used at two
    layers were accepted and then silently dropped, left unupdated or untied (gradients off by 0.83); each
    is now refused by name. The probe ran the block's own forward on random data and left its updates in
    the counter: the model's buffers come back as they were."""
    model = build_model("tiny")
    model.layers[0].mlp.router.temperature = nn.Parameter(torch.ones(()))
    with pytest.raises(UnsupportedFeatureError, match=r"layers.0.mlp: not read by the block's compiled form: "
                                                      r"parameter router.temperature"):
        moe_compile(model)
    model = build_model("tiny")
    _count_load(model.layers[1].mlp)
    with pytest.raises(UnsupportedFeatureError, match=r"layers.1.mlp: not read .*buffer expert_load"):
        moe_compile(model)
    assert not model.layers[1].mlp.expert_load.any()  # the probe's updates were undone
    model = build_model("tiny")
    model.layers[1].mlp.experts = model.layers[0].mlp.experts
    with pytest.raises(UnsupportedFeatureError, match=r"layers.1.mlp: its experts module is also layers.0.mlp's"):
        moe_compile(model)
    model = build_model("tiny")
    model.layers[1].mlp = model.layers[0].mlp
    with pytest.raises(UnsupportedFeatureError, match=r"the same MoE block module is used at \['layers.0.mlp', "
                                                      r"'layers.1.mlp'\]"):
        moe_compile(model)


def test_dropout_inside_a_block_is_refused():
    """A block with dropout on its expert output was refused as "no supported routing reproduces its
    output" when compiled in training mode, and silently lost its dropout when compiled in eval mode and
    trained after; the probe now runs the block twice in training mode, whatever the model's mode, and
    names the cause."""
    for train in (True, False):
        model = build_model("tiny")
        block = model.layers[0].mlp
        base = type(block)

        class Dropped(base):
            def forward(self, hidden):
                out, aux = super().forward(hidden)
                return torch.nn.functional.dropout(out, 0.1, self.training), aux

        block.__class__ = Dropped
        model.train(train)
        with pytest.raises(UnsupportedFeatureError, match=r"layers.0.mlp: the block's forward is random in "
                                                          r"training mode .*dropout or router noise"):
            moe_compile(model)
        assert model.training == train


def _masked(block: nn.Module) -> None:
    """The tiny LM's MoE block with forward(hidden, mask=None): padded tokens get no expert output."""

    class Masked(type(block)):
        def forward(self, hidden, mask=None):
            out, aux = super().forward(hidden)
            return (out if mask is None else out * mask.unsqueeze(-1)), aux

    block.__class__ = Masked


def test_a_block_taking_more_than_the_hidden_states():
    """forward(hidden, mask) with a required mask is refused when compiling; with an optional one it
    compiles (and matches the dense model) while no caller passes it, and a call that passes one is
    refused by name (it failed inside dynamo, "failed to bind arguments"): the mask would be ignored."""
    from .common import rel_err

    model = build_model("tiny")
    block = model.layers[1].mlp

    class Required(type(block)):
        def forward(self, hidden, mask):
            return super().forward(hidden)

    block.__class__ = Required
    with pytest.raises(UnsupportedFeatureError, match=r"layers.1.mlp: the block's forward takes \['mask'\] besides"):
        moe_compile(model)
    model = build_model("tiny")
    _masked(model.layers[1].mlp)
    dense = copy.deepcopy(model)
    ids = make_batches(1)[0]
    cm = moe_compile(model)
    assert rel_err(cm(input_ids=ids, labels=ids).loss.detach(), dense(input_ids=ids, labels=ids).loss.detach()) <= 1e-5
    cm.close()
    model = build_model("tiny")
    _masked(model.layers[1].mlp)
    layer = model.layers[1]
    base = type(layer)

    class MaskingLayer(base):
        def forward(self, x):
            x = x + self.attn(self.attn_norm(x))
            m, aux = self.mlp(self.mlp_norm(x), torch.ones(x.shape[:-1], dtype=x.dtype))
            return x + m, aux

    layer.__class__ = MaskingLayer
    cm = moe_compile(model)
    with pytest.raises(UnsupportedFeatureError, match=r"layers.1.mlp: the block is called with \['argument 2'\] "
                                                      r"besides the hidden states"):
        cm(input_ids=ids, labels=ids)
    cm.close()


def test_train_step_names_a_forward_without_a_loss():
    """A model returning (loss, logits): train_step raised AttributeError "'tuple' object has no attribute
    'loss'"; it now says what output it needs."""
    model = build_model("tiny")
    forward = model.forward

    def as_tuple(*a, **k):
        out = forward(*a, **k)
        return out.loss, out.logits

    model.forward = as_tuple
    cm = moe_compile(model)
    ids = make_batches(1)[0]
    with pytest.raises(OptionError, match=r"train_step: the model's forward returned tuple with no .loss; it needs an "
                                          r"output with a one-value .loss"):
        cm.train_step(input_ids=ids, labels=ids)
    cm.close()


def test_an_aux_loss_the_compiler_does_not_read_is_named():
    """A block whose aux loss uses a coefficient it does not expose (here: three times its lb_coef) was
    reported as "no supported routing reproduces its output", though the output matched."""
    model = build_model("tiny")
    block = model.layers[0].mlp

    class Tripled(type(block)):
        def forward(self, hidden):
            out, aux = super().forward(hidden)
            return out, 3 * aux

    block.__class__ = Tripled
    with pytest.raises(UnsupportedFeatureError, match=r"layers.0.mlp: the compiled form reproduces the block's output "
                                                      r"on a probe batch but not its auxiliary loss"):
        moe_compile(model)
