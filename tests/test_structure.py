"""Structure of the compiled graphs: one dispatch and one combine per MoE layer in forward, their
mirrors in backward, no dense expert compute left, and verify naming the pass that breaks the IR."""

from __future__ import annotations

import operator
from collections import Counter

import pytest
import torch

from moe_compile import MeshSpec, moe_compile
from moe_compile.backend import snapshot
from moe_compile.errors import IRError
from moe_compile.ir import MOE_META, Role, Stage, get_stage
from moe_compile.ops import op_name
from moe_compile.passes import PassContext, moe_pass, run_passes

from .common import build_model, make_batches
from .harness import run_ranks

FORWARD = ("permute", "dispatch", "grouped_ffn", "combine", "unpermute")
MIRRORS = tuple(f"{o}_backward" for o in FORWARD)


def op_counts_per_block(gm) -> dict[str, Counter]:
    out: dict[str, Counter] = {}
    for n in gm.graph.nodes:
        name = op_name(n.target) if n.op == "call_function" else None
        if name:
            out.setdefault(n.meta[MOE_META].block, Counter())[name] += 1
    return out


def structure_worker(rank: int, world: int, model_name: str) -> dict:
    model = build_model(model_name, n_layers=3) if model_name == "tiny" else build_model(model_name, layers=3)
    cm = moe_compile(model, MeshSpec(ep_mp=world))
    b = make_batches(world)[rank]
    cm(input_ids=b, labels=b).loss.backward()
    g = cm.graphs()
    return {
        "stages": {k: get_stage(v).name for k, v in g.items() if k in ("captured", "partitioned", "joint")},
        "counts": {k: {blk: dict(c) for blk, c in op_counts_per_block(v).items()} for k, v in g.items()},
        "blocks": list(cm.blocks),
        "expert_weight_users": expert_weight_users(g["forward"]) | expert_weight_users(g["backward"]),
        "records": [(r.name, r.op_diff) for r in cm.program.records],
        "roles": sorted({n.meta[MOE_META].role.value for n in g["joint"].graph.nodes if MOE_META in n.meta}),
    }


def expert_weight_users(gm) -> set[str]:
    """Names of ops that read the local expert weight placeholders (shape [L, ·, ·])."""
    users = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and op_name(n.target) in ("grouped_ffn", "grouped_ffn_backward"):
            for w in n.args[2:4] if op_name(n.target) == "grouped_ffn" else n.args[4:6]:
                for u in w.users:
                    users.add(op_name(u.target) or str(u.target))
    return users


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["tiny", "qwen2_moe"])
def test_one_dispatch_and_combine_per_layer(model_name):
    r = run_ranks(structure_worker, 2, model_name)[0]
    assert len(r["blocks"]) == 3
    assert r["stages"] == {"captured": "DENSE", "partitioned": "PARTITIONED", "joint": "LEASED"}
    for blk in r["blocks"]:
        assert r["counts"]["captured"][blk] == {"router": 1, "routed_experts": 1}
        fwd, bwd, joint = r["counts"]["forward"][blk], r["counts"]["backward"][blk], r["counts"]["joint"][blk]
        assert {o: fwd.get(o) for o in FORWARD} == dict.fromkeys(FORWARD, 1), fwd
        assert {o: bwd.get(o) for o in MIRRORS} == dict.fromkeys(MIRRORS, 1), bwd
        assert not any(o in bwd for o in FORWARD), bwd
        assert {o: joint.get(o) for o in FORWARD + MIRRORS} == dict.fromkeys(FORWARD + MIRRORS, 1)
        assert "routed_experts" not in fwd and "routed_experts" not in bwd
        # symmetric transport (the CPU default): the receive rows are leased from dispatch until
        # grouped_ffn_backward; lowering checks the lease before each reader and releases it after
        # the last one (with the output-gradient rows that combine_backward PUT)
        assert fwd.get("lease_check") == 1 and "lease_release" not in fwd, fwd
        assert bwd.get("lease_check") == 2 and bwd.get("lease_release") == 2, bwd
    # saved for backward ("output" of the forward graph) is not compute
    assert r["expert_weight_users"] <= {"grouped_ffn", "grouped_ffn_backward", "output"}, r["expert_weight_users"]
    diff = dict(r["records"])["insert_dispatch_combine"]
    assert diff["routed_experts"] == -3 and diff["dispatch"] == 3 and diff["combine"] == 3
    assert {"router", "dispatch", "combine", "expert_ffn"} <= set(r["roles"])


