"""Pipeline runtime: compiled stage programs driven by torch.distributed.pipelining's schedules.

Glossary: P / PP, B / m, lease, high-water. One CompiledMoE on a pp > 1 mesh holds this rank's
stages (v of the S = pp·v stages; rank r of the pipeline holds stages r, r + pp, …):

    first train_step (the batch fixes the shapes)
        capture   the whole model's loss as one graph (recorded, not run)
        split     split_stages → one GraphModule per local stage
        compile   each through MoEBackend with its own Program: its MoE blocks, pipeline_stage s,
                  forwards_in_flight = H_s of the schedule's action order (plan_leases then proves
                  the lease plan safe over that order before the stage's first run)
        stages    torch PipelineStage over each compiled stage (static boundary shapes), and the
                  schedule class (ScheduleGPipe | Schedule1F1B | ScheduleInterleaved1F1B)
    every train_step
        w_j       = valid label tokens of microbatch j / of the batch (HF's shifted labels, −100 ignored)
        schedule.step(**batch, target=w, losses)  with loss_fn(loss_j, w_j) = w_j · loss_j and no
                  extra scaling: gradients of Σ_j w_j·loss_j, the batch-mean token loss
        reduce    gradients once per step (dense over dp×cp, experts over ep_dp, per stage)
        loss      Σ_j w_j·loss_j on the last stage, broadcast over the pipeline group

Every stage reads the batch inputs it needs (labels on the last stage, position ids and masks
anywhere) from the batch that every rank of one pipeline passes; only boundary activations travel.
Per-microbatch statistics (router load-balancing loss, expert counts) are per microbatch, as in
any gradient-accumulation loop: the load-balancing loss is nonlinear in the counts, so it is the
microbatch's own, weighted like its token loss.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..capture import compile_entry, fresh, pass_error
from ..errors import OptionError, RuntimeFault
from .batch_agreement import agree_on_batch
from .stage_weights import materialized


class _Recorded(Exception):
    """Raised by the recording backend: the captured graph is kept, nothing runs."""


def _entry(model: nn.Module, outputs: tuple[str, ...]):
    """A fresh function (own code object, as api._capture_entry) returning ``outputs`` of the model."""

    def moe_stage_capture(**kwargs):
        out = model(**kwargs)
        return tuple(getattr(out, k) for k in outputs)

    return fresh(moe_stage_capture)


def capture(model: nn.Module, kwargs: dict[str, Any], outputs: tuple[str, ...]):
    """The model's dynamo graph for one microbatch, with each placeholder's parameter/buffer name (or
    None) and batch keyword (or None)."""
    rec: dict[str, Any] = {}

    def recorder(gm, example_inputs):
        rec["gm"], rec["inputs"] = gm, list(example_inputs)
        raise _Recorded

    fn = torch.compile(_entry(model, outputs), backend=recorder, fullgraph=True, dynamic=False)
    try:
        fn(**kwargs)
    except Exception as e:  # dynamo wraps the backend's exception
        if "gm" not in rec or not _caused_by(e, _Recorded):
            from ..capture import capture_error

            err = capture_error(e, model)  # data-dependent control flow: name the module and the line
            if err is None:
                raise
            raise err from e
    from ..passes.base import normalize_capture

    normalize_capture(rec["gm"])
    by_id = {id(t): n for n, t in model.named_parameters(remove_duplicate=False)}
    by_id.update({id(t): n for n, t in model.named_buffers()})
    batch_ids = {id(v): k for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    names = [by_id.get(id(t)) for t in rec["inputs"]]
    batch = [batch_ids.get(id(t)) if by_id.get(id(t)) is None else None for t in rec["inputs"]]
    for i, (n, b) in enumerate(zip(names, batch)):
        if n is None and b is None:
            raise RuntimeFault(f"pipeline capture: graph input {i} is neither a parameter, a buffer nor a batch input")
    return rec["gm"], names, batch


def _caused_by(e: BaseException, kind: type) -> bool:
    while e is not None:
        if isinstance(e, kind):
            return True
        e = e.__cause__ or e.__context__
    return False


def _stage_entry(graph):
    """What torch.compile captures for one stage: ``gm.forward`` itself (calling the GraphModule would
    run fx's call wrapper, whose error formatting a runtime guard's exception would pass through). Batch
    inputs come by keyword, so the captured graph's inputs keep their names (``position_ids``)."""
    gm, names = graph.gm, list(graph.batch_names)

    def moe_stage(*acts, **batch):
        return gm.forward(*acts, *[batch[k] for k in names])

    return fresh(moe_stage)


