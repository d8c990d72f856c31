"""MFU of the log line: the FLOPs formula by hand, the peak plumbing (--peak-tflops,
--measure-peak), the log line, and --compile's layer compilation."""

import argparse
import shutil

import pytest
import torch

from megatron.arguments import parse_args
from megatron.config import ModelConfig
from megatron.model.llama import LlamaModel
from megatron.training import train
from megatron.training.compile import compile_transformer_layers
from megatron.training.logging import format_iteration_line
from megatron.training.mfu import (measure_peak_tflops, model_flops_utilization,
                                   resolve_peak_tflops)
from tests.helpers.groups import current_groups


def _hand_flops(h, layers, heads, groups, d, ffn, vocab, s, b):
    """Matrix-product FLOPs of one step counted by hand: 2 per multiply-add, x3 for forward,
    input gradient and weight gradient; attention without causal savings."""
    tokens = b * s
    per_layer = (2 * h * (heads + 2 * groups) * d      # fused QKV
                 + 2 * s * heads * d * 2                # Q K^T and P V
                 + 2 * heads * d * h                    # output projection
                 + 2 * h * 2 * ffn + 2 * ffn * h)       # SwiGLU: gate, up, down
    return 3 * tokens * (layers * per_layer + 2 * h * vocab)


def test_flops_of_the_log_line_equal_hand_count():
    # LLaMA-2 7B (MHA) and a GQA shape (Llama-3 8B, 4 layers): the formula counts both right.
    for h, layers, heads, groups, ffn, vocab, s in [(4096, 32, 32, 32, 11008, 32000, 4096),
                                                   (4096, 4, 32, 8, 14336, 128256, 8192)]:
        model = ModelConfig(hidden_size=h, num_layers=layers, num_attention_heads=heads,
                            num_query_groups=groups, kv_channels=h // heads, ffn_hidden_size=ffn,
                            padded_vocab_size=vocab, max_position_embeddings=s)
        config = argparse.Namespace(model=model, data=argparse.Namespace(seq_length=s))
        expected = _hand_flops(h, layers, heads, groups, h // heads, ffn, vocab, s, 3)
        assert train.num_floating_point_operations(config, 3) == pytest.approx(expected, rel=1e-12)
    # 7B, one sequence of 4096: 6 N T with N = 6.607e9 matrix weights (1.624e14) plus attention
    # 3 x 4096 tokens x 32 layers x 4 s h (2.64e13).
    assert _hand_flops(4096, 32, 32, 32, 128, 11008, 32000, 4096, 1) == pytest.approx(
        6 * 6_607_077_376 * 4096 + 3 * 4096 * 32 * 4 * 4096 * 4096, rel=1e-12)


def test_mfu_formula_and_errors():
    # 400 TFLOP in 1 s on 4 devices of 200 TFLOP/s peak: 50%.
    assert model_flops_utilization(4e14, 1.0, 4, 200.0) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="positive"):
        model_flops_utilization(1e12, 0.0, 1, 100.0)


def _peak(argv):
    a = parse_args(argv)
    return resolve_peak_tflops(a.peak_tflops, a.measure_peak, torch.float32, torch.device("cpu"))


def test_peak_flags():
    a = parse_args(["--peak-tflops", "989", "--compile"])
    assert a.compile and _peak(["--peak-tflops", "989", "--compile"]) == 989.0
    assert _peak([]) is None
    with pytest.raises(ValueError, match="--peak-tflops"):
        _peak(["--peak-tflops", "-1"])
    with pytest.raises(ValueError, match="--measure-peak"):
        _peak(["--peak-tflops", "1", "--measure-peak"])
    measured = _peak(["--measure-peak"])
    assert 1e-4 < measured < 1e3  # a CPU: between 0.1 GFLOP/s and 1 PFLOP/s
    assert 1e-4 < measure_peak_tflops(torch.device("cpu"), torch.bfloat16, size=128, repeats=2)


def test_log_line_shows_mfu_only_with_a_peak():
    common = dict(iteration=1, train_iters=2, consumed_samples=8, elapsed_ms=10.0, tokens_per_s=1.0,
                  learning_rate=1e-4, global_batch_size=8, losses={"lm loss": 1.0}, loss_scale=1.0,
                  grad_norm=1.0, skipped=0, nans=0, tflops_per_device=0.5)
    assert "MFU: 12.5% |" in format_iteration_line(**common, mfu=0.125)
    assert "MFU" not in format_iteration_line(**common)


def test_log_line_names_the_device_kind():
    """Megatron's "per GPU" wording on CUDA only; a CPU process's throughput is per device."""
    common = dict(iteration=1, train_iters=2, consumed_samples=8, elapsed_ms=10.0, tokens_per_s=1.0,
                  learning_rate=1e-4, global_batch_size=8, losses={"lm loss": 1.0}, loss_scale=1.0,
                  grad_norm=1.0, skipped=0, nans=0, tflops_per_device=0.5)
    cpu = format_iteration_line(**common, device_type="cpu")
    assert "| throughput per device (TFLOP/s/device): 0.500 |" in cpu and "GPU" not in cpu
    cuda = format_iteration_line(**common, device_type="cuda")
    assert "| throughput per GPU (TFLOP/s/GPU): 0.500 |" in cuda and "device" not in cuda


def test_compile_wraps_each_layer_in_place():
    config = ModelConfig(num_layers=3, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                         padded_vocab_size=64, max_position_embeddings=8)
    model = LlamaModel(config, pg_collection=current_groups())
    keys = list(model.state_dict())
    assert compile_transformer_layers([model]) == 3
    assert list(model.state_dict()) == keys  # checkpoints are unchanged
    assert all(layer._compiled_call_impl is not None for layer in model.layers)


# Slow tier: 30 s of one core, nearly all of it inductor building C++ kernels.
@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")),
                    reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_layers_train_like_eager():
    """--compile runs the same math: the DDP main_grads of a compiled model (the fused RoPE and
    gradient-accumulation paths inside compiled layers) equal eager autograd's gradients."""
    from megatron.core.distributed import DistributedDataParallel
    from tests.helpers.model import batch, small_config

    config = small_config()
    torch.manual_seed(0)
    eager = LlamaModel(config, pg_collection=current_groups())
    torch.manual_seed(0)
    compiled = LlamaModel(config, pg_collection=current_groups())
    compile_transformer_layers([compiled])
    ddp = DistributedDataParallel(compiled, data_parallel_group=None)
    tokens, labels = batch(config)
    for _ in range(2):
        ddp.zero_grad_buffer()
        loss = ddp(tokens, labels=labels).mean()
        loss.backward()
    expected = eager(tokens, labels=labels).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.main_grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
