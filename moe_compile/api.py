"""moe_compile(): front end → passes → codegen → runtime, returning a CompiledMoE."""

from __future__ import annotations

import platform
import socket
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .attention_ops import no_sdpa_form
from .backend import MoEBackend
from .capture import compile_entry, fresh
from .codegen.dense_fusion import resolve_dense_fusion
from .codegen.triton_mode import resolve_codegen
from .compiled import CompiledMoE
from .errors import MeshError, OptionError, UnsupportedFeatureError
from .frontend import canonicalize, recognize
from .frontend.baked_attrs import baked_attrs
from .frontend.prepare import prepare_for_capture
from .frontend.structure import expert_codegen
from .mesh import MeshSpec
from .models.hf_compressed import COMPRESSED_KINDS, compressed_attention_modules, use_compressed_attention
from .models.hf_halos import halo_modules, use_halo_modules
from .models.hf_indexed import indexed_attention_modules, use_indexed_attention
from .models.hf_mixers import MIXER_NAMES, RECURRENT_KINDS, recurrent_mixers, use_whole_sequence_mixers
from .models.hf_qsa import use_static_qsa
from .models.hf_sinks import sink_parameter, use_sink_attention
from .options import CompileOptions, schedule_without_pipeline
from .program import Program
from .runtime import (
    AllToAllTransport,
    LocalTransport,
    RuntimeContext,
    RuntimeStats,
    get_context,
    register_context,
)
from .runtime.lease_runtime import LeaseRuntime
from .runtime.symmetric import make_heap
from .runtime.symmetric.host import shm_signals_supported
from .runtime.symmetric_transport import SymmetricTransport
from .train import MultiGroupDistributedDataParallel, ParamFamily


def _capture_entry(model: nn.Module):
    """The function torch.compile captures for one CompiledMoE: it calls ``model``, and its code object
    is its own.

    Dynamo keeps its cache entries, recompile counts and frame decisions (skip, run-only) on code
    objects. A model's forward code (with transformers' forward decorators) is shared by every
    instance of its class and every torch.compile of one in the process, so compiling ``model`` itself
    would let the user's other compiles (a reference or eval copy) decide for this one: a copy that
    exhausts its recompile limit leaves that code run-only (this program would never compile), one
    that gives up on those frames leaves them skipped (this program would be captured piecemeal, below
    transformers' output capturing). The model's own code is inlined into this entry, and no global
    dynamo setting is changed.
    """

    def moe_entry(*args, **kwargs):
        return model(*args, **kwargs)

    return fresh(moe_entry)


