"""Engine-owned decode steps: per family, the batched one-token forward pass on a
slot store (``store.py``), with the model's own weights and numerics (``step.py`` holds
what they share). A family without one decodes through mlx-vlm's model code on mlx-lm's
batch caches."""

from .gemma3 import Gemma3Decoder
from .gemma4 import Gemma4Decoder
from .glm4v import Glm4vDecoder
from .llama import LlamaDecoder
from .ministral3 import Ministral3Decoder
from .qwen2 import Qwen2Decoder
from .store import SlotStore

__all__ = [
    "Gemma3Decoder", "Gemma4Decoder", "Glm4vDecoder", "LlamaDecoder", "Ministral3Decoder",
    "Qwen2Decoder", "SlotStore",
]
