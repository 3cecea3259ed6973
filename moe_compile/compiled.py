"""CompiledMoE: the user-facing module returned by ``moe_compile``."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .errors import OptionError, RuntimeFault
from .frontend import MoEBlockSpec
from .frontend.baked_attrs import BakedAttrs
from .mesh import MeshGroups
from .options import as_integer
from .program import Program
from .runtime import get_context, release_context
from .train import MultiGroupDistributedDataParallel


def _loss_of(out: Any) -> torch.Tensor:
    """The loss of a forward's output for train_step: its ``.loss`` (a ModelOutput) or ``["loss"]``."""
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        if loss is not None:
            what = "a loss that is not one value"
        else:
            what = "no loss (were labels passed?)" if isinstance(out, dict) or hasattr(out, "loss") else "no .loss"
        raise OptionError(f"train_step: the model's forward returned {type(out).__name__} with {what}; it needs an "
                          "output with a one-value .loss (a ModelOutput, as transformers' models return) or a dict "
                          "with 'loss'")
    return loss.reshape(())


class CompiledMoE(nn.Module):
    """An expert-parallel program built from a single-device MoE model.

    Called exactly like the original model, on every rank, each with its own micro-batch. Holds the
    canonicalised model (``.model``): dense parameters replicated, routed experts sharded over ep_mp;
    at pp > 1 the other stages' parameters hold no values (runtime/stage_weights.py).
    """

    def __init__(self, model: nn.Module, program: Program, groups: MeshGroups | None,
                 ddp: MultiGroupDistributedDataParallel | None, compiled: Any, baked: BakedAttrs | None = None) -> None:
        super().__init__()
        self.model = model
        self.program = program
        self.groups = groups
        self.ddp = ddp
        if ddp is not None:  # the compiled backward's reduction nodes reach it by context id
            ddp.attach(program.ctx_id, program.param_names)
        self._compiled = compiled
        self.baked = baked or BakedAttrs()  # plain attributes the replaced code read when compiling
        self._expert_names = {
            name for spec in program.blocks.values() for name in spec.expert_param_names
        }
        self.pipeline = None  # runtime.pipeline_runtime.PipelineRuntime on a pp > 1 mesh
        # OLMoDDPOptimizers over this model: load_state_dict sets their FP32 main weights too, else the
        # next step's copy-back would write the weights held before the load over the loaded ones
        self.optimizers: weakref.WeakSet = weakref.WeakSet()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from .runtime.token_range import check_on_host

        err = self.baked.changed("forward")
        if err is not None:
            raise err
        check_on_host(self.model, args, kwargs, "forward")
        return self._forward(args, kwargs)

    def _forward(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        if self.pipeline is not None:
            return self.pipeline.forward(args, kwargs)  # its capture translates capture errors itself
        if self.program.mesh.cp > 1:  # this rank's sequence shard; the loss is the whole sequence's
            from .ops.context_parallel import LossSum
            from .runtime.context_parallel import shard_batch

            if args:
                raise OptionError("under context parallelism pass the batch by keyword (input_ids=..., labels=...)")
            from .runtime.batch_agreement import same_batch_in_groups
            from .runtime.cp_balance_loss import check_balance_loss, whole_sequence_balance_loss

            cp = self.program.mesh.cp
            check_balance_loss(self.model, kwargs)
            shard = shard_batch(kwargs, cp, self.groups.cp_rank)
            same_batch_in_groups(kwargs, {"context-parallel": self.groups.cp}, next(self.model.parameters()).device)
            as_tuple = shard.get("return_dict") is False  # run as a ModelOutput: its fields are found by name
            if as_tuple:
                shard["return_dict"] = True
            with whole_sequence_balance_loss(self.model, self.program.ctx_id, cp):  # its aux/cp on each rank
                out = self._run_compiled((), shard)
            if getattr(out, "loss", None) is not None:
                out.loss = LossSum.apply(out.loss, self.groups.cp)
            if isinstance(getattr(out, "aux_loss", None), torch.Tensor):  # each rank's aux/cp: the whole value
                out.aux_loss = LossSum.apply(out.aux_loss, self.groups.cp)
            if getattr(out, "past_key_values", None) is not None:  # config.use_cache: this shard's keys only
                out.past_key_values = None
            if hasattr(out, "to_tuple"):
                return out.to_tuple() if as_tuple else out
            if isinstance(out, tuple) and out and kwargs.get("labels") is not None:  # a model's own tuple: loss first
                out = (LossSum.apply(out[0], self.groups.cp), *out[1:])
            return out
        return self._run_compiled(args, kwargs)

    def _run_compiled(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        try:
            return self._compiled(*args, **kwargs)
        except Exception as e:
            from .capture import capture_error

            err = capture_error(e, self.model)  # data-dependent control flow: name the module and the line
            if err is None:
                raise
            raise err from e

    def cp_positions(self, seq: int) -> torch.Tensor:
        """Global positions of this rank's tokens (its logits' sequence order) under context parallelism."""
        from .runtime.context_parallel import shard_positions

        return shard_positions(seq, self.program.mesh.cp, self.groups.cp_rank if self.groups else 0)

    def train_step(self, *, microbatches: int | None = None, **batch: Any) -> torch.Tensor:
        """Forward and backward of this data-parallel replica's batch as m microbatches (the pipeline
        schedule at pp > 1, gradient accumulation at pp = 1), gradients reduced once. Returns the
        replica's loss (the batch-mean token loss: microbatch j weighted by its share of the loss
        tokens) on every rank. Every rank of one pipeline (and of one CP group) passes the same batch.
        m: the compile option ``microbatches``; at pp = 1 ``microbatches=`` here may change it. A batch
        that any rank refuses is refused on every rank before the step runs (runtime/batch_agreement.py)."""
        if self.pipeline is not None:
            if microbatches not in (None, self.pipeline.schedule.microbatches):
                raise OptionError(f"train_step(microbatches={microbatches}): this pipeline's schedule was compiled "
                                  f"for microbatches={self.pipeline.schedule.microbatches}")
            return self.pipeline.train_step(batch)
        from .runtime.batch_agreement import agree_on_batch
        from .runtime.pipeline_runtime import microbatch_weights, split_batch_check, weighted_loss
        from .runtime.token_range import batch_layout_error

        m = self.program.options.microbatches if microbatches is None else microbatches
        err = None
        try:  # this rank's refusals, agreed over the world before any rank runs a collective of the step
            if as_integer(m) is None or m < 1:
                raise OptionError(f"train_step(microbatches={microbatches!r}): must be an int >= 1")
            m = as_integer(m)
            baked = self.baked.changed("train_step")
            if baked is not None:
                raise baked
            if batch.get("labels") is None and batch.get("shift_labels") is None:
                raise OptionError("train_step needs labels=... (or shift_labels=...): the step's loss is the "
                                  "model's loss on them")
            if batch.get("return_dict") is False:
                raise OptionError("train_step(return_dict=False): train_step reads the model output's loss and "
                                  "returns it; leave return_dict out")
            layout = batch_layout_error(batch, "train_step")
            if layout is not None:
                raise layout
            b = split_batch_check(batch, m)
            if self.program.mesh.cp > 1:
                from .runtime.context_parallel import shard_batch
                from .runtime.cp_balance_loss import check_balance_loss

                check_balance_loss(self.model, batch)
                shard_batch(batch, self.program.mesh.cp, self.groups.cp_rank, count=False)
        except OptionError as e:
            err = e
        agree_on_batch(self.model, batch, err, same_batch=(self.groups.cp,) if self.groups is not None else ())
        if batch.get("labels") is not None:
            w = microbatch_weights(batch["labels"], m)
        else:
            w = microbatch_weights(batch["shift_labels"], m, shifted=True)
        total = None
        for j in range(m):
            mb = {k: (v[j * b // m:(j + 1) * b // m] if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                  for k, v in batch.items()}
            with self.no_sync() if j < m - 1 else contextlib.nullcontext():
                loss = _loss_of(self(**mb))
                (loss * w[j].to(loss.dtype)).backward()
            part = weighted_loss(loss.detach().float(), w[j])
            total = part if total is None else total + part
        return total

    def owns(self, name: str) -> bool:
        """Whether this rank's pipeline stages hold parameter ``name`` (always, at pp = 1)."""
        return self.program.owned is None or name in self.program.owned

    # -- gradients ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Defer gradient reduction (gradient accumulation over micro-batches)."""
        if self.ddp is None:
            yield
            return
        with self.ddp.no_sync():
            yield

    # -- views of the whole model ------------------------------------------------------------------
    def is_expert_param(self, name: str) -> bool:
        return name in self._expert_names

    def _gather_experts(self, t: torch.Tensor) -> torch.Tensor:
        if self.program.ep_size == 1:
            return t.detach().clone()
        parts = [torch.empty_like(t) for _ in range(self.program.ep_size)]
        dist.all_gather(parts, t.detach().contiguous(), group=self.groups.ep_mp)
        return torch.cat(parts)

    def _full(self, pick) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        views = {v.canonical: [] for s in self.program.blocks.values() for v in s.param_views}
        for s in self.program.blocks.values():
            for v in s.param_views:
                views[v.canonical].append(v)
        for name, p in self.model.named_parameters():
            if not self.owns(name):
                continue
            t = pick(name, p)
            if name not in self._expert_names:
                out[name] = t.detach().clone()
                continue
            full = self._gather_experts(t)
            for v in views[name]:
                out[v.original] = v.original_of(full)
        if self.pipeline is not None:  # every stage's tensors, on every rank of the pipeline
            parts: list = [None] * self.program.mesh.pp
            dist.all_gather_object(parts, out, group=self.groups.pp)
            for part in parts:
                out.update(part)
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameter tensors on every rank, keyed by the original model's parameter names."""
        return self._full(lambda n, p: self.weight_value(n, p))

    def weight_value(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A parameter's full-precision value: an FP8WeightStore's main weight once its BF16 anchor
        was released (the parameter then holds no values), else the tensor itself."""
        for store in self.compute_weights():
            if store.name == name and store.anchor_released:
                return store.value().to(t.dtype)
        return t

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full (reduced) gradients, keyed by the original model's parameter names. Collective."""
        return self._full(self._grad_of)

    def _grad_of(self, _name: str, p: torch.Tensor) -> torch.Tensor:
        """The optimizer-facing gradient: the bucket's main_grad under DDP, else p.grad."""
        if self.ddp is not None and p.requires_grad:
            return self.ddp.full_grad(p)  # collective when reduce-scattered (an OLMoDDPOptimizer is attached)
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """Checkpoint views: DTensors over the dense mesh (replicated) and the MoE mesh (experts
        sharded on ep_mp, replicated on ep_dp) for torch.distributed.checkpoint."""
        from .train.checkpoint_views import checkpoint_views

        return checkpoint_views(self)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False):  # type: ignore[override]
        from .train.checkpoint_views import load_checkpoint_views

        return load_checkpoint_views(self, state_dict, strict=strict)

    # -- inspection --------------------------------------------------------------------------------
    @property
    def blocks(self) -> dict[str, MoEBlockSpec]:
        return self.program.blocks

    def stats(self) -> dict[str, Any]:
        """Runtime counters: transport bytes per group and kind, call counts, expert token counts."""
        ctx = get_context(self.program.ctx_id)
        out = ctx.stats.summary()
        out["expert_counts"] = self.expert_counts()
        return out

    def reset_stats(self) -> None:
        get_context(self.program.ctx_id).stats.reset()

    def expert_counts(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per MoE block, the last forward's requested and kept token-k rows per expert (this rank's tokens)."""
        ctx = get_context(self.program.ctx_id)
        return {b: {"requested": r, "kept": k} for b, (r, k) in ctx.stats.expert_counts.items()}

    # -- MXFP8 compute weights -------------------------------------------------------------------
    def compute_weights(self) -> list:
        """The FP8WeightStores of this rank (empty without mxfp8)."""
        return list(get_context(self.program.ctx_id).weight_stores.values())

    def refresh_compute_weights(self) -> None:
        """Copy-back: rebuild every MXFP8 compute-weight cache from its weight (after a step or a load)."""
        for store in self.compute_weights():
            store.refresh_from()

    def lease_plan(self, which: str = "training"):
        """The compile-time lease plan (moe_compile.leases.LeasePlan) of the last training (or
        "inference") capture: payloads, sizes, lifetimes, slots, high-water per stage and family;
        None before the first such capture."""
        if self.pipeline is not None:  # this rank's stages: one plan per stage, merged (stages are disjoint)
            from .leases import merge_plans

            plans = [p.lease_plans.get(which) for p in self.pipeline._stage_programs()]
            return merge_plans([p for p in plans if p is not None]) if any(plans) else None
        return self.program.lease_plans.get(which)  # None until a step of that kind was captured

    def lease_runtime(self):
        """The runtime lease pools (observed high-water, symmetric bytes), or None off the symmetric transport."""
        return get_context(self.program.ctx_id).leases

    def kernels(self) -> dict[str, list[dict[str, Any]]]:
        """Per MoE layer (original module path), the generated kernels its lowered forward and backward
        graphs launch: name, op, graph, specialisation, config and launch grid (codegen="triton"; empty
        lists under torch codegen). Graphs are compiled at the first call (backward: first backward),
        and a config still to be autotuned on the GPU shows as such until its first launch."""
        from .codegen.kernel_cache import describe_plan

        out: dict[str, list[dict[str, Any]]] = {b: [] for b in self.program.blocks}
        for graph, records in self.program.kernel_plans.items():
            for block, op, plans in records:
                out[block].extend(describe_plan(p, op, graph) for p in plans)
        return out

    def graphs(self) -> dict[str, torch.fx.GraphModule]:
        """Graphs of the last capture: captured (dense), partitioned, joint, forward, backward."""
        return dict(self.program.graphs)

    def ledger(self, **kw: Any):
        """The cost ledger evaluated for this program (:mod:`moe_compile.ledger`; options: micro_batches,
        optimizer_state_bytes, main_weights, tokens, seq_len, load_imbalance, sharded_optimizer,
        reduce_scatter). Graph figures need one training step."""
        from .ledger import ledger_for

        return ledger_for(self, **kw)

    def close(self) -> None:
        """Release the runtime context, its symmetric heap (NVSHMEM finalizes with the last heap of the
        process) and the gradient buckets' shared memory. Collective over the EP group when the transport
        is symmetric: call on every rank."""
        try:
            leases = get_context(self.program.ctx_id).leases
        except RuntimeFault:  # closed already
            return
        release_context(self.program.ctx_id)
        if leases is not None and leases.heap is not None:
            leases.heap.close()
        if self.ddp is not None:
            self.ddp.close()