def moe_compile(model: nn.Module, mesh: MeshSpec | str | None = None, **options: Any) -> CompiledMoE:
    """Compile an ordinary single-device MoE ``model`` into an expert-parallel program on ``mesh``.

    Called identically on every rank of an initialised torch.distributed world (or in a single
    process for a one-rank mesh). Takes ownership of ``model``: its routed-expert weights are replaced
    by this rank's shard. Options: see :class:`CompileOptions`.
    """
    opts = CompileOptions.from_kwargs(options)
    _check_not_compiled(model)
    codegen = resolve_codegen(opts.codegen, _device_type(model))
    resolve_dense_fusion(opts.dense_fusion, _device_type(model))  # no C++ compiler for "inductor": fail here
    if isinstance(mesh, str):
        mesh = MeshSpec.parse(mesh)
    mesh = mesh or MeshSpec()
    world = dist.get_world_size() if dist.is_initialized() else 1
    spec = mesh.resolve(world)
    schedule = _schedule_for(spec, opts)
    whole_mixers: list[str] = []
    if spec.cp > 1:
        _check_context_parallel(model, spec)
        use_sink_attention(model)  # GPT-OSS & co.: their sink attention as one op the CP pass shards
        use_indexed_attention(model, spec.cp)  # DeepSeek-V3.2 & co.: their indexer over the whole sequence's keys
        use_compressed_attention(model, spec.cp)  # DeepSeek-V4: each rank pools its windows, entries gathered
        whole_mixers = use_whole_sequence_mixers(model, spec.cp)  # linear attention over the whole sequence
        use_halo_modules(model, spec.cp)  # Zaya's convolutional attention: each chunk with its halo
    use_static_qsa(model)  # Qwen4-Exp: its token indexer's per-query loop as one static graph
    groups = spec.build(_device_type(model)) if dist.is_initialized() else None
    if groups is not None:
        _broadcast_from_rank0(model)
    blocks = recognize(model)
    phases = None
    if schedule is not None:  # before canonicalising: the probe forward runs the blocks' own forward
        from .passes.split_stages import outside_phases

        phases = outside_phases(model, [s for s, _ in blocks])
    codegen = expert_codegen([s for s, _ in blocks], opts.mxfp8, codegen, opts.codegen)
    for s, _ in blocks:
        if opts.capacity_factor is not None and (s.router.identity_experts or s.router.null_experts):
            raise UnsupportedFeatureError(
                f"{s.path}: identity / null experts (tokens routed to them are dispatched with weight 0) with "
                f"capacity_factor={opts.capacity_factor}: those rows would take capacity from the real ones; "
                "use capacity_factor=None (dropless)")
        if s.experts.num_experts % spec.ep_mp:
            raise MeshError(
                f"{s.path}: {s.experts.num_experts} routed experts cannot be split evenly over ep_mp={spec.ep_mp}"
            )
    ep_rank = groups.ep_rank if groups else 0
    stats = RuntimeStats()
    transport, leases, kind = make_transport(spec, groups, opts, stats)
    ctx_id = register_context(RuntimeContext(transport, stats, leases=leases,
                                             cp_group=groups.cp if groups is not None else None,
                                             cp_aux_divisor=spec.cp if spec.pp == 1 else 1))
    canonicalize(blocks, spec.ep_mp, ep_rank, ctx_id)
    baked = baked_attrs([(s, c.block) for s, c in blocks])
    if spec.cp > 1 and spec.ep_mp > 1 and opts.capacity_factor is None:
        from .runtime.dropless import dropless_state

        dropless_state(ctx_id, spec.ep_mp, opts.dropless_headroom).sync_group = groups.dense  # CP all-gathers span EP-MP groups
    if opts.mxfp8:
        attach_weight_stores(model, [s for s, _ in blocks], get_context(ctx_id), opts)
    program = Program(
        blocks={s.path: s for s, _ in blocks}, options=opts, mesh=spec, ctx_id=ctx_id, ep_size=spec.ep_mp,
        ep_rank=ep_rank, ep_group_name=groups.ep_mp.group_name if groups else "local", transport=kind,
        cp_rank=groups.cp_rank if groups else 0, cp_length_positions=cp_length_positions(model) if spec.cp > 1 else {},
        cp_windows=cp_attention_windows(model) if spec.cp > 1 else {},
        cp_chunks=cp_attention_chunks(model) if spec.cp > 1 else {},
        cp_whole_mixers=tuple(whole_mixers),
        codegen=codegen,
    )
    program.param_names = {id(p): n for n, p in model.named_parameters()}
    if opts.mxfp8 in ("experts+shared", "all"):
        program.dense_weight_stores = dense_weight_stores(model, [s for s, _ in blocks], opts)
        for name, store in program.dense_weight_stores.items():
            get_context(ctx_id).weight_stores[(name, "w")] = store
    split = None
    if schedule is not None:
        from .passes.split_stages import plan_split

        split = plan_split(model, [s for s, _ in blocks], schedule.pp * schedule.stages_per_rank, opts.pp_split,
                           phases)
        local = {groups.pp_rank + k * spec.pp for k in range(schedule.stages_per_rank)}
        program.owned = ({n for n, st in split.owner.items() if st in local or local & set(split.tied.get(n, ()))}
                         | {n for n, _ in model.named_buffers()})  # a tied weight: under all its names
    tied = []
    if split is not None and split.tied and groups is not None:
        from .runtime.tied_weights import tied_weights

        tied = tied_weights(model, split.tied, spec, groups)
        program.tied_copies = {n for t in tied if not t.first for n in t.names}
    ddp = _reducer(model, program, groups, tied) if groups is not None else None
    prepare_for_capture(model)
    if split is not None:
        from .runtime.pipeline_runtime import PipelineRuntime
        from .runtime.stage_weights import release_foreign_weights

        released = release_foreign_weights(model, program.owned, get_context(ctx_id), program.dense_weight_stores)
        cm = CompiledMoE(model, program, groups, ddp, None, baked)
        cm.pipeline = PipelineRuntime(cm, split, schedule, released)
        return cm
    compiled = compile_entry(_capture_entry(model), backend=MoEBackend(program), fullgraph=opts.fullgraph,
                             dynamic=False)
    return CompiledMoE(model, program, groups, ddp, compiled, baked)


