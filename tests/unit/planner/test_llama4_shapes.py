"""The planner's Llama 4 shapes: total and active parameters equal those of transformers'
``Llama4ForCausalLM`` built (on the meta device) with the released text configs' shapes, and
``tools/plan.py --model`` plans Scout and Maverick on H100 (80 GiB) and H200 (141 GiB) nodes
within the memory it is given (Scout on 64 H100 and Maverick on 256 in the slow tier: long searches)."""

import re

import pytest
import torch

from megatron.planner.llama4 import SHAPES, parameter_counts

transformers = pytest.importorskip("transformers")


def _hf_counts(experts, step):
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    config = Llama4TextConfig(vocab_size=202048, hidden_size=5120, intermediate_size=8192,
                              intermediate_size_mlp=16384, num_hidden_layers=48,
                              num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                              num_local_experts=experts, num_experts_per_tok=1,
                              interleave_moe_layer_step=step, tie_word_embeddings=False)
    with torch.device("meta"):
        model = Llama4ForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total, total - routed + routed // experts  # top-1: one expert of each MoE layer


@pytest.mark.parametrize("name,experts,step", [("llama4-scout", 16, 1),
                                               ("llama4-maverick", 128, 2)])
def test_parameter_counts_equal_transformers(name, experts, step):
    assert parameter_counts(*SHAPES[name]) == _hf_counts(experts, step)


@pytest.mark.parametrize("name,gpus,memory", [pytest.param("llama4-scout", 64, 80,
                                                           marks=pytest.mark.slow),
                                              ("llama4-scout", 32, 141),
                                              pytest.param("llama4-maverick", 256, 80,
                                                           marks=pytest.mark.slow)])
def test_plan_fits_the_nodes_it_is_given(name, gpus, memory, capsys):
    from tools.plan import main
    assert main(["--model", name, "--num-gpus", str(gpus), "--gpu-memory-gib", str(memory),
                 "--global-batch-size", "512", "--seq-length", "8192", "--top", "1"]) == 0
    out = capsys.readouterr().out
    total, active = parameter_counts(*SHAPES[name])
    assert f"parameters: {total / 1e9:.2f} B total, {active / 1e9:.2f} B active" in out
    best = re.search(r"ZeRO-1 .* total\s+([\d.]+)", out)
    assert float(best.group(1)) <= memory - 4  # within the memory less the reserved 4 GiB
    assert "--attention-chunk-size 8192" in out and "--moe-apply-probs-on-input" in out
    assert ("--qk-l2-norm" in out) == (name == "llama4-scout")
