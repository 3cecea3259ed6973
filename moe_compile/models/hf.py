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

# sizes by field name, applied to every field the config class (or a sub-config) declares
_SIZES = dict(
    vocab_size=256, hidden_size=64, d_model=64, intermediate_size=64, ffn_hidden_size=32, num_hidden_layers=2,
    n_layers=2, num_attention_heads=4, n_heads=4, num_key_value_heads=2, kv_n_heads=2, head_dim=16,
    max_position_embeddings=256, max_seq_len=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    moe_intermediate_size=32, expert_intermediate_size=32, shared_expert_intermediate_size=64,
    moe_shared_expert_intermediate_size=32,
    first_k_dense_replace=0, decoder_sparse_step=1, mlp_only_layers=[], moe_layer_freq=1,
    expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2, attn_layer_offset=1,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    mamba_d_state=8, mamba_dt_rank=8, ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=32, mamba_n_heads=4,
    mamba_d_head=32, n_groups=1, mamba_n_groups=1, chunk_size=16, use_mamba_kernels=False,
    sliding_window=64, num_nextn_predict_layers=0, router_jitter_noise=0.0, jitter_noise=0.0, moe_jitter_eps=0.0,
    enable_moe_block=True, is_moe=True, tie_word_embeddings=False,
)
# what the generic sizes cannot know: defaults the model code cannot run with, validators' own rules
FAMILY_OVERRIDES: dict[str, dict] = {
    "dots1": dict(n_shared_experts=1),  # its default (None) is multiplied by the width
    "zaya": dict(num_experts_per_tok=1),  # the config validator allows top-1 only
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=0),
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=1e4, clip_qkv=8.0)),  # fields its model needs
    "nemotron_h": dict(layers_block_type=["full_attention", "moe"]),  # an attention layer for the cache
    "granitemoehybrid": dict(layer_types=["attention", "attention"]),
    "gemma4_text": dict(per_layer_config={}, vocab_size_per_layer_input=256, hidden_size_per_layer_input=16),
}
_GROUP_FIELDS = (("n_group", "topk_group"), ("num_expert_group", "topk_group"))


def _fields(cls) -> set[str]:
    import dataclasses
    import inspect

    try:
        return {f.name for f in dataclasses.fields(cls)}
    except TypeError:
        return set(inspect.signature(cls.__init__).parameters)


def _tiny_kwargs(cls, experts: int, top_k: int) -> dict:
    names = _fields(cls)
    kw = {k: v for k, v in _SIZES.items() if k in names}
    kw.update({k: experts for k in EXPERT_COUNT_FIELDS if k in names})
    kw.update({k: top_k for k in TOPK_FIELDS if k in names})
    for g, tg in _GROUP_FIELDS:  # keep group-limited routing, at a size 8 experts allow: 4 groups, best 2
        if g in names and (getattr(cls(), g, None) or 1) > 1:
            kw.update({g: 4, tg: 2} if tg in names else {g: 4})
    return kw


def _two_layer_pattern(v):
    """A per-layer list (or pattern string) cut to 2 layers, keeping a second kind of layer if any."""
    second = next((x for x in v if x != v[0]), v[0])
    return v[0] + second if isinstance(v, str) else [v[0], second]


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
    layers = getattr(default, "num_hidden_layers", None)
    for name in _fields(cls):
        v = getattr(default, name, None)
        per_layer = isinstance(v, list) or (isinstance(v, str) and "pattern" in name)
        if name not in kw and layers and per_layer and len(v) == layers:
            kw[name] = _two_layer_pattern(v)
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
    return tf.AutoModelForCausalLM.from_config(cfg).float()
