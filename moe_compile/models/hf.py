"""Tiny random configurations of the Hugging Face MoE families (transformers 5.x)."""

from __future__ import annotations

import torch.nn as nn

HF_FAMILIES = ("olmoe", "mixtral", "qwen2_moe")


def tiny_hf_config(family: str, *, layers: int = 2, d: int = 64, experts: int = 8, top_k: int = 2,
                   hidden: int = 32, vocab: int = 256, **overrides):
    """A small config of ``family`` (olmoe | mixtral | qwen2_moe) with random-init-friendly sizes."""
    import transformers as tf

    common = dict(
        vocab_size=vocab, hidden_size=d, intermediate_size=hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
        num_experts_per_tok=top_k, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    if family == "olmoe":
        cfg = tf.OlmoeConfig(num_experts=experts, norm_topk_prob=False, **common)
    elif family == "mixtral":
        cfg = tf.MixtralConfig(num_local_experts=experts, **common)
    elif family == "qwen2_moe":
        common["intermediate_size"] = hidden * 2
        cfg = tf.Qwen2MoeConfig(
            num_experts=experts, moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden * 2,
            norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], **common,
        )
    else:
        raise ValueError(f"unknown HF MoE family {family!r}; supported: {HF_FAMILIES}")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def tiny_hf_model(family: str, seed: int = 0, **kw) -> nn.Module:
    """A randomly initialised tiny ``*ForCausalLM`` of ``family`` in fp32."""
    import torch
    import transformers as tf

    cfg = tiny_hf_config(family, **kw)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).float()
    return model


# -- every registered family: a tiny config derived from the config class's own fields -----------

EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOPK_FIELDS = ("num_experts_per_tok", "moe_topk", "moe_top_k", "top_k_experts", "num_experts_per_token")
MOE_FIELDS = EXPERT_COUNT_FIELDS + ("ffn_config",)  # a config with any of these fields describes an MoE

# sizes by field name, applied to every field the config class (or a sub-config) declares (num_layers:
# LongCat-Flash's, whose every layer holds two sublayers: num_hidden_layers = 2·num_layers)
_SIZES = dict(
    vocab_size=256, hidden_size=64, d_model=64, intermediate_size=64, ffn_hidden_size=32, num_hidden_layers=2,
    n_layers=2, num_layers=1, num_attention_heads=4, n_heads=4, num_key_value_heads=2, kv_n_heads=2, head_dim=16,
    max_position_embeddings=256, max_seq_len=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    moe_intermediate_size=32, expert_intermediate_size=32, expert_ffn_hidden_size=32, shared_expert_intermediate_size=64,
    moe_shared_expert_intermediate_size=32, zero_expert_num=2,  # LongCat-Flash's identity experts, kept (2)
    first_k_dense_replace=0, decoder_sparse_step=1, mlp_only_layers=[], moe_layer_freq=1,
    expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2, attn_layer_offset=1,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    mamba_d_state=8, mamba_dt_rank=8, ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=32, mamba_n_heads=4,
    mamba_d_head=32, n_groups=1, mamba_n_groups=1, chunk_size=16, use_mamba_kernels=False,
    sliding_window=64, num_nextn_predict_layers=0, router_jitter_noise=0.0, jitter_noise=0.0, moe_jitter_eps=0.0,
    enable_moe_block=True, is_moe=True, tie_word_embeddings=False,
    # a token indexer whose sizes default to None though the model always builds it (Qwen4-Exp's QSA, which
    # documents one key head and a budget divisible by the compression): 2 blocks of 4 of the 16 tokens
    indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
    # DeepSeek-V3.2's indexer (DSA & co.): 4 of the 16 tokens per query, so its picks matter (2048 took all)
    index_topk=4, index_n_heads=4, index_head_dim=16,
)
# what the generic sizes cannot know: defaults the model code cannot run with, validators' own rules
FAMILY_OVERRIDES: dict[str, dict] = {
    "dots1": dict(n_shared_experts=1),  # its default (None) is multiplied by the width
    "zaya": dict(num_experts_per_tok=1),  # the config validator allows top-1 only
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=0),
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=1e4, clip_qkv=8.0)),  # fields its model needs
    "nemotron_h": dict(layers_block_type=["mamba", "full_attention", "moe"]),  # the cache needs attention
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),  # a Mamba-2 layer
    "gemma4_text": dict(vocab_size_per_layer_input=256, hidden_size_per_layer_input=16),
}
_GROUP_FIELDS = (("n_group", "topk_group"), ("num_expert_group", "topk_group"))
# head-size relations of multi-head latent attention (a config with kv_lora_rank) that the generic sizes
# would break, kept where the default config holds them: (field, takes the tiny value of). MLA's head_dim
# is the rope part; every head has its own keys and values (no grouped kv heads: the DSA indexer and
# several MLA codes count kv heads as heads).
_MLA_TIES = (("head_dim", "qk_rope_head_dim"), ("num_key_value_heads", "num_attention_heads"))
# MLA head sums a per-layer override (shrunk by ratio) would break, kept where the default layer holds them
# (Dots3-Note's sliding-window layers: head_dim = qk_nope_head_dim + qk_rope_head_dim, a validator's rule)
_MLA_SUMS = (("head_dim", ("qk_nope_head_dim", "qk_rope_head_dim")),)


def _fields(cls) -> set[str]:
    import dataclasses
    import inspect

    try:
        return {f.name for f in dataclasses.fields(cls)}
    except TypeError:
        return set(inspect.signature(cls.__init__).parameters)