class StageModule(nn.Module):
    """One compiled pipeline stage: forward(*boundary activations, **batch) → next boundary | loss."""

    def __init__(self, graph, compiled) -> None:
        super().__init__()
        self.graph_module = graph.gm  # holds the stage's parameters (the model's own tensors)
        self.batch_names = graph.batch_names
        self._compiled = compiled
        self.stage = graph.stage

    def forward(self, *acts: torch.Tensor, **batch: Any) -> Any:
        missing = [k for k in self.batch_names if k not in batch]
        if missing:
            raise OptionError(f"pipeline stage {self.stage} needs batch input(s) {missing} (every rank of a "
                              "pipeline passes the same batch)")
        try:
            out = self._compiled(*acts, **{k: batch[k] for k in self.batch_names})
        except Exception as e:
            inner = pass_error(e)  # a pass refused the stage's graph: its own error, not dynamo's wrapper
            if inner is None:
                raise
            raise inner from e
        # boundary values travel contiguous, as the stages declare them: a view (one layer's slice of
        # Gemma 4's per-layer inputs) keeps its base's strides, which the schedule's metadata check refuses
        if isinstance(out, tuple):
            return tuple(t.contiguous() if isinstance(t, torch.Tensor) else t for t in out)
        return out.contiguous() if isinstance(out, torch.Tensor) else out


