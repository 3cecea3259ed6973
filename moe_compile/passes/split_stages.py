"""split_stages: cut the captured model graph into pipeline stages at decoder-layer boundaries.

Glossary: P / PP (stages), B / m (microbatches), P_local. The split has two halves:

    plan_split(model, blocks, S, pp_split)      structure → StageSplit (before any capture)
        layers  = the nn.ModuleList that holds the MoE blocks' decoder layers
        cost(l) = dense parameters of layer l + routed-expert parameters · K/N  (≈ FLOPs per token;
                  saved activations follow the same GEMMs); the head (parameters after the layers,
                  the LM head) counts on the last stage
        default = contiguous layer ranges minimising the most expensive stage (exact, by dynamic
                  programming); ``pp_split`` (module paths of each later stage's first layer) overrides
        owner   = every parameter's stage: its layer's, or 0 / S−1 for modules outside the layers that
                  first run before / after them (embeddings first, norm and head last; see call_order),
                  by registration order before / after the layers where the probe forward cannot run

    split_graph(gm, split, names, batch)        captured graph → one GraphModule per stage
        stage(node) = its decoder layer's stage (nn_module_stack), a parameter's owner stage, else the
                      latest stage of its inputs; a node that needs only batch inputs and buffers
                      (position ids, masks, rotary tables, shifted labels) is *free*: every stage
                      that uses it recomputes it instead of receiving it
        boundary s  = values made before stage s and used at or after it, in graph order: stage s−1
                      returns them, stage s receives them (values just passing through included)
        stage s     = (boundary s activations, batch inputs by name) → boundary s+1 | graph output

A parameter tied across stages (input and output embeddings: one tensor under names of the first and
the last stage) is held by each of those stages and read where used, like a buffer; their ranks sum its
gradient (train/ddp.py). Any other parameter used on another stage than its owner (a module outside the
layers used among them, a tied one read by a stage holding none of its names) is refused, naming them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import IRError, MeshError, UnsupportedFeatureError
from .call_order import first_run_phases


@dataclass(frozen=True)
class StageSplit:
    layers_path: str  # module path of the decoder-layer list, e.g. "model.layers"
    layer_stage: tuple[int, ...]  # stage of each decoder layer
    num_stages: int  # S = pp · v
    owner: dict[str, int] = field(default_factory=dict)  # parameter name → stage
    cost: tuple[float, ...] = ()  # per-stage cost the split balanced
    by_first_run: bool = False  # parameters outside the layers placed by where they first run (else registration)
    # a parameter tied across stages (input and output embeddings): each of its names → the stages its names
    # belong to; every one of them holds it, and their gradients are summed (train/ddp.py's tied sync)
    tied: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def layers_of(self, stage: int) -> list[int]:
        return [i for i, s in enumerate(self.layer_stage) if s == stage]

    def first_layer_paths(self) -> list[str]:
        return [f"{self.layers_path}.{self.layers_of(s)[0]}" for s in range(self.num_stages)]


def find_layer_list(model: nn.Module, block_paths: list[str]) -> tuple[str, nn.ModuleList]:
    """The ModuleList whose items contain the MoE blocks (the decoder layers)."""
    mods = dict(model.named_modules())
    found: set[str] = set()
    for path in block_paths:
        parts = path.split(".")
        for i in range(len(parts), 0, -1):  # from the block itself: a decoder layer may be the block (Gemma 4)
            parent = ".".join(parts[:i - 1]) if i > 1 else ""
            if parts[i - 1].isdigit() and isinstance(mods.get(parent), nn.ModuleList):
                found.add(parent)
                break
        else:
            raise UnsupportedFeatureError(f"{path}: pipeline parallelism cuts at decoder layers, but this MoE block "
                                          "is not inside an nn.ModuleList of layers")
    if len(found) != 1:
        raise UnsupportedFeatureError(f"pipeline parallelism needs one list of decoder layers; the MoE blocks sit "
                                      f"in {sorted(found)}")
    path = found.pop()
    return path, mods[path]


def _layer_cost(layer: nn.Module, prefix: str, routed: dict[str, float]) -> float:
    total = 0.0
    for name, p in layer.named_parameters(prefix=prefix):
        total += p.numel() * routed.get(name, 1.0)
    return total


def _balanced(costs: list[float], stages: int, tail: float) -> list[int]:
    """First layer of each stage: contiguous ranges minimising the largest stage cost (tail on the last)."""
    n = len(costs)
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    inf = float("inf")
    # best[k][i]: the least max-cost of splitting layers [0, i) into k stages; cut[k][i]: where stage k starts
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                c = pre[i] - pre[j] + (tail if k == stages else 0.0)
                v = max(best[k - 1][j], c)
                if v < best[k][i] - 1e-9:
                    best[k][i], cut[k][i] = v, j
    starts, i = [], n
    for k in range(stages, 0, -1):
        starts.append(cut[k][i])
        i = cut[k][i]
    return starts[::-1]


def outside_phases(model: nn.Module, blocks: list) -> dict[str, str] | None:
    """Where each module outside the decoder layers first runs (call_order): one probe forward, run
    before the blocks are canonicalised (their canonical forward would dispatch across EP ranks)."""
    path, layers = find_layer_list(model, [s.path for s in blocks])
    return first_run_phases(model, path, len(layers))


def plan_split(model: nn.Module, blocks: list, num_stages: int, pp_split: list[str] | None = None,
               phases: dict[str, str] | None = None) -> StageSplit:
    """Assign decoder layers and parameters to ``num_stages`` pipeline stages (see module docstring);
    ``phases``: :func:`outside_phases` (None: modules outside the layers placed by registration order)."""
    path, layers = find_layer_list(model, [s.path for s in blocks])
    n = len(layers)
    if n < num_stages:
        raise MeshError(f"{path} has {n} decoder layers, too few to cut into {num_stages} pipeline stages "
                        "(pp · stages per rank); each stage needs at least one layer")
    routed = {}
    for s in blocks:  # routed experts: only K of N run per token
        frac = s.router.top_k / s.experts.num_experts
        for name in s.expert_param_names:
            routed[name] = frac
    costs = [_layer_cost(layers[i], f"{path}.{i}", routed) for i in range(n)]
    order = [name for name, _ in model.named_modules()]
    first = order.index(f"{path}.0")
    mod_pos = {name: i for i, name in enumerate(order)}

    def outside_stage(mod: str) -> int:  # stage of a module outside the layers
        where = (phases or {}).get(mod)
        if where in ("before", "after"):
            return 0 if where == "before" else num_stages - 1
        return 0 if mod_pos.get(mod, 0) < first else num_stages - 1

    tail = 0.0
    for name, p in model.named_parameters(remove_duplicate=False):  # a tied LM head computes on the last stage
        mod = name.rsplit(".", 1)[0] if "." in name else ""
        if not name.startswith(path + ".") and outside_stage(mod) == num_stages - 1:
            tail += p.numel()
    if pp_split is not None:
        starts = [0]
        for p in pp_split:
            m = re.fullmatch(re.escape(path) + r"\.(\d+)", p)
            if not m or int(m.group(1)) >= n:
                raise MeshError(f"pp_split entry {p!r}: expected a decoder layer path {path}.<i> with i < {n}")
            starts.append(int(m.group(1)))
        if len(starts) != num_stages or any(b <= a for a, b in zip(starts, starts[1:])):
            raise MeshError(f"pp_split={pp_split}: needs {num_stages - 1} increasing layer paths (the first layer "
                            f"of stages 1..{num_stages - 1}), each after {path}.0")
    else:
        starts = _balanced(costs, num_stages, tail)
    layer_stage = []
    for i in range(n):
        layer_stage.append(max(k for k, st in enumerate(starts) if st <= i))
    stage_cost = [sum(costs[i] for i in range(n) if layer_stage[i] == k) for k in range(num_stages)]
    stage_cost[-1] += tail
    owner: dict[str, int] = {}
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        m = re.match(re.escape(path) + r"\.(\d+)\.", name)
        if m:
            st = layer_stage[int(m.group(1))]
        else:
            st = outside_stage(name.rsplit(".", 1)[0] if "." in name else "")
        aliases.setdefault(id(p), []).append(name)
        owner.setdefault(name, st)
    tied = {}
    for names in aliases.values():  # one tensor under names of several stages (tied input/output embeddings)
        stages = tuple(sorted({owner[n] for n in names}))
        if len(stages) > 1:
            tied.update({n: stages for n in names})
    return StageSplit(path, tuple(layer_stage), num_stages, owner, tuple(stage_cost), phases is not None, tied)


# -- the graph half ---------------------------------------------------------------------------------


@dataclass
class StageGraph:
    stage: int
    gm: fx.GraphModule  # forward(*activations, *batch inputs in batch_names order)
    activations_in: list[str]  # boundary value names (graph order)
    activations_out: list[str]  # boundary s+1 names, or the graph output on the last stage
    batch_names: list[str]  # batch inputs this stage reads, by keyword
    params: list[str]  # parameters and buffers it reads


def _layer_of(node: fx.Node, pattern: re.Pattern) -> int | None:
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        m = pattern.search(str(path))
        if m:
            return int(m.group(1))
    return None


def split_graph(gm: fx.GraphModule, split: StageSplit, names: list[str | None], batch: list[str | None],
                root: nn.Module, keep: set[int] | None = None) -> dict[int, StageGraph]:
    """One GraphModule per stage in ``keep`` (default all). ``names[i]``: parameter/buffer name of
    placeholder i (None for batch inputs); ``batch[i]``: the keyword of batch input i. ``root`` owns
    the parameters (get_attr targets are their names)."""
    S = split.num_stages
    pattern = re.compile(r"(?:^|[.'\]])" + re.escape(split.layers_path).replace(r"\.", r"(?:\.|'\]\.|\.modules\.)")
                         + r"\.(\d+)(?:$|[.'\[])")
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    stage: dict[fx.Node, int | None] = {}
    kind: dict[fx.Node, str] = {}  # "param" | "buffer" | "batch"
    param_of: dict[fx.Node, str] = {}
    for i, n in enumerate(placeholders):
        if names[i] is not None:
            param_of[n] = names[i]
            if names[i] in split.tied:  # read where used, by every stage holding it (checked below)
                kind[n], stage[n] = "param", None
            elif names[i] in split.owner:
                kind[n], stage[n] = "param", split.owner[names[i]]
            else:
                kind[n], stage[n] = "buffer", None
        else:
            kind[n], stage[n] = "batch", None
    output = next(n for n in nodes if n.op == "output")
    effects: list[fx.Node] = []  # nodes kept for their effect: placed once every other node has a stage
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.op == "get_attr":
            raise IRError(f"split_stages: captured graph reads attribute {n.target} directly; expected lifted inputs")
        ins = [stage[a] for a in n.all_input_nodes if stage[a] is not None]
        s = max(ins) if ins else None
        if s is None and not n.users:
            effects.append(n)
        layer = _layer_of(n, pattern)
        if layer is not None:
            ls = split.layer_stage[layer]
            if s is not None and s > ls:
                src = max((a for a in n.all_input_nodes if stage[a] is not None), key=lambda a: stage[a])
                later = _params_behind(src, stage, param_of, kind)
                rule = "first run" if split.by_first_run else "are registered"
                raise UnsupportedFeatureError(
                    f"pipeline parallelism: {split.layers_path}.{layer} (stage {ls}) reads {src.name}, which is "
                    f"computed from parameters of the later stage {stage[src]} ({later[:3]}; parameters outside "
                    f"the decoder layers go to the first stage when their modules {rule} before the layers, to the "
                    "last when after them"
                    f"{' (modules first run among the layers: by registration)' if split.by_first_run else ''}"
                    f"{'' if split.by_first_run else '; the probe forward on input_ids alone could not run'}"
                    "); a model that feeds its layers values made from such modules cannot be cut into stages "
                    "here: use pp=1")
            s = ls
        stage[n] = s
    _place_effects(nodes, effects, stage)
    for a in output.all_input_nodes:
        if stage[a] is not None and stage[a] > S - 1:
            raise IRError("split_stages: output from beyond the last stage")
    users_stage = _users_stage(nodes, stage, S)
    # parameters used off their owner stage (a tied one: off the stages holding it)
    for n, pname in param_of.items():
        if kind[n] != "param":
            continue
        used = {stage[u] for u in n.users if u.op != "output"}
        used.discard(None)
        if pname in split.tied:
            used = users_stage[n]
        bad = used - set(split.tied.get(pname, (stage[n],)))
        if bad and pname in split.tied:
            raise UnsupportedFeatureError(
                f"parameter {pname} is tied across pipeline stages {list(split.tied[pname])} (its names' stages), but "
                f"stage(s) {sorted(bad)} read it too, which hold none of its names (their ranks release it); untie "
                "the weights or use pp=1")
        if bad:
            user = next(u for u in n.users if stage[u] in bad)
            raise UnsupportedFeatureError(
                f"parameter {pname} belongs to pipeline stage {stage[n]} but node {user.name} on stage "
                f"{stage[user]} reads it (weights shared across stages, e.g. tied embeddings); untie them or use pp=1")
    out: dict[int, StageGraph] = {}
    for s in range(S):
        if keep is not None and s not in keep:
            continue
        out[s] = _build_stage(s, S, nodes, stage, kind, param_of, batch, placeholders, users_stage, output, root)
    return out


def _users_stage(nodes: list[fx.Node], stage: dict, S: int) -> dict[fx.Node, set[int]]:
    """The stages that read each node, directly or through free nodes (recomputed where used)."""
    users_stage: dict[fx.Node, set[int]] = {}
    for n in reversed(nodes):
        if n.op == "output":
            continue
        need: set[int] = set()
        for u in n.users:
            if u.op == "output":
                need.add(S - 1)
            elif stage[u] is not None:
                need.add(stage[u])
            else:
                need |= users_stage.get(u, set())
        users_stage[n] = need
    return users_stage


def _params_behind(n: fx.Node, stage: dict, param_of: dict, kind: dict) -> list[str]:
    """The parameters of ``n``'s stage that ``n`` is computed from (for the error above)."""
    seen, todo, out = set(), [n], []
    while todo:
        a = todo.pop()
        if a in seen:
            continue
        seen.add(a)
        if a.op == "placeholder":
            if kind.get(a) == "param" and stage[a] == stage[n]:
                out.append(param_of[a])
            continue
        todo.extend(a.all_input_nodes)
    return sorted(out)


