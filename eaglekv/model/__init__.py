from eaglekv.model.config import ModelConfig
from eaglekv.model.llama import LlamaForCausalLM, ModelOutput

__all__ = ["LlamaForCausalLM", "ModelConfig", "ModelOutput"]
