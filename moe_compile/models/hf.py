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
