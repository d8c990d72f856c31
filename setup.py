"""Install with ``pip install -e .`` (add ``[test]`` for the test suite)."""
from setuptools import find_packages, setup

setup(
    name="megatron-llama-3d",
    version="0.1.0",
    description="Megatron-style 3D-parallel (tensor, pipeline, data) LLaMA pretraining on PyTorch",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",  # LICENSE: the Apache License 2.0, as Megatron-LM and Megatron-LLaMA
    python_requires=">=3.10",
    packages=find_packages(include=["megatron", "megatron.*"]),
    py_modules=["pretrain_llama"],
    install_requires=[
        "torch>=2.5",  # torch.serialization.safe_globals and get_unsafe_globals_in_checkpoint
        "numpy",
        "sentencepiece",
        "tokenizers",
        "safetensors",
        "tensorboard",
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "pytest-xdist>=3.8", "transformers", "fastapi",
                 # accelerate: the harness's HF backend
                 "uvicorn", "openai", "lm-eval>=0.4,<0.5", "accelerate"],
        "wandb": ["wandb"],
        "serve": ["fastapi", "uvicorn"],  # tools/serve.py
        "eval": ["lm-eval>=0.4,<0.5"],  # megatron.inference.lm_eval_harness
    },
    entry_points={"console_scripts": [
        # lm_eval's command line with the megatron_llama3d model registered
        "megatron-lm-eval = megatron.inference.lm_eval_harness:main",
    ]},
)
