"""Model registry: ModelConfig.architecture -> model class."""

from .llama import LlamaForCausalLM
from .qwen2 import Qwen2ForCausalLM

MODEL_REGISTRY = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
}
