"""Rendering: node kinds are distinguishable in the SVG (dispatch, combine, expert FFN, lease
acquire/release, MXFP8 casts, mirrors, gradient reductions), edges carry shape and dtype, the lease
timeline's high-water equals the plan's, the HTML report parses, and debug dumps render pictures."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest
import torch
import torch.fx as fx

from moe_compile import MeshSpec, moe_compile
from moe_compile.errors import OptionError
from moe_compile.ir import MOE_META, MoENodeMeta, Role
from moe_compile.leases import LeasePlan, Payload
from moe_compile.ledger import SYMBOLS, evaluate
from moe_compile.passes import FORWARD_PASSES
from moe_compile.viz import (
    Picture,
    Reduction,
    build_view,
    kind_of,
    timeline_high_water,
    timeline_svg,
    write_report,
    write_view,
)

from .common import build_model, make_batches

# the debug dump's name of the dispatch/combine pass: its index in the forward pass list, then its name
DISPATCH_PASS = next(f"{i:02d}_{p.name}" for i, p in enumerate(FORWARD_PASSES) if p.name == "insert_dispatch_combine")

SVG = "{http://www.w3.org/2000/svg}"


def _op(name: str):
    def f(*args):
        return args[0]

    f.__name__ = name
    return f


def hand_graph() -> fx.GraphModule:
    """x → lease_acquire → dispatch → expert FFN → cast → combine → lease_release → fp8 copy, plus a
    dispatch mirror, each tagged the way passes tag MoE nodes."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(8, 4, device="meta")
    chain = [("lease_acquire", Role.LEASE, False), ("dispatch", Role.DISPATCH, False),
             ("grouped_ffn", Role.EXPERT_FFN, False), ("to_mxfp8", Role.CAST, False),
             ("combine", Role.COMBINE, False), ("lease_release", Role.LEASE, False),
             ("dispatch_backward", Role.DISPATCH, True)]
    cur = x
    for name, role, mirror in chain:
        cur = g.call_function(_op(name), (cur,))
        cur.meta["val"] = torch.empty(8, 4, device="meta")
        cur.meta[MOE_META] = MoENodeMeta(block="layers.0.mlp", role=role, layer_index=0, mirror=mirror)
    fp8 = g.call_function(torch.ops.aten._to_copy.default, (cur,), {"dtype": torch.float8_e4m3fn})
    fp8.meta["val"] = torch.empty(8, 4, device="meta", dtype=torch.float8_e4m3fn)
    g.output(fp8)
    return fx.GraphModule(torch.nn.Module(), g)


def svg_classes(path) -> set[str]:
    root = ET.parse(path).getroot()
    return {c for el in root.iter(f"{SVG}g") for c in (el.get("class") or "").split()}


def svg_texts(path) -> list[str]:
    return [el.text or "" for el in ET.parse(path).getroot().iter(f"{SVG}text")]


@pytest.mark.parametrize("collapse", [False, True])
def test_node_kinds_are_distinguishable(tmp_path, collapse):
    gm = hand_graph()
    assert [kind_of(n) for n in gm.graph.nodes] == [
        "input", "lease_acquire", "dispatch", "expert_ffn", "cast", "combine", "lease_release", "dispatch", "cast",
        "output"]
    grads = [n for n in gm.graph.nodes if n.name == "dispatch_backward"]
    view = build_view(gm, title="hand", collapse=collapse, reductions=[Reduction("r0", "dense bucket 0", grads)])
    path = write_view(view, str(tmp_path / "g.svg"))
    classes = svg_classes(path)
    for kind in ("lease_acquire", "lease_release", "dispatch", "combine", "expert_ffn", "cast", "reduction"):
        assert f"moe-{kind}" in classes, (kind, classes)
    assert "moe-mirror" in classes
    texts = svg_texts(path)
    assert "[8, 4] f32" in texts and "[8, 4] float8_e4m3fn" in texts
    assert any("layers.0 (MoE layer)" in t for t in texts)
    assert any("pipeline stage 0" in t for t in texts)


