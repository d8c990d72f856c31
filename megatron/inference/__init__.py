"""Text generation: KV cache (:class:`InferenceParams`), pipeline/tensor-parallel forward
(:func:`forward_logits`) and sampling (:func:`generate`, :func:`sample`)."""

from megatron.inference.forward import forward_logits, gather_vocab_logits
from megatron.inference.generation import generate, sample
from megatron.inference.inference_params import InferenceParams

__all__ = ["InferenceParams", "forward_logits", "gather_vocab_logits", "generate", "sample"]