# layer kinds context parallelism reproduces exactly (sliding windows and chunks: the attention mask's,
# cp_attention_windows and cp_attention_chunks)
CP_LAYER_KINDS = ("full_attention", "attention", "moe", "sliding_attention", "chunked_attention")
# layer kinds whose token mixing is attention and short causal convolutions (LFM2, Inkling): admitted when
# every convolution of the model is one (cp_convs)
CONV_LAYER_KINDS = ("conv", "hybrid", "hybrid_sliding")


def _short_causal_conv(m: nn.Module) -> bool:
    """A depthwise Conv1d with stride 1, dilation 1 and padding kernel − 1 (the causal short convolution)."""
    return (isinstance(m, nn.Conv1d) and m.groups == m.in_channels == m.out_channels and m.stride == (1,)
            and m.dilation == (1,) and m.padding == (m.kernel_size[0] - 1,))


def _check_context_parallel(model: nn.Module, spec: MeshSpec) -> None:
    """Features the sharded sequence cannot reproduce exactly: refused before anything is built."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "output_router_logits", False):
        from .runtime.cp_balance_loss import unsupported_balance_loss

        why = unsupported_balance_loss(model)  # else runtime/cp_balance_loss.py makes it the whole sequences'
        if why is not None:
            raise UnsupportedFeatureError(
                f"mesh {spec}: the model's load-balancing loss (config.output_router_logits=True) under context "
                f"parallelism ({why}) would use one sequence shard's router statistics; set "
                "output_router_logits=False or use cp=1")
    # Only (sliding-window, chunked or indexed) causal attention is made whole across the shards, and linear
    # attention layers pass states (models/hf_state_passing.py) or run their mixer on the whole sequence; any
    # other token mixer would run on this rank's shard alone.
    types = getattr(cfg, "layer_types", None) or []
    kinds = [str(t) for t in list(types) + list(getattr(cfg, "layers_block_type", None) or [])]
    haloed = tuple(f"{p}." for p in halo_modules(model))  # models/hf_halos.py: these run with halos
    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv1d | nn.Conv2d)
             and not n.startswith(haloed)]
    other_conv = next((n for n, m in convs if not _short_causal_conv(m)), None)
    # short causal convolutions (passes/cp_convs.py) make LFM2's conv layers whole, and the convolved keys and
    # values of Inkling's hybrid layers (whose attention the CP pass then judges), as halos make Zaya's
    # convolutional attention (models/hf_halos.py); no other conv may mix tokens
    admitted = CP_LAYER_KINDS + (CONV_LAYER_KINDS if (convs or haloed) and other_conv is None else ()) \
        + (("indexed_attention",) if indexed_attention_modules(model) else ()) \
        + (COMPRESSED_KINDS if compressed_attention_modules(model) else ()) \
        + (RECURRENT_KINDS if recurrent_mixers(model) else ())  # models/hf_indexed.py, models/hf_mixers.py
    other = sorted({k for k in kinds if k not in admitted
                    or (k == "chunked_attention" and not getattr(cfg, "attention_chunk_size", None))})
    if other or (getattr(cfg, "attention_chunk_size", None) and not types):
        layers = [i for i, t in enumerate(kinds) if t in other]
        raise UnsupportedFeatureError(
            f"mesh {spec}: layers of kind {other or ['chunked_attention']} (config.layer_types, layers {layers or 'all'}) "
            "under context parallelism: only attention (full, sliding, chunked, DSA- or QSA-indexed, DeepSeek-V4's "
            "compressed) and linear attention "
            f"whose mixer is a child {'/'.join(MIXER_NAMES)} run across the shards, these would mix tokens "
            "within one rank's shard only; use cp=1")
    if other_conv is not None:
        raise UnsupportedFeatureError(
            f"mesh {spec}: {other_conv} is a convolution (token mixing over the sequence) that would see one "
            "rank's shard only under context parallelism: only short causal ones (depthwise, stride 1, "
            "dilation 1, padding kernel − 1) are made whole; use cp=1")
    if getattr(model, "_supports_sdpa", True) is False and sink_parameter(model) is None:
        # transformers has no SDPA form of its attention, and it holds no sinks (those run as
        # moe_cp::sink_attention: models/hf_sinks.py). Refused here, not per stage: a pipeline stage whose
        # layers hold no such attention was told to switch to SDPA, which the model cannot do
        raise no_sdpa_form(type(model).__name__, False, f"mesh {spec}")


def cp_attention_windows(model: nn.Module) -> dict[str, int]:
    """Sliding-window attention under context parallelism: decoder layer index ("*": every layer) → its
    window, read from the config as transformers' masks read it: ``config.sliding_window`` (not None or 0,
    and use_sliding_window not False) on the layers whose ``config.layer_types`` entry is sliding, or on
    every layer when the config has no layer_types. The CP mask applies it over the whole sequence
    (moe_cp::causal_mask: key within the window before its query)."""
    cfg = getattr(model, "config", None)
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return {}
    types = getattr(cfg, "layer_types", None) or []
    if not types:
        return {"*": int(window)}
    # DeepSeek-V4's compressed layers read their uncompressed keys through the same sliding-window mask
    return {str(i): int(window) for i, t in enumerate(types) if "sliding" in str(t) or t in COMPRESSED_KINDS}


def cp_attention_chunks(model: nn.Module) -> dict[str, int]:
    """Chunked attention under context parallelism (Llama 4): decoder layer index → ``config.attention_chunk_size``
    on the layers whose ``config.layer_types`` entry is "chunked_attention" (each query attends causally
    within its chunk; moe_cp::causal_mask applies it over the whole sequence)."""
    cfg = getattr(model, "config", None)
    chunk = getattr(cfg, "attention_chunk_size", None)
    types = getattr(cfg, "layer_types", None) or []
    return {str(i): int(chunk) for i, t in enumerate(types) if t == "chunked_attention"} if chunk else {}


def cp_length_positions(model: nn.Module) -> dict[str, int]:
    """Modules that make positions from the length of what they see (passes/cp_positions.py), each with
    the first position where a shard's own positions would change its result. Llama 4's attention
    temperature tuning scales each query of its NoPE layers by log(⌊(pos + 1) / floor_scale⌋ + 1)·attn_scale
    + 1, with pos = arange over the hidden states' length: every position below floor_scale − 1 scales
    by 1 either way."""
    return {name: int(getattr(m, "floor_scale", 8192)) - 1 for name, m in model.named_modules()
            if getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True)}


def _check_not_compiled(model: nn.Module) -> None:
    """moe_compile takes ownership of a model (its MoE blocks run the canonical forward, its experts hold
    this rank's shard): compiling it again would recognise that form, not the user's model."""
    from .frontend.canonical import installed

    done = next((name for name, m in model.named_modules() if installed(m)), None)
    if done is not None:
        raise OptionError(f"{done or type(model).__name__}: this model was already compiled by moe_compile (or a "
                          "moe_compile of it failed part-way), which takes ownership of it (its MoE blocks run the "
                          "compiled form and hold this rank's expert shard); compile a fresh copy of the model "
                          "(copy.deepcopy before the first moe_compile)")


def _schedule_for(spec: MeshSpec, opts: CompileOptions):
    """The pipeline schedule's action order (None at pp=1, where train_step accumulates instead)."""
    from .schedules import ScheduleOrder, check_schedule

    v = opts.stages_per_rank or (2 if opts.schedule == "interleaved_1f1b" else 1)
    check_schedule(opts.schedule, spec.pp, opts.microbatches, v)
    if spec.pp == 1:
        if opts.changed("schedule"):
            raise OptionError(schedule_without_pipeline(f"schedule={opts.schedule!r}"))
        if opts.pp_split is not None:
            raise OptionError(f"pp_split={list(opts.pp_split)}: the mesh has pp=1, so there are no pipeline stages "
                              "to split; drop pp_split or set pp in the mesh")
        return None
    if opts.microbatches < spec.pp and opts.schedule != "gpipe":
        raise OptionError(f"schedule={opts.schedule!r} on pp={spec.pp} needs microbatches ≥ pp, got "
                          f"{opts.microbatches}")
    return ScheduleOrder.build(opts.schedule, spec.pp, opts.microbatches, v)


def _device_type(model: nn.Module) -> str:
    p = next(iter(model.parameters()), None)
    return p.device.type if p is not None else "cpu"


def _hosts(group: dist.ProcessGroup) -> set[str]:
    """The host names of the group's ranks (collective over the group)."""
    names: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, socket.gethostname(), group=group)
    return set(names)