def plan(high_water_recv: int = 3) -> LeasePlan:
    def pay(name, fam, a, r, leased, slot):
        return Payload(name, f"layers.{slot}.mlp", fam, (16, 4), "bfloat16", 128, a, r, leased, slot)

    recv = [pay(f"l{i}/dispatch.recv", "recv", 10 * (i + 1), 90 - 10 * i, True, i) for i in range(3)]
    tmp = [pay(f"l{i}/combine.send", "send", 10 * (i + 1) + 2, 10 * (i + 1) + 5, False, 0) for i in range(3)]
    return LeasePlan(tuple(recv + tmp), schedule_len=100, sharing=True,
                     high_water={(0, "recv"): high_water_recv, (0, "send"): 1},
                     slot_bytes={(0, "recv"): 128, (0, "send"): 128}, boundary=50)


def test_timeline_high_water_equals_plan(tmp_path):
    p = plan()
    assert timeline_high_water(p) == p.high_water
    path = tmp_path / "t.svg"
    path.write_text(timeline_svg(p))
    root = ET.parse(path).getroot()
    pools = [g for g in root.iter(f"{SVG}g") if g.get("class") == "pool"]
    assert len(pools) == 2
    for g in pools:
        key = (int(g.get("data-stage")), g.get("data-family"))
        assert int(g.get("data-high-water")) == int(g.get("data-computed-high-water")) == p.high_water[key]
        line = next(el for el in g.iter(f"{SVG}line") if el.get("class") == "high-water")
        assert int(line.get("data-value")) == p.high_water[key]
    rects = [el.get("class") for el in root.iter(f"{SVG}rect")]
    assert rects.count("payload leased") == 3 and rects.count("payload transient") == 3
    assert not any(el.get("class") == "warning" for el in root.iter(f"{SVG}text"))


def test_timeline_flags_a_plan_whose_high_water_disagrees():
    root = ET.fromstring(timeline_svg(plan(high_water_recv=2)))
    warn = [el.text for el in root.iter(f"{SVG}text") if el.get("class") == "warning"]
    assert warn == ["plan says high-water 2, its payload intervals give 3"]