# -- verify catches a pass that breaks the contract ---------------------------------------------


@pytest.fixture(scope="module")
def compiled_single():
    model = build_model("tiny")
    cm = moe_compile(model, MeshSpec())
    b = make_batches(1)[0]
    cm(input_ids=b, labels=b).loss.backward()
    yield cm
    cm.close()


def _ctx(cm):
    return PassContext(cm.program)


def test_verify_names_the_pass_that_duplicates_a_dispatch(compiled_single):
    @moe_pass(requires=Stage.PARTITIONED, ensures=Stage.PARTITIONED)
    def duplicate_dispatch(gm, ctx):
        node = next(n for n in gm.graph.nodes if op_name(n.target) == "dispatch")
        with gm.graph.inserting_after(node):
            copy = gm.graph.call_function(node.target, node.args)
            copy.meta.update(node.meta)
            gm.graph.call_function(operator.getitem, (copy, 0)).meta["val"] = node.meta["val"][0]
        return gm

    gm = snapshot(compiled_single.graphs()["partitioned"])
    with pytest.raises(IRError, match="after pass duplicate_dispatch: .*dispatch"):
        run_passes(gm, _ctx(compiled_single), [duplicate_dispatch])


def test_verify_names_the_pass_that_loses_fake_values(compiled_single):
    @moe_pass(requires=Stage.PARTITIONED, ensures=Stage.PARTITIONED)
    def forget_vals(gm, ctx):
        next(n for n in gm.graph.nodes if op_name(n.target) == "combine").meta.pop("val")
        return gm

    gm = snapshot(compiled_single.graphs()["partitioned"])
    with pytest.raises(IRError, match=r"after pass forget_vals: node .*combine.* has no meta\['val'\]"):
        run_passes(gm, _ctx(compiled_single), [forget_vals])


def test_pass_stage_precondition(compiled_single):
    @moe_pass(requires=Stage.DENSE, ensures=Stage.PARTITIONED)
    def needs_dense(gm, ctx):
        return gm

    with pytest.raises(IRError, match="pass needs_dense requires a DENSE graph, got PARTITIONED"):
        run_passes(snapshot(compiled_single.graphs()["partitioned"]), _ctx(compiled_single), [needs_dense])


def test_moe_nodes_carry_metadata(compiled_single):
    g = compiled_single.graphs()
    metas = [n.meta[MOE_META] for n in g["partitioned"].graph.nodes if MOE_META in n.meta]
    assert {m.role for m in metas} >= {Role.ROUTER, Role.DISPATCH, Role.COMBINE, Role.EXPERT_FFN}
    d = next(m for m in metas if m.role == Role.DISPATCH)
    assert d.dispatch.capacity == d.dispatch.num_tokens * d.dispatch.top_k  # dropless, one rank
    assert d.shard.num_local == d.shard.num_experts
    assert all(isinstance(n.meta.get("val"), torch.Tensor | tuple | list) for n in g["partitioned"].graph.nodes
               if n.op == "call_function" and op_name(n.target))
    # one rank, dropless: lowering leaves no row movement in the executable graphs
    assert g["forward"].meta["moe_elided_transport"] == 4  # 2 layers × (dispatch, combine)
    assert not {op_name(n.target) for n in g["forward"].graph.nodes} & {"dispatch", "combine"}