_CLOSERS = ("decrement", "exit", "pop")  # end a region opened earlier: they go with the nodes before them
_OPENERS = ("increment", "enter", "push")  # start one: with the nodes after them


def _place_effects(nodes: list[fx.Node], effects: list[fx.Node], stage: dict) -> None:
    """Stages for nodes that read no staged value and that nothing reads: dynamo keeps such a node only
    for its effect (its graphs hold no dead pure nodes), e.g. torch.func's _vmap_decrement_nesting closing
    the vmap level Jamba's associative_scan opens. No stage needed its value, so the split dropped it and
    the level stayed open. Inside a stage it goes with that stage; on a boundary between two stages a
    closer goes with the stage before, an opener with the one after, and anything else (a grad-mode
    switch, say) is an error naming it, since either choice could be wrong."""
    pos = {n: i for i, n in enumerate(nodes)}
    staged = [(i, stage[n]) for i, n in enumerate(nodes) if n.op != "placeholder" and stage.get(n) is not None]
    for n in effects:
        before = next((s for i, s in reversed(staged) if i < pos[n]), None)
        after = next((s for i, s in staged if i > pos[n]), None)
        name = str(getattr(n.target, "__name__", n.target))
        if before is None or after is None or before == after:
            stage[n] = before if before is not None else (after if after is not None else 0)
        elif any(w in name for w in _CLOSERS):
            stage[n] = before
        elif any(w in name for w in _OPENERS):
            stage[n] = after
        else:
            raise IRError(f"split_stages: {n.name} ({name}) changes state for what follows but sits on the boundary "
                          f"between pipeline stages {before} and {after}, so neither stage is surely its own; "
                          "keep the region it opens or closes inside one decoder layer, or move the cut (pp_split)")