class _Checker(HTMLParser):
    VOID = {"meta", "img", "br", "hr", "link", "input", "col"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, (tag, self.stack[-5:])
        self.stack.pop()


@pytest.mark.parametrize("with_plan", [True, False])
def test_html_report_parses(tmp_path, with_plan):
    vals = {k: 2 for k in SYMBOLS}
    vals.update(G=1, H=3, T=64, S=64, q_mx=0, z_1=0, P_mx_dense=0)  # the 0/1 flags (and MXFP8 counts) off
    led = evaluate(vals, lease_plan=plan() if with_plan else None)
    # with the plan: pools recv (slots 0, 1, 2) and send (slot 0) of 128 B a slot: (3 + 1)·128 = 512 B;
    # without: H·C·d·b_a, C = c_f·T·K = 2·64·2 = 256 rows: 3·256·2·2 = 3072 B
    assert led["M_sym"] == (512 if with_plan else 3072)
    pic = tmp_path / "g.svg"
    write_view(build_view(hand_graph(), title="hand"), str(pic))
    out = write_report(tmp_path / "report.html", title="t", ledger=led, pictures=[Picture("hand graph", pic)],
                       timeline=timeline_svg(plan()) if with_plan else None, sections={"Extra": "<p>x</p>"})
    checker = _Checker()
    checker.feed(out.read_text())
    checker.close()
    assert checker.stack == []
    figures = {a.get("data-figure") for t, a in checker.tags if t == "tr"}
    assert {"P_active", "P_total", "M_persistent", "V_ep_mp", "F_train_token", "M_sym"} <= figures
    svgs = [a for t, a in checker.tags if t == "svg"]
    assert len(svgs) == (2 if with_plan else 1)
    text = out.read_text()
    assert (led.shorthand in text) and (("no lease plan" in text) != with_plan)


def test_debug_dumps_render_before_and_after_pictures(tmp_path):
    with pytest.raises(OptionError, match="debug_pictures"):
        moe_compile(build_model("tiny"), MeshSpec(), debug_pictures="yes")
    cm = moe_compile(build_model("tiny"), MeshSpec(), debug_dir=str(tmp_path), debug_pictures=True)
    ids = make_batches(1)[0]
    with torch.no_grad():
        cm(input_ids=ids)
    after = tmp_path / f"fwd_{DISPATCH_PASS}_after"
    before = tmp_path / f"fwd_{DISPATCH_PASS}_before"
    text = after.with_suffix(".py").read_text()
    added, removed = text.splitlines()[1:3]
    assert added.startswith("# nodes added: [") and "'dispatch_default:dispatch'" in added
    assert "'combine_default:combine'" in added
    assert removed.startswith("# nodes removed: [") and ":routed_experts'" in removed
    assert "moe-routed_experts" in svg_classes(before.with_suffix(".svg"))
    classes = svg_classes(after.with_suffix(".svg"))
    assert {"moe-dispatch", "moe-combine", "moe-expert_ffn", "moe-new"} <= classes
    assert "moe-routed_experts" not in classes
    cm.close()


def test_coarsest_view_draws_one_node_per_layer(tmp_path):
    view = build_view(hand_graph(), collapse="layers")
    assert view.level == "layers" and view.kinds["moe_layer"] == 1
    texts = svg_texts(write_view(view, str(tmp_path / "l.svg")))
    assert any("dispatch ×2" in t for t in texts)  # the dispatch and its mirror, counted in the layer
    with pytest.raises(ValueError, match="collapse='bogus'"):
        build_view(hand_graph(), collapse="bogus")


@pytest.fixture
def no_dot(tmp_path, monkeypatch):
    """PATH without graphviz's `dot` (as on a machine where pip installed pydot only)."""
    import moe_compile.viz.graph as graph

    empty = tmp_path / "empty_bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(graph, "_warned_missing", False, raising=False)  # warn-once state: fresh per test


def test_missing_dot_is_a_clear_error_and_sources_still_write(tmp_path, no_dot):
    import pydot

    from moe_compile.errors import MoECompileError
    from moe_compile.viz import GraphvizMissing

    view = build_view(hand_graph(), title="hand")
    for fmt in ("svg", "png"):
        with pytest.raises(GraphvizMissing, match=r"apt-get install graphviz.*conda install graphviz.*brew install "
                                                  r"graphviz") as e:
            write_view(view, str(tmp_path / f"g.{fmt}"))
        assert isinstance(e.value, MoECompileError) and not (tmp_path / f"g.{fmt}").exists()
    src = write_view(view, str(tmp_path / "g.dot"))
    (graph,) = pydot.graph_from_dot_file(src)  # a complete graphviz source, node kinds included
    assert graph.get_subgraph_list() and 'class="moe-dispatch"' in open(src).read()
    # the report links the source instead of a picture, and says once how to get pictures
    led = evaluate({**{k: 2 for k in SYMBOLS}, "G": 1, "H": 3, "T": 64, "S": 64})
    out = write_report(tmp_path / "report.html", title="t", ledger=led,
                       pictures=[Picture("hand graph", tmp_path / "g.dot"), Picture("again", tmp_path / "g.dot")],
                       timeline=None)
    checker = _Checker()
    checker.feed(out.read_text())
    checker.close()
    assert checker.stack == []
    text = out.read_text()
    assert text.count("apt-get install graphviz") == 1 and text.count("href='g.dot'") == 2
    assert not any(t == "img" for t, _ in checker.tags)


def test_debug_pictures_without_dot_write_sources_and_warn_once(tmp_path, no_dot):
    cm = moe_compile(build_model("tiny", n_layers=1), MeshSpec(), debug_dir=str(tmp_path / "dbg"),
                     debug_pictures=True)
    ids = make_batches(1)[0]
    with pytest.warns(UserWarning, match="`dot` program") as caught, torch.no_grad():
        cm(input_ids=ids)
    assert len([w for w in caught if "`dot` program" in str(w.message)]) == 1
    after = tmp_path / "dbg" / f"fwd_{DISPATCH_PASS}_after"
    assert after.with_suffix(".py").exists() and "moe-dispatch" in after.with_suffix(".dot").read_text()
    assert not list((tmp_path / "dbg").glob("*.svg"))
    cm.close()


def debug_dir_worker(rank: int, world: int, root: str) -> None:
    cm = moe_compile(build_model("tiny"), MeshSpec.parse("ep_mp=2"), debug_dir=root)
    ids = make_batches(world)[rank]
    cm(input_ids=ids, labels=ids).loss.backward()
    cm.close()


def test_debug_dumps_of_several_ranks_go_to_their_own_subdirectories(tmp_path):
    """Two ranks sharing one debug_dir wrote the same file names there, each overwriting the other's."""
    from .harness import run_ranks

    run_ranks(debug_dir_worker, 2, str(tmp_path))
    for r in range(2):
        assert (tmp_path / f"rank{r}" / f"fwd_{DISPATCH_PASS}_after.py").exists(), sorted(tmp_path.iterdir())
    assert not list(tmp_path.glob("*.py"))
