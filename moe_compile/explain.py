"""Plan a run before it starts: compile a model for a mesh in one process and write its cost ledger,
graphs and an HTML report (``moe-compile explain``).

    model   = published config (--hf), a config.json (--hf-config) or the tiny reference (--model),
              built on the meta device: no weights are allocated, full-size configs fit a laptop
    world   = a fake process group of the mesh's size, as rank r: collectives are no-ops
    compile = moe_compile(model, mesh) exactly as on a real rank; one training step on meta inputs
              captures the graphs (moe:: ops run their fake kernels on meta tensors)
    write   = ledger.json, graphs (.dot sources; SVG/PNG when graphviz's `dot` is installed), lease
              timeline (if the program has a lease plan), report.html

Routing semantics that the front end settles with a probe batch on real weights are read from
attributes only on meta weights (the report says so); they do not change any ledger figure.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .errors import MeshError, OptionError
from .mesh import MeshSpec
from .options import schedule_without_pipeline


@dataclass(frozen=True)
class Published:
    family: str
    published: str  # the size as its authors state it, XB@YB
    build: Callable[[], Any]  # → transformers config
    note: str = ""


def _olmoe():
    import transformers as tf

    return tf.OlmoeConfig(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                          num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                          norm_topk_prob=False, max_position_embeddings=4096, tie_word_embeddings=False)


def _mixtral():
    import transformers as tf

    return tf.MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                            max_position_embeddings=32768, tie_word_embeddings=False, router_jitter_noise=0.0)


def _qwen():
    import transformers as tf

    return tf.Qwen2MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                             num_attention_heads=16, num_key_value_heads=16, moe_intermediate_size=1408,
                             shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
                             norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
                             max_position_embeddings=8192, tie_word_embeddings=False)


def _deepseek_v3():
    import transformers as tf

    return tf.DeepseekV3Config(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                               num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                               n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, routed_scaling_factor=2.5,
                               kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                               qk_nope_head_dim=128, first_k_dense_replace=3, norm_topk_prob=True,
                               n_group=8, topk_group=4, max_position_embeddings=4096, tie_word_embeddings=False)


PUBLISHED: dict[str, Published] = {
    "olmoe-1b-7b": Published("olmoe", "1.3B@6.9B", _olmoe),
    "mixtral-8x7b": Published("mixtral", "12.9B@46.7B", _mixtral),
    "qwen1.5-moe-a2.7b": Published("qwen2_moe", "2.7B@14.3B", _qwen),
    "deepseek-v3": Published("deepseek_v3", "37B@671B", _deepseek_v3,
                             "DeepSeek-V3: the published sizes and routing (sigmoid scores with a score-correction "
                             "bias, 8 expert groups of which each token's top-8 come from the best 4)"),
}
ALIASES = {"olmoe": "olmoe-1b-7b", "mixtral": "mixtral-8x7b", "qwen2_moe": "qwen1.5-moe-a2.7b",
           "qwen": "qwen1.5-moe-a2.7b", "deepseek_v3": "deepseek-v3", "deepseek": "deepseek-v3"}
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


def published_config(name: str):
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PUBLISHED:
        raise OptionError(f"--hf {name!r}: no published configuration by that name; known: "
                          f"{sorted(PUBLISHED)} (aliases {sorted(ALIASES)})")
    cfg = PUBLISHED[key].build()
    cfg.use_cache = False
    return cfg


def config_from_json(path: str | Path):
    import transformers as tf

    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise OptionError(f"--hf-config {path}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise OptionError(f"--hf-config {path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise OptionError(f"--hf-config {path}: a transformers config.json is a JSON object, not {type(data).__name__}")
    if "model_type" not in data:
        raise OptionError(f"{path}: a transformers config.json needs a 'model_type' (e.g. 'olmoe', 'mixtral')")
    # transformers writes inf / nan as {"__float__": "Infinity"} (time_step_limit of the Mamba hybrids) and
    # decodes them when it reads its own files; for_model takes the values as they are
    decode = getattr(tf.PretrainedConfig, "_decode_special_floats", None)
    data = decode(data) if decode is not None else data
    kind = data.pop("model_type")
    if kind not in tf.CONFIG_MAPPING:
        raise OptionError(f"--hf-config {path}: model_type {kind!r} is not a model type this transformers "
                          f"({tf.__version__}) knows")
    cfg = tf.AutoConfig.for_model(kind, **data)
    cfg.use_cache = False
    return cfg


def meta_model(*, hf: str | None = None, hf_config: str | None = None, model: str | None = None,
               dtype: torch.dtype = torch.bfloat16) -> tuple[nn.Module, str]:
    """The model on the meta device (no weights allocated) and a display name."""
    if sum(x is not None for x in (hf, hf_config, model)) != 1:
        raise OptionError("give exactly one of --hf NAME, --hf-config FILE.json, --model tiny")
    if model is not None:
        if model != "tiny":
            raise OptionError(f"--model {model!r}: the only built-in model is 'tiny'")
        from .models import TinyMoEConfig, TinyMoELM

        with torch.device("meta"):
            return TinyMoELM(TinyMoEConfig()).to(dtype), "tiny"
    import transformers as tf

    cfg = published_config(hf) if hf is not None else config_from_json(hf_config)
    name = ALIASES.get(hf.lower(), hf.lower()) if hf is not None else Path(hf_config).name
    if type(cfg) not in tf.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise OptionError(f"{name}: model_type {cfg.model_type!r} has no causal-LM class in transformers "
                          f"(AutoModelForCausalLM); moe_compile compiles MoE causal LMs")
    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype), name


def world_of(mesh: MeshSpec, world: int | None) -> int:
    if world is not None:
        return world
    if mesh.dp is not None:
        return mesh.pp * mesh.dp * mesh.cp
    if mesh.ep_dp is not None:
        return mesh.pp * mesh.ep_dp * mesh.ep_mp
    raise MeshError(f"mesh {mesh}: give dp= (or ep_dp=) in the mesh, or the world size, so the ranks are known")


@dataclass
class ExplainResult:
    name: str
    mesh: MeshSpec
    ledger: Any  # moe_compile.ledger.Ledger
    files: dict[str, Path] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)  # for the user (e.g. graphviz missing: no pictures)
    pipeline: dict | None = None  # pp > 1: per-stage figures (explain_pipeline.stage_rows)
    context_parallel: dict | None = None  # cp > 1: K/V traffic, attention FLOPs, scaling (explain_cp.cp_rows)


def explain(*, mesh: str | MeshSpec, out_dir: str | Path, hf: str | None = None, hf_config: str | None = None,
            model: str | None = None, rank: int = 0, world: int | None = None, seq_len: int | None = None,
            batch_size: int = 1, micro_batches: int = 1, capacity_factor: float | None = None,
            dtype: str = "bfloat16", png: bool = True, max_nodes: int = 350, schedule: str = "1f1b") -> ExplainResult:
    """Compile for ``mesh`` as ``rank`` of a fake world and write the ledger, graphs and report."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from . import moe_compile

    if dist.is_initialized():
        raise OptionError("explain starts its own (fake) process group: call it where torch.distributed is not "
                          "initialised")
    if dtype not in DTYPES:
        raise OptionError(f"dtype {dtype!r}: supported {sorted(DTYPES)}")
    for flag, value in (("--batch-size", batch_size), ("--micro-batches", micro_batches), ("--seq-len", seq_len)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise OptionError(f"{flag} {value!r}: must be a whole number ≥ 1 (a count of sequences, "
                              f"micro-batches or tokens)")
    spec = MeshSpec.parse(mesh) if isinstance(mesh, str) else mesh
    n = world_of(spec, world)
    spec = spec.resolve(n)
    if not 0 <= rank < n:
        raise MeshError(f"rank {rank} is not a rank of mesh {spec} ({n} ranks)")
    net, name = meta_model(hf=hf, hf_config=hf_config, model=model, dtype=DTYPES[dtype])
    if seq_len is None:
        limit = getattr(getattr(net, "config", None), "max_position_embeddings", None) or \
            getattr(getattr(net, "config", None), "max_seq_len", 4096)
        seq_len = min(4096, int(limit))
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OptionError(f"--out {out}: exists and is not a directory (explain writes its report files there)")
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=n)
    cm = None
    try:
        pipelined = spec.pp > 1
        if schedule != "1f1b" and not pipelined:
            raise OptionError(schedule_without_pipeline(f"--schedule {schedule}"))
        extra = {"microbatches": micro_batches, "schedule": schedule} if pipelined else {}
        cm = moe_compile(net, spec, capacity_factor=capacity_factor, **extra)
        if cm.ddp is not None:  # the buckets of the optimizer `moe-compile train` runs (OLMoDDPOptimizer) as on
            cm.ddp.set_grad_dtype(torch.float32)  # accelerators: FP32 main_grad, reduce-scattered into the
            cm.ddp.shard_gradients(True)  # ZeRO-1 owned ranges (its main weights and moments: the ledger's)
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
        pipeline = None
        with warnings.catch_warnings(), _differentiable_cross_entropy(), _fused_attention():
            # meta tensors: eager autograd kernels of some losses are missing; nothing numeric is used
            warnings.filterwarnings("ignore", message=".*an autograd kernel was not registered.*")
            if pipelined:  # every stage compiled here, one forward and backward each (nothing sent)
                from .explain_pipeline import stage_rows

                mb = {"input_ids": ids, "labels": ids}
                if spec.cp > 1:  # this rank's sequence shard, as a pipelined train_step cuts it
                    from .runtime.context_parallel import shard_batch

                    mb = shard_batch(mb, spec.cp, cm.groups.cp_rank, count=False)
                programs = cm.pipeline.plan_stages(mb)
                cm.pipeline._programs = [programs[s] for s in cm.pipeline.local]
                pipeline = stage_rows(cm, programs)
            else:
                res = cm(input_ids=ids, labels=ids)
                res.loss.backward()
        # pipelined: the whole model's program captured no graph (each stage has its own, in the stage
        # rows), so the token-dependent figures take T from the planned micro-batch: this rank's tokens of it
        tokens = {"tokens": batch_size * seq_len // spec.cp, "seq_len": seq_len} if pipelined else {}
        # the persistent state of the optimizer `moe-compile train` runs (OLMoDDPOptimizer: FP32 main_grad
        # buckets, ZeRO-1 sharded FP32 main weights and moments), as the pipeline's stage rows count it; on the
        # accelerators explain plans for (symmetric transport) its intake reduce-scatters the buckets
        led = cm.ledger(micro_batches=micro_batches, sharded_optimizer=True, reduce_scatter=True, **tokens)
        result = ExplainResult(name, cm.program.mesh, led)
        from .explain_cp import cp_rows

        result.context_parallel = cp_rows(cm, led)
        from .explain_report import write_outputs

        result.files = write_outputs(cm, led, out, name=name, rank=rank, seq_len=seq_len, batch_size=batch_size,
                                     png=png, max_nodes=max_nodes, published=_published_note(hf),
                                     messages=result.messages, pipeline=pipeline, cp=result.context_parallel,
                                     programs=programs if pipelined else None)
        result.pipeline = pipeline
        return result
    finally:
        if cm is not None:
            cm.close()
        dist.destroy_process_group()


@contextlib.contextmanager
def _fused_attention():
    """While explain captures: F.scaled_dot_product_attention on meta tensors as the fused kernel a rank
    runs (aten::_scaled_dot_product_flash_attention_for_cpu; its meta kernel takes fewer K/V heads as they
    are). On the meta device SDPA takes its math path, which saves the [B, H, S, S] attention
    probabilities for backward, so M_saved and M_working grew with S² (1.7× the measured figures for the
    tiny LM at S=256 on dp=2, ep_mp=2); the fused kernels on CPU and GPU (flash, efficient, cuDNN) save the
    output and the log-sum-exp. Calls the CPU kernel does not take — a mask that needs a gradient (a
    learned position bias, Inkling's), value heads narrower than the query's (MLA: DeepSeek-V3's 128 for
    192; its explain kept 217 GB of probabilities per rank at S=2048) — run as the memory-efficient kernel a
    GPU rank runs (attention_ops.efficient_attention). Dropout keeps the original call. With cp > 1 the
    context-parallel pass rewrites these fused calls as it rewrites SDPA's (passes/context_parallel.py)."""
    import torch.nn.functional as F

    from .attention_ops import efficient_attention

    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not query.is_meta or dropout_p:
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        # the CPU kernel takes no mask that needs a gradient, and its meta kernel gives the output q's head
        # size, not v's
        if value.shape[-1] != query.shape[-1] or (isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad):
            return efficient_attention(query, key, value, attn_mask, is_causal, scale)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def _differentiable_cross_entropy():
    """While explain captures: F.cross_entropy as log_softmax + gather. aten::nll_loss has no autograd
    kernel for meta tensors, so the captured backward would get no gradient from the token loss — the
    last MoE layers would look as if backward never read their payloads (no leases, too little saved).
    The same arithmetic, differentiable on meta; only planning captures use it."""
    import torch.nn.functional as F

    original = F.cross_entropy

    def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                      reduction="mean", label_smoothing=0.0):
        if weight is not None or size_average is not None or reduce is not None or label_smoothing or \
                target.is_floating_point() or input.dim() != 2:
            return original(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        valid = target != ignore_index
        picked = torch.log_softmax(input, -1).gather(1, torch.where(valid, target, 0).unsqueeze(1)).squeeze(1)
        losses = -picked * valid
        if reduction == "none":
            return losses
        return losses.sum() if reduction == "sum" else losses.sum() / valid.sum()

    F.cross_entropy = cross_entropy
    try:
        yield
    finally:
        F.cross_entropy = original


def _published_note(hf: str | None) -> str:
    if hf is None:
        return ""
    p = PUBLISHED[ALIASES.get(hf.lower(), hf.lower())]
    return f"published size {p.published}" + (f"; {p.note}" if p.note else "")