def _empty_like_val(v: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty(tuple(int(s) for s in v.shape), dtype=v.dtype, device=device)


def microbatch_weights(labels: torch.Tensor | None, m: int, shifted: bool = False) -> torch.Tensor:
    """w_j: the share of the batch's loss tokens in microbatch j (−100 ignored); ``labels`` are the ids'
    (the loss reads labels[..., 1:]) or, ``shifted``, already the targets (transformers' shift_labels)."""
    if labels is None:
        return torch.full((m,), 1.0 / m)
    valid = ((labels if shifted else labels[..., 1:]) != -100).reshape(m, -1).sum(1).double()
    total = valid.sum()
    if total == 0:
        return torch.full((m,), 1.0 / m)
    return (valid / total).float()


def split_batch_check(kwargs: dict[str, Any], m: int) -> int:
    sizes = {k: v.shape[0] for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if not sizes:
        raise OptionError("train_step needs tensor batch inputs (input_ids=..., labels=...)")
    b = next(iter(sizes.values()))
    if any(s != b for s in sizes.values()):
        raise OptionError(f"train_step: batch inputs disagree on the batch size: {sizes}")
    if b % m:
        raise OptionError(f"train_step: a batch of {b} sequences does not split into microbatches={m} equal "
                          "microbatches (torch.distributed.pipelining's uneven split is broken); use a batch "
                          f"divisible by {m}")
    return b


@functools.cache
def _stage_class():
    """torch's PipelineStage, whose first-step metadata inference runs outside the dropless state: on the
    first step torch runs each stage once on placeholder activations to infer the boundary metadata (on
    uninitialised ones stage 1 of the tiny LM sent 112 of its 128 rows to one EP rank; on zeros, as here,
    every row routes alike). Like the stage warm-up, that forward's load is not the run's; counted, it
    grew the receive capacity to ep·T·K."""
    from torch.distributed.pipelining import PipelineStage

    from .dropless import uncounted

    class MoEPipelineStage(PipelineStage):
        moe_ctx_id = -1

        def _prepare_forward_infra(self, *args, **kwargs):
            with uncounted(self.moe_ctx_id):
                return super()._prepare_forward_infra(*args, **kwargs)

        def _to_tensor(self, arg):
            # the inference's activations from metadata: zeros, not torch.empty's uninitialised memory (a
            # stage that computes indices from its activations, hy_v4's, scattered out of bounds on those)
            t = super()._to_tensor(arg)
            if not isinstance(arg, torch.Tensor):
                with torch.no_grad():
                    t.zero_()
            return t

    return MoEPipelineStage


@dataclass
class LocalStage:
    index: int
    program: Any  # Program of this stage
    graph: Any  # StageGraph
    module: StageModule
    pipe: Any = None  # torch PipelineStage


class PipelineRuntime:
    def __init__(self, cm, split, schedule, released: dict | None = None) -> None:
        self.cm = cm
        self.split = split
        self.schedule = schedule  # ScheduleOrder
        self.released = released or {}  # other stages' parameters, storage released (runtime/stage_weights.py)
        spec = cm.program.mesh
        self.pp = spec.pp
        self.pp_rank = spec.dense_coords(cm.groups.rank)[0]
        self.local = [self.pp_rank + k * self.pp for k in range(schedule.stages_per_rank)]
        self.stages: list[LocalStage] = []
        self._torch_schedule = None
        self._shape: tuple | None = None
        self._programs: list = []  # Program per local stage
        self.planned: dict = {}  # stage → Program, once plan_stages compiled every stage (explain)
        self.captured = None  # the whole model's graph of the first step (the ledger reads its attention)
        self.microbatch_tokens: int | None = None  # this rank's tokens of one microbatch (the ledger's T)
        self._eval: dict = {}  # (outputs, batch shapes) → ({stage: (module, graph)}, fake values)

    # -- build -------------------------------------------------------------------------------------
    def _capture(self, mb: dict[str, Any], outputs: tuple[str, ...]):
        """The whole model's graph; under cp > 1 with its load-balancing loss over the whole sequences
        (runtime/cp_balance_loss.py: each rank adds the whole aux, weighted by its share of the tokens)."""
        cm = self.cm
        if cm.program.mesh.cp == 1:
            return capture(cm.model, mb, outputs)
        from .cp_balance_loss import whole_sequence_balance_loss

        with whole_sequence_balance_loss(cm.model, cm.program.ctx_id, cm.program.mesh.cp):
            return capture(cm.model, mb, outputs)

    def _build(self, mb: dict[str, Any]) -> None:
        from ..backend import MoEBackend
        from ..passes.split_stages import split_graph
        from ..schedules import SCHEDULES

        cm, prog = self.cm, self.cm.program
        with materialized(self.released):
            gm, names, batch = self._capture(mb, ("loss",))
        self.captured = gm
        ids = mb.get("input_ids", mb.get("inputs_embeds"))
        if isinstance(ids, torch.Tensor):
            self.microbatch_tokens = int(ids.shape[0] * ids.shape[1])
        graphs = split_graph(gm, self.split, names, batch, cm.model, keep=set(self.local))
        device = next(cm.model.parameters()).device
        fake = {n.name: n.meta.get("val") for n in gm.graph.nodes}
        stages: list[LocalStage] = []  # kept only once the stages compiled: a failed build leaves nothing behind
        for sprog in self._stage_programs():
            s = sprog.pipeline_stage
            g = graphs[s]
            compiled = compile_entry(_stage_entry(g), backend=MoEBackend(sprog), fullgraph=prog.options.fullgraph,
                                     dynamic=False)
            module = StageModule(g, compiled)
            ins = tuple(_empty_like_val(fake[n], device) for n in g.activations_in)
            outs = tuple(_empty_like_val(fake[n], device) for n in g.activations_out)
            pipe = _stage_class()(module, s, self.split.num_stages, device, input_args=ins or None,
                                  output_args=outs, group=cm.groups.pp)
            pipe.moe_ctx_id = prog.ctx_id
            pipe._user_meta_inputs = ins  # the boundary shapes, for compiling ahead of the schedule
            stages.append(LocalStage(s, sprog, g, module, pipe))
        self._compile_stages(stages, mb)
        cls = SCHEDULES[self.schedule.name]
        pipes = [st.pipe for st in stages]
        loss_fn = _weighted_loss
        if cm.program.mesh.cp > 1:  # each CP rank's weighted part, summed over the CP group (backward: 1 each)
            from ..ops.context_parallel import LossSum

            group = cm.groups.cp

            def loss_fn(output, target):
                return LossSum.apply(_weighted_loss(output, target), group)

        kw = dict(n_microbatches=self.schedule.microbatches, loss_fn=loss_fn, scale_grads=False)
        self._torch_schedule = cls(pipes if self.schedule.name == "interleaved_1f1b" else pipes[0], **kw)
        self.stages = stages

    def _compile_stages(self, stages: list[LocalStage], mb: dict[str, Any]) -> None:
        """Compile every local stage before the schedule starts — one forward on zero activations
        (the boundary shapes; float ones requiring grad, as received ones do), output dropped — so a
        rejected lease plan or a capture failure stops every rank at once, before any slot is written
        under the schedule, instead of leaving the other stages blocked in a receive."""
        from .dropless import uncounted

        err: BaseException | None = None
        try:
            with uncounted(self.cm.program.ctx_id):  # zero activations: the worst imbalance, not the run's load
                for st in stages:
                    acts = [torch.zeros_like(t).requires_grad_(t.is_floating_point())
                            for t in st.pipe._user_meta_inputs] if st.pipe is not None else []
                    st.module(*acts, **mb)
        except Exception as e:  # reported on every rank below
            err = e
        flag = torch.tensor([0 if err is None else 1 + self.cm.groups.rank], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if err is not None:
            raise err
        self.cm.reset_stats()  # the warm-up's expert counts are not a step's
        if int(flag):
            raise RuntimeFault(f"compiling the pipeline stages failed on rank {int(flag) - 1} (its error is raised "
                               "there); no rank started the schedule")

    # -- run ---------------------------------------------------------------------------------------
    def train_step(self, kwargs: dict[str, Any]) -> torch.Tensor:
        batch, err = kwargs, None
        try:
            baked = self.cm.baked.changed("train_step")
            if baked is not None:
                raise baked
            kwargs, w, shape, b = self._prepare(batch)
        except OptionError as e:  # agreed below: a refusal on one rank alone left the others in a receive
            err = e
        agree_on_batch(self.cm.model, batch, err, same_batch=(self.cm.groups.pp, self.cm.groups.cp))
        if self._torch_schedule is None:
            m = self.schedule.microbatches
            self._build({k: (v[: b // m] if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                         for k, v in kwargs.items()})
            self._shape = shape
        losses: list[torch.Tensor] = []
        cm = self.cm
        ctx = cm.ddp.no_sync() if cm.ddp is not None else contextlib.nullcontext()
        with ctx:
            self._torch_schedule.step(**kwargs, target=w, losses=losses, return_outputs=False)
        if cm.ddp is not None:
            cm.ddp.sync_now()
        last_rank = (self.split.num_stages - 1) % self.pp
        loss = torch.stack([x.detach().float() for x in losses]).sum() if losses else torch.zeros(())
        loss = loss.to(next(cm.model.parameters()).device)
        dist.broadcast(loss, group=cm.groups.pp, group_src=last_rank)
        return loss

    def _prepare(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor, tuple, int]:
        """This rank's checks of the batch and its microbatch weights (and CP shard): the kwargs the
        schedule takes, the weights w_j, the batch's shape signature and its size. Raises OptionError."""
        m = self.schedule.microbatches
        b = split_batch_check(kwargs, m)
        if kwargs.get("labels") is None:
            raise OptionError("a pipelined train_step needs labels=...: the last stage's loss is what the "
                              "schedule backpropagates (forward-only evaluation: call the model)")
        spec = self.cm.program.mesh
        if spec.cp > 1:  # this rank's sequence shard of every microbatch (runtime/context_parallel.py)
            from .context_parallel import shard_batch
            from .cp_balance_loss import check_balance_loss

            labels = kwargs["labels"]
            _refuse_position_ids(kwargs)
            check_balance_loss(self.cm.model, kwargs)
            kwargs = shard_batch(kwargs, spec.cp, self.cm.groups.cp_rank, count=False)
            # CP rank r's loss of microbatch j is the mean over its n_rj loss tokens: weighted n_rj / N, the
            # CP group's sum over ranks and microbatches is the batch's mean over its N loss tokens
            local = (kwargs["shift_labels"] != -100).reshape(m, -1).sum(1).double()
            total = (labels[..., 1:] != -100).sum().double()
            # no loss tokens at all: 1/m per microbatch over the group, as at cp = 1 (each rank adds the whole aux)
            w = (local / total).float() if total > 0 else torch.full((m,), 1.0 / (m * spec.cp))
        else:
            w = microbatch_weights(kwargs["labels"], m)
        shape = _signature(kwargs)
        if self._torch_schedule is not None and shape != self._shape:
            raise OptionError(f"train_step: batch shapes and call options {shape} differ from the first step's "
                              f"{self._shape}; a pipeline is compiled for one microbatch shape and the options "
                              "its capture read (output_router_logits=...); compile another CompiledMoE for others")
        return kwargs, w, shape, b

    # -- planning (explain) -------------------------------------------------------------------------
    def plan_stages(self, mb: dict[str, Any]) -> dict[int, Any]:
        """Compile *every* stage of the pipeline on this rank and run one forward and backward of each
        on zero activations (meta tensors in explain), so that each stage's graphs and lease plan
        exist for the ledger. Stage → its Program. Nothing is sent between ranks."""
        cm = self.cm
        if self.released and cm.program.options.mxfp8:
            raise OptionError("plan_stages compiles every stage on this rank, but the other stages' MXFP8 "
                              "compute-weight caches were released with their weights; plan without mxfp8")
        with materialized(self.released):  # the other stages' graphs run here, on uninitialised weights
            return self._plan_stages(mb)

    def _plan_stages(self, mb: dict[str, Any]) -> dict[int, Any]:
        from ..backend import MoEBackend
        from ..passes.split_stages import split_graph

        cm = self.cm
        gm, names, batch = self._capture(mb, ("loss",))
        graphs = split_graph(gm, self.split, names, batch, cm.model)
        fake = {n.name: n.meta.get("val") for n in gm.graph.nodes}
        device = next(cm.model.parameters()).device
        out = {}
        planned = self._planned_buckets()
        for s in range(self.split.num_stages):
            prog = self._program_for(s)
            if s % self.pp != self.pp_rank and planned:  # its owner's buckets, so that its backward reduces
                prog.reducer_id = planned[s % self.pp].id  # as there (this rank's reducer holds none of them)
            g = graphs[s]
            compiled = compile_entry(_stage_entry(g), backend=MoEBackend(prog), fullgraph=True, dynamic=False)
            acts = [_empty_like_val(fake[n], device).zero_().requires_grad_(fake[n].is_floating_point())
                    for n in g.activations_in]
            res = StageModule(g, compiled)(*acts, **mb)
            res = [t for t in (res if isinstance(res, tuple | list) else (res,)) if t.requires_grad]
            torch.autograd.backward(res, [torch.ones_like(t) for t in res])
            out[s] = prog
        self.planned = out  # every stage's program: the ledger reads the whole model's attention from them
        return out

    def _planned_buckets(self) -> dict[int, Any]:
        """pp rank → its stages' gradient buckets as its reducer builds them (kept with the plan; none
        without a reducer)."""
        from ..train.planned_buckets import planned_buckets

        cm = self.cm
        if cm.ddp is None:
            return {}
        owner = self.split.owner
        params = [(n, p) for n, p in cm.model.named_parameters() if n in owner]
        self._planning = {r: planned_buckets(cm.ddp, [(n, p) for n, p in params if owner[n] % self.pp == r],
                                             cm._expert_names)
                          for r in range(self.pp) if r != self.pp_rank}
        return self._planning

    def _program_for(self, s: int):
        import dataclasses as dc

        prog = self.cm.program
        layers = set(self.split.layers_of(s))
        blocks = {p: b for p, b in prog.blocks.items() if _layer_index(p, self.split.layers_path) in layers}
        return dc.replace(prog, blocks=blocks, graphs={}, training_graphs={}, records=[], lease_plans={}, kernel_plans={}, compiles=0,
                          options=dc.replace(prog.options, forwards_in_flight=self.schedule.in_flight.get(s, 1)),
                          pipeline_stage=s, schedule=self.schedule)

    # -- forward-only evaluation -------------------------------------------------------------------
    def forward(self, args: tuple, kwargs: dict[str, Any]) -> PipelineOutput:
        """Forward-only evaluation of the whole batch (under torch.no_grad()): the stages run in turn,
        boundary activations travel point-to-point, and the last stage's logits (and loss, given
        labels) are broadcast to every rank of the pipeline. Under cp > 1 every rank runs its
        sequence shard (as without a pipeline: runtime/context_parallel.py): the logits are the
        shard's (positions ``cm.cp_positions(S)``), the loss the whole sequences': each rank's shard mean
        weighted by its share of the loss tokens and summed over the CP group, as train_step weights it
        (so a load-balancing loss is added whole on each rank in both: runtime/cp_balance_loss.py)."""
        if args:
            raise OptionError("a pipelined CompiledMoE takes its batch by keyword (input_ids=..., labels=...)")
        if torch.is_grad_enabled():
            raise OptionError("a pipelined CompiledMoE (pp > 1) trains through cm.train_step(input_ids=..., "
                              "labels=...); calling it directly is forward-only evaluation: use torch.no_grad()")
        cp = self.cm.program.mesh.cp
        share = None
        from .batch_agreement import same_batch_in_groups

        same_batch_in_groups(kwargs, {"pipeline": self.cm.groups.pp, "context-parallel": self.cm.groups.cp},
                             next(self.cm.model.parameters()).device)
        if cp > 1:  # the shard's mean loss, weighted by its share of the batch's loss tokens
            from .context_parallel import shard_batch
            from .cp_balance_loss import check_balance_loss

            _refuse_position_ids(kwargs)
            check_balance_loss(self.cm.model, kwargs)
            labels = kwargs.get("labels")
            kwargs = shard_batch(kwargs, cp, self.cm.groups.cp_rank, count=False)
            if labels is not None:
                total = (labels[..., 1:] != -100).sum().double()
                share = ((kwargs["shift_labels"] != -100).sum().double() / total).float() if total > 0 else None
        outputs = ("logits", "loss") if kwargs.get("labels") is not None else ("logits",)
        key = (outputs, _signature(kwargs))  # a capture per shape and per call option it read
        if key not in self._eval:
            self._eval[key] = self._build_eval(kwargs, outputs)
        stages, fake = self._eval[key]
        cm, S, pp = self.cm, self.split.num_stages, self.pp
        device = next(cm.model.parameters()).device
        result: tuple = ()
        for k in range(S):
            if k not in stages:
                continue
            module, graph = stages[k]
            acts = []
            for name in graph.activations_in:
                t = _empty_like_val(fake[name], device)
                dist.recv(t, group=cm.groups.pp, group_src=(k - 1) % pp)
                acts.append(t)
            out = module(*acts, **kwargs)
            out = out if isinstance(out, tuple | list) else (out,)
            if k < S - 1:
                for t in out:
                    dist.send(t.contiguous(), group=cm.groups.pp, group_dst=(k + 1) % pp)
            else:
                result = tuple(out)
                if cp > 1 and "loss" in outputs:  # Σ over the CP group's weighted shards: the whole sequences'
                    from ..ops.context_parallel import LossSum

                    i = outputs.index("loss")
                    part = weighted_loss(result[i], share) if share is not None else result[i] * float("nan")
                    result = (*result[:i], LossSum.apply(part, cm.groups.cp), *result[i + 1:])
        last = (S - 1) % pp
        final = stages[S - 1][1] if S - 1 in stages else None
        names = final.activations_out if final is not None else None
        shapes = [None]
        if self.pp_rank == last:
            shapes = [names]
        dist.broadcast_object_list(shapes, group=cm.groups.pp, group_src=last)
        vals = []
        for i, name in enumerate(shapes[0]):
            t = result[i].contiguous() if self.pp_rank == last else _empty_like_val(fake[name], device)
            dist.broadcast(t, group=cm.groups.pp, group_src=last)
            vals.append(t)
        return PipelineOutput(**dict(zip(outputs, vals)))

    def _build_eval(self, kwargs: dict[str, Any], outputs: tuple[str, ...]):
        from ..backend import MoEBackend
        from ..passes.split_stages import split_graph

        cm = self.cm
        with torch.no_grad(), materialized(self.released):
            gm, names, batch = self._capture(kwargs, outputs)
        graphs = split_graph(gm, self.split, names, batch, cm.model, keep=set(self.local))
        fake = {n.name: n.meta.get("val") for n in gm.graph.nodes}
        stages = {}
        for st in self._stage_programs():
            g = graphs[st.pipeline_stage]
            compiled = compile_entry(_stage_entry(g), backend=MoEBackend(st), fullgraph=cm.program.options.fullgraph,
                                     dynamic=False)
            stages[st.pipeline_stage] = (StageModule(g, compiled), g)
        return stages, fake

    def _stage_programs(self) -> list:
        if not self._programs:
            self._programs = [self._program_for(s) for s in self.local]
        return self._programs


@dataclass
class PipelineOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


def _signature(kwargs: dict[str, Any]) -> tuple:
    """What one capture of the whole model was made for: the batch tensors' shapes and dtypes, and the
    other call arguments (output_router_logits=...), which the capture bakes in as constants."""
    return tuple(sorted(((k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, repr(v)))
                        for k, v in kwargs.items()))


def _refuse_position_ids(kwargs: dict[str, Any]) -> None:
    if "position_ids" in kwargs:  # stages after the first derive their shard's positions (context_parallel pass)
        raise OptionError("pipeline with context parallelism: every stage uses its shard's global positions "
                          "0..S-1; position_ids cannot be passed (pass none)")


def weighted_loss(loss: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """w_j · loss_j; a microbatch without loss tokens has weight 0 and loss 0/0 = NaN: it adds 0, not NaN."""
    w = w.to(loss.dtype)
    return torch.where(w > 0, loss * w, torch.zeros_like(loss))


def _weighted_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    return weighted_loss(output[0] if isinstance(output, tuple | list) else output, target.reshape(()))


def _layer_index(path: str, layers_path: str) -> int | None:
    prefix = layers_path + "."
    if not path.startswith(prefix):
        return None
    head = path[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None
