"""Speculative decoding with a model's own multi-token-prediction layers (DeepSeek-V3, GLM-4.5,
Qwen3-Next, Qwen3.5, MiMo), read from its checkpoint."""

from mtp.model import MTPError, NoMTPWeights, load_mtp
from mtp.source import MTPDrafter, MTPSource

__all__ = ["MTPDrafter", "MTPError", "MTPSource", "NoMTPWeights", "load_mtp"]