def _default_attr(default, name: str):
    """``default.name`` (None if unset), also for a field a heterogeneous config holds per layer."""
    get = getattr(default, "_getattr_without_heterogeneous_validation", None)
    return get(name, None) if get is not None else getattr(default, name, None)


def _tiny_kwargs(cls, experts: int, top_k: int) -> dict:
    names = _fields(cls)
    default = cls()
    kw = {k: v for k, v in _SIZES.items() if k in names}
    if "sliding_window" in kw and _default_attr(default, "sliding_window") is None:
        del kw["sliding_window"]  # a window is shrunk, not added: Mixtral's, PhiMoE's, Doge's default is none
    kw.update({k: experts for k in EXPERT_COUNT_FIELDS if k in names})
    kw.update({k: top_k for k in TOPK_FIELDS if k in names})
    for g, tg in _GROUP_FIELDS:  # keep group-limited routing, at a size 8 experts allow: 4 groups, best 2
        if g in names and (_default_attr(default, g) or 1) > 1:
            kw.update({g: 4, tg: 2} if tg in names else {g: 4})
    if "kv_lora_rank" in names:
        for f, like in _MLA_TIES:
            if f in kw and like in kw and _default_attr(default, f) == _default_attr(default, like):
                kw[f] = kw[like]
    return kw


def _tiny_per_layer(default, picked: list[int], kw: dict) -> dict:
    """The default config's per-layer overrides (a heterogeneous config) for the default layers ``picked``,
    renumbered 0.. and shrunk: an integer override keeps its ratio to the field's global value."""
    spec = default.__dict__.get("_heterogeneity_spec")
    if spec is None:
        return {}
    out = {}
    for j, i in enumerate(picked):
        layer = {}
        for name, v in spec.per_layer_overrides.get(i, {}).items():
            base, tiny = _default_attr(default, name), kw.get(name)
            if isinstance(v, int) and not isinstance(v, bool) and isinstance(base, int) and base and tiny:
                v = max(1, tiny * v // base)
            layer[name] = v
        for total, parts in _MLA_SUMS:  # a sum the default layer holds, kept at the shrunk sizes
            dflt = [spec.per_layer_overrides.get(i, {}).get(f, _default_attr(default, f)) for f in (total, *parts)]
            tiny = [layer.get(f, kw.get(f)) for f in parts]
            if layer and None not in dflt + tiny and dflt[0] == sum(dflt[1:]) and layer.get(total, kw.get(total)) != sum(tiny):
                layer[total] = sum(tiny)
        if layer:
            out[j] = layer
    return out


def _two_layers(v) -> list[int]:
    """The 2 layers a per-layer list (or pattern string) is cut to: the first, and the first of a second
    kind of layer if any."""
    return [0, next((i for i, x in enumerate(v) if x != v[0]), min(1, len(v) - 1))]


def _two_layer_pattern(v):
    """A per-layer list (or pattern string) cut to 2 layers, keeping a second kind of layer if any."""
    first, second = (v[i] for i in _two_layers(v))
    return first + second if isinstance(v, str) else [first, second]


def tiny_family_config(model_type: str, *, experts: int = 8, top_k: int = 2, **overrides):
    """A tiny random-init config of any registered transformers MoE family: 2 layers, d=64, ``experts``
    routed experts, top-``top_k``, vocab 256, set through the fields the config class itself declares
    (sub-configs such as DBRX's ffn_config likewise); per-layer lists are cut to 2 layers."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    subs = {}
    for name, sub_cls in (getattr(cls, "sub_configs", None) or {}).items():
        if name in ("text_config",):
            continue
        subs[name] = _tiny_kwargs(sub_cls, experts, top_k)
    kw = _tiny_kwargs(cls, experts, top_k)
    layers = _default_attr(default, "num_hidden_layers")
    for name in _fields(cls):
        v = _default_attr(default, name)
        per_layer = isinstance(v, list) or (isinstance(v, str) and "pattern" in name)
        if name not in kw and layers and per_layer and len(v) == layers:
            kw[name] = _two_layer_pattern(v)
    if default.__dict__.get("_heterogeneity_spec") is not None:  # a heterogeneous config: its per-layer overrides
        types = _default_attr(default, "layer_types")  # the layers the per-layer lists were cut to
        kw["per_layer_config"] = _tiny_per_layer(default, _two_layers(types) if types else [0, 1], kw)
    kw.update(subs)
    kw.update(FAMILY_OVERRIDES.get(model_type, {}))
    kw.update(overrides)
    return cls(**kw)


def tiny_family_model(model_type: str, seed: int = 0, **kw) -> nn.Module:
    """A randomly initialised tiny ``*ForCausalLM`` of a registered family, in fp32."""
    import torch
    import transformers as tf

    cfg = tiny_family_config(model_type, **kw)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).float()
    random_hash_tables(model, seed)
    return model


def random_hash_tables(model: nn.Module, seed: int = 0) -> None:
    """Give each hash router (DeepSeek-V4's first layers: a router whose forward takes token ids, with a
    [vocab, K] integer table beside its [N, d] weight) K distinct random experts per token, as a
    checkpoint's table holds; transformers initialises the table to zeros (its values come from the
    checkpoint), which would send every token to expert 0 K times."""
    import torch

    from ..frontend.structure import integer_tables, token_id_inputs

    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        w, tables = getattr(m, "weight", None), integer_tables(m)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and len(tables) == 1 and token_id_inputs(m):
            table = tables[0][1]
            with torch.no_grad():
                table.copy_(torch.rand(table.shape[0], w.shape[0], generator=g).argsort(-1)[:, : table.shape[1]])