def make_transport(spec: MeshSpec, groups, opts: CompileOptions, stats: RuntimeStats):
    """(transport, lease runtime or None, resolved kind) for this rank's EP-MP group."""
    if groups is None or spec.ep_mp == 1:
        return LocalTransport(stats), None, "local"
    kind = opts.transport
    # CPU ranks share memory only on one host (GPUs reach peers through NVSHMEM); explain plans on a
    # fake process group, with no hosts to compare
    hosts: set = set()
    if kind in ("auto", "symmetric") and groups.device_type == "cpu" and dist.get_backend(groups.ep_mp) != "fake":
        hosts = _hosts(groups.ep_mp)
    one_host = len(hosts) <= 1
    if kind == "symmetric" and not one_host:
        raise OptionError(f"transport='symmetric' on CPU ranks needs the EP-MP group on one host; its ranks "
                          f"run on {sorted(hosts)}")
    if kind == "auto":
        kind = "symmetric" if one_host and groups.device_type == "cpu" else "all_to_all"
    if kind == "symmetric":
        heap = make_heap(groups.ep_mp, groups.device_type)
        leases = LeaseRuntime(heap, groups.ep_mp, poison=opts.lease_debug)
        return SymmetricTransport(heap, leases, stats), leases, kind
    return AllToAllTransport(groups.ep_mp, stats), None, kind


