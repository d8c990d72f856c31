"""The LLaMA model with grouped-query attention at TP=2 and TP=4 equals TP=1: initial weights,
logits, per-token loss and every gradient, reassembled from the ranks' partitions."""

import pytest
import torch

from megatron.model.attention_mask import AttentionMask
from megatron.core.transformer.initialization import from_fused_layout
from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups
from tests.helpers.model import batch, small_config

# Fused weights/biases: logical blocks compared one by one, since the per-rank layout depends on TP.
_FUSED = {"self_attention.query_key_value": lambda c: [c.num_attention_heads * c.kv_channels,
                                                       c.num_query_groups * c.kv_channels,
                                                       c.num_query_groups * c.kv_channels],
          "mlp.dense_h_to_4h": lambda c: [c.ffn_hidden_size, c.ffn_hidden_size]}


def _inputs(config, document_mask):
    tokens, labels = batch(config, b=2, s=24)
    if not document_mask:
        return tokens, None, None, labels
    s = tokens.shape[1]
    doc = (torch.arange(s) >= 10).long()
    positions = torch.cat([torch.arange(10), torch.arange(s - 10)])
    return tokens, positions.expand(2, s), AttentionMask.from_document_ids(doc.expand(2, s)), labels


def _run(config, document_mask):
    """Forward and backward; returns logits, loss, and {name: (weight, grad, partition_dim)}."""
    from megatron.model.llama import LlamaModel
    model = LlamaModel(config, pg_collection=current_groups())
    tokens, positions, mask, labels = _inputs(config, document_mask)
    with torch.no_grad():
        logits = model(tokens, positions, mask)
    loss = model(tokens, positions, mask, labels=labels)
    # Position-dependent weights so that every gradient depends on every token differently.
    weights = torch.linspace(0.5, 1.5, loss.numel()).view_as(loss)
    (loss * weights).sum().backward()
    if model.sequence_parallel:
        # What finalize_model_grads does: norm weights and row-parallel biases saw only this
        # rank's sequence chunk, so their gradients are summed over the tensor-parallel group.
        import torch.distributed as dist
        from megatron.core import parallel_state
        for p in model.parameters():
            if getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())
    params = {n: (p.detach().clone(), p.grad.clone(),
                  p.partition_dim if getattr(p, "tensor_model_parallel", False) else None)
              for n, p in model.named_parameters()}
    return logits, loss.detach(), params


def _rank_main(tp, config, document_mask):
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tp, 1)
    return _run(config.replace(tensor_model_parallel_size=tp), document_mask)


def _logical(name, full, config, tp):
    for key, blocks in _FUSED.items():
        if key in name:
            return from_fused_layout(full, blocks(config), tp)
    return [full]


@pytest.mark.parametrize("tp,changes,document_mask", [
    (2, {}, True),
    (4, {"num_query_groups": 4}, False),
    (2, {"untie_embeddings_and_output_weights": False, "add_bias_linear": True}, False),
    (2, {"sequence_parallel": True, "add_bias_linear": True}, True),
    (4, {"sequence_parallel": True, "untie_embeddings_and_output_weights": False,
         "num_query_groups": 4}, False),
], ids=["tp2-gqa-document-mask", "tp4-gqa", "tp2-tied-bias", "tp2-sequence-parallel-bias",
        "tp4-sequence-parallel-tied"])
def test_tensor_parallel_equals_tp1(tp, changes, document_mask):
    config = small_config(**changes)
    ref_logits, ref_loss, ref_params = _run(config, document_mask)
    results = run_distributed(tp, _rank_main, tp, config, document_mask)

    logits = torch.cat([r[0] for r in results], dim=-1)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    for _, loss, _ in results:
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)

    assert results[0][2].keys() == ref_params.keys()
    for name, (ref_w, ref_g, _) in ref_params.items():
        per_rank = [r[2][name] for r in results]
        dim = per_rank[0][2]
        for i, ref in ((0, ref_w), (1, ref_g)):
            if dim is None:  # replicated: every rank holds the full tensor
                full = per_rank[0][i]
                for other in per_rank[1:]:
                    torch.testing.assert_close(other[i], full, atol=1e-6, rtol=1e-5, msg=name)
            else:
                full = torch.cat([p[i] for p in per_rank], dim=dim)
            what = "weight" if i == 0 else "grad"
            atol = 0 if i == 0 else 1e-5  # init is bitwise layout-independent
            for got, want in zip(_logical(name, full, config, tp), _logical(name, ref, config, 1)):
                torch.testing.assert_close(got, want, atol=atol, rtol=0 if i == 0 else 1e-4,
                                           msg=f"{what} of {name}")


def _stages_rank_main(tp, config):
    from megatron.core import parallel_state
    from megatron.model import get_layer_numbers
    from megatron.model.llama import LlamaModel
    parallel_state.initialize_model_parallel(tp, 1)
    config = config.replace(tensor_model_parallel_size=tp)
    tokens, positions, mask, labels = _inputs(config, document_mask=True)
    whole = LlamaModel(config, pg_collection=current_groups())
    first, last = (LlamaModel(config, pg_collection=current_groups(), pre_process=r == 0,
                              post_process=r == 1,
                              layer_numbers=get_layer_numbers(config.num_layers, 2, r)) for r in range(2))
    with torch.no_grad():
        hidden = first(tokens, positions, mask)
        last.set_input_tensor(hidden)
        return tuple(hidden.shape), last(None, positions, mask, labels=labels), whole(tokens, positions, mask, labels=labels)


def test_sequence_parallel_pipeline_stages_pass_sequence_chunks():
    """With sequence parallelism a stage hands on its [s/T, b, h] chunk and the next stage still
    sees the full sequence's positions: the stages compose to the whole model."""
    config = small_config(sequence_parallel=True, untie_embeddings_and_output_weights=False)
    for shape, staged, whole in run_distributed(2, _stages_rank_main, 2, config):
        assert shape == (12, 2, config.hidden_size)
        torch.testing.assert_close(staged, whole, atol=1e-6, rtol=1e-6)