def _boundary(s: int, nodes: list[fx.Node], stage: dict, S: int) -> list[fx.Node]:
    """Values made before stage s and read at or after it (graph order)."""
    out = []
    for n in nodes:
        if n.op in ("placeholder", "output") or stage[n] is None or stage[n] >= s:
            continue
        if any((u.op == "output" and S - 1 >= s) or (u.op != "output" and stage[u] is not None and stage[u] >= s)
               for u in n.users):
            out.append(n)
    return out


def _build_stage(s, S, nodes, stage, kind, param_of, batch, placeholders, users_stage, output, root) -> StageGraph:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    acts_in = _boundary(s, nodes, stage, S) if s > 0 else []
    for n in acts_in:
        if not isinstance(n.meta.get("val"), torch.Tensor):
            raise IRError(f"split_stages: value {n.name} crosses into stage {s} but is not a tensor "
                          f"({type(n.meta.get('val')).__name__}); pipeline stages exchange tensors only")
        p = g.placeholder(f"act_{n.name}")
        p.meta.update(n.meta)
        env[n] = p
    batch_of = {n: batch[i] for i, n in enumerate(placeholders) if kind[n] == "batch"}

    def here(n: fx.Node) -> bool:
        if stage[n] == s:
            return True
        return stage[n] is None and s in users_stage.get(n, set())

    needed = [n for n in nodes if n.op not in ("output",) and n not in env and here(n)]
    batch_used = [n for n in needed if n.op == "placeholder" and kind[n] == "batch"]
    for n in batch_used:
        p = g.placeholder(batch_of[n])
        p.meta.update(n.meta)
        env[n] = p
    params = []
    for n in needed:
        if n.op == "placeholder":
            if kind[n] == "batch":
                continue
            a = g.get_attr(param_of[n])
            a.meta.update(n.meta)
            env[n] = a
            params.append(param_of[n])
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
    if s == S - 1:
        outs = fx.node.map_arg(output.args[0], lambda a: env[a])
        acts_out = [a.name for a in output.all_input_nodes]
    else:
        nxt = _boundary(s + 1, nodes, stage, S)
        outs = tuple(env[n] for n in nxt)
        acts_out = [n.name for n in nxt]
    g.output(outs)
    gm = fx.GraphModule(root, g)
    return StageGraph(s, gm, [n.name for n in acts_in], acts_out, [batch_of[n] for n in batch_used], params)