def attach_weight_stores(model: nn.Module, specs, ctx, opts: CompileOptions) -> None:
    """An FP8WeightStore (MXFP8 compute-weight caches) for every routed-expert weight."""
    from .train.fp8_weight_store import FP8WeightStore

    params = dict(model.named_parameters())
    for s in specs:
        for which, name in (("w_in", s.in_name), ("w_out", s.out_name)):
            ctx.weight_stores[(s.path, which)] = FP8WeightStore(params[name], name, opts.mxfp8_scale_mode)


def dense_weight_stores(model: nn.Module, specs, opts: CompileOptions) -> dict:
    """FP8WeightStores of the dense linears that run in MXFP8: shared experts ("experts+shared") or
    every dense linear ("all"), except routers and weights whose dimensions are not multiples of 32
    (those stay high-precision)."""
    from .train.fp8_weight_store import FP8WeightStore

    expert = {n for s in specs for n in s.expert_param_names}
    routers = {s.router_weight_name for s in specs}
    shared = tuple(f"{s.path}.{s.shared_attr}.".lstrip(".") for s in specs if s.shared_attr)
    linear = {f"{m}.weight".lstrip(".") for m, mod in model.named_modules() if isinstance(mod, nn.Linear)}
    out = {}
    for name, p in model.named_parameters():
        if name not in linear or name in expert or name in routers or p.shape[0] % 32 or p.shape[1] % 32:
            continue
        if opts.mxfp8 == "experts+shared" and not name.startswith(shared):
            continue
        out[name] = FP8WeightStore(p, name, opts.mxfp8_scale_mode)
    return out


