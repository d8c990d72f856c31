"""Data pipeline: Megatron's mmap indexed dataset, GPT samples, blending and samplers.

Modules here import numpy only (``samplers`` and the data loader excepted), so
``tools/preprocess_data.py`` and dataset index building start without importing torch.
"""
