"""Transformer building blocks in Megatron-Core's layout (``moe/``: the mixture-of-experts layer)."""