def _broadcast_from_rank0(model: nn.Module) -> None:
    """Every rank starts from rank 0's weights (as DDP does), before experts are sharded."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)


def _reducer(model: nn.Module, program: Program, groups, tied: list | None = None) -> MultiGroupDistributedDataParallel:
    expert_names = {n for s in program.blocks.values() for n in s.expert_param_names}
    dense, expert = [], []
    for name, p in model.named_parameters():
        if program.owned is not None and name not in program.owned:
            continue  # another pipeline stage's parameter
        (expert if name in expert_names else dense).append(p)
    spec = program.mesh
    dpcp = spec.dp * spec.cp
    # A CP group's ranks each hold their tokens' part of one replica's loss gradient: sum over cp,
    # average over dp (cp = 1: the plain average over the dp replicas). As a mean over dp·cp of gradients
    # pre-scaled by cp, so that a gradient already reduced (accumulated over steps without zeroing) stays
    # as it is: summed over cp it was multiplied by cp at every later step (1×, 3×, 7× at cp = 2).
    fams = [
        ParamFamily("dense", dense, groups.dense if dpcp > 1 else None, 1.0 / dpcp, pre_scale=float(spec.cp)),
        ParamFamily("expert", expert, groups.ep_dp if spec.ep_dp > 1 else None, 1.0 / spec.ep_dp,
                    pre_scale=spec.cp / spec.ep_mp),
    ]
    return MultiGroupDistributedDataParallel(fams, bucket_bytes=int(program.options.bucket_mb * 2**20),
                                             host_shm=_grad_host_shm(program.options, fams, groups.device_type),
                                             tied=[(t.param, t.group, t.size) for t in tied or []])


def _grad_host_shm(opts: CompileOptions, fams: list[ParamFamily], device_type: str) -> bool:
    """Whether the gradient buckets reduce through host shared memory (train/shm_reduce.py): CPU ranks,
    x86-64 (the flags rely on its store order), every replica group on one host."""
    groups = [f.group for f in fams if f.group is not None]
    if opts.grad_transport == "process_group" or not groups or any(dist.get_backend(g) == "fake" for g in groups):
        return False
    why = None
    if device_type != "cpu":
        why = f"the parameters are on {device_type}, not CPU ranks"
    elif not shm_signals_supported():
        why = f"its flags need x86-64 store order; this machine is {platform.machine()}"
    else:
        for g in groups:  # collective over each group, in family order on every rank
            hosts = _hosts(g)
            if len(hosts) > 1:
                why = f"a replica group spans hosts {sorted(hosts)}"
    if why is not None and opts.grad_transport == "host_shm":
        raise OptionError(f"grad_transport='host_shm' reduces gradients through one host's shared memory, but {why}; "
                          "use grad_transport='process_group' (or 'auto')")
    return why is None
