"""Small reference MoE models for demos and tests."""

from .hf import HF_FAMILIES, tiny_hf_config, tiny_hf_model
from .tiny import MoEFeedForward, MoELMOutput, TinyMoEConfig, TinyMoELM

__all__ = [
    "HF_FAMILIES",
    "MoEFeedForward",
    "MoELMOutput",
    "TinyMoEConfig",
    "TinyMoELM",
    "tiny_hf_config",
    "tiny_hf_model",
]
