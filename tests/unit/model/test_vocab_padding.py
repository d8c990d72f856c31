"""Vocabulary padding does not change the model: the real rows' initial weights are the same
whatever ``--make-vocab-size-divisible-by`` x TP adds (padding rows start at zero), and the loss
of one model padded to 61 (none), 64 and 128 rows, at TP=1 and at TP=2 with and without sequence
parallelism (the fused cross entropy without, the unfused one with), is the same (fp32 rtol 1e-6); the padding rows of
the embedding and the output layer get exactly zero gradient."""

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups
from tests.helpers.model import small_config

TRUE = 61  # the tokenizer's vocabulary
S, B = 12, 2


def _config(padded, tp=1, **changes):
    return small_config(padded_vocab_size=padded, true_vocab_size=TRUE,
                        untie_embeddings_and_output_weights=True, tensor_model_parallel_size=tp,
                        **changes)


def _run(config):
    """This rank's loss ``[b, s]`` and {name: (weight, grad)} of the vocabulary weights."""
    from megatron.model.llama import LlamaModel

    model = LlamaModel(config, pg_collection=current_groups())
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, TRUE, (B, S + 1), generator=g)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    (loss * torch.linspace(0.5, 1.5, loss.numel()).view_as(loss)).sum().backward()
    return loss.detach(), {name: (p.detach().clone(), p.grad.clone())
                           for name, p in model.named_parameters()
                           if name in ("word_embeddings.weight", "output_layer.weight")}


def _check(loss, params, ref_loss, ref_params, padded, tp, rank, what):
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0, msg=what)
    rows = padded // tp
    real = max(0, min(rows, TRUE - rank * rows))
    for name, (weight, grad) in params.items():
        ref_weight, ref_grad = ref_params[name]
        begin = rank * rows
        # real rows: the same draws, the same gradient; padding rows: zero weight, zero gradient
        assert torch.equal(weight[:real], ref_weight[begin:begin + real]), (what, name)
        torch.testing.assert_close(grad[:real], ref_grad[begin:begin + real], rtol=1e-5,
                                   atol=1e-6, msg=f"{what}: {name}")
        assert torch.count_nonzero(weight[real:]) == 0, (what, name)
        assert torch.count_nonzero(grad[real:]) == 0, (what, name)


def test_padding_changes_nothing_single_process():
    ref_loss, ref_params = _run(_config(TRUE))
    for padded in (64, 128):
        loss, params = _run(_config(padded))
        _check(loss, params, ref_loss, ref_params, padded, 1, 0, f"padded {padded}")


def _tp2():
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(2, 1)
    rank = ps.get_tensor_model_parallel_rank()
    # padded 64: rank 1 holds 29 real rows + 3 padding; 128: rank 0 61 + 3, rank 1 padding only
    return [(padded, f"TP=2 padded {padded} sequence parallel {sp}",
             _run(_config(padded, 2, sequence_parallel=sp)), rank)
            for padded in (64, 128) for sp in (False, True)]


def test_padding_changes_nothing_tp2():
    ref_loss, ref_params = _run(_config(TRUE))
    for per_rank in run_distributed(2, _tp2):
        for padded, what, (loss, params), rank in per_rank:
            _check(loss, params, ref_loss, ref_params, padded, 2, rank, what)


def test_true_vocabulary_must_fit():
    with pytest.raises(ValueError, match="must be positive and fit"):
        _config(60)
