"""DeepSeek-V3 (DeepseekV3ForCausalLM: DeepSeek-V3 / R1, Kimi-K2): MLA attention, shared and routed experts."""

from hpcrl.models.deepseek_v3.family import FAMILY, DeepseekV3
from hpcrl.models.deepseek_v3.shape import DeepseekV3Shape

__all__ = ["FAMILY", "DeepseekV3", "DeepseekV3Shape"]
