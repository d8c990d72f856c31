"""The attention mask object against Megatron-LM's dense ``[b, 1, s, s]`` mask.

With ``--reset-attention-mask --reset-position-ids`` batches (documents ending at EOD tokens,
placed across the chunk boundaries of a CP=2 split), the model's per-token loss and every
gradient under ``AttentionMask`` documents equal those under the same mask given densely (the old
path: SDPA with ``attn_mask``) at TP=1, TP=2 with sequence parallelism, PP=2 and CP=2 (both
``--cp-comm-type``s), fp32, rtol 1e-6; the document path never forms an ``[s, s]`` tensor; and
documents packed in one sequence give the per-token losses and gradients of each document run
alone.
"""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.model import get_layer_numbers
from megatron.model.attention_mask import AttentionMask, masked_attention
from megatron.model.llama import LlamaModel
from pretrain_llama import get_ltor_masks_and_position_ids
from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups
from tests.helpers.model import batch, small_config

EOD = 0
S = 32
# End-of-document tokens: row 0 across the CP=2 chunk boundaries 8, 16, 24; row 1 with a
# document of one token (17) and one ending at a boundary (15).
EODS = ([5, 13, 27], [9, 15, 16])
TOL = 1e-6


def _close(got, expected, what):
    """Within rtol 1e-6 of the tensor's scale: ``|a - e| <= 1e-6 (|e| + max |e|)`` elementwise
    (different kernels round differently; an element near zero is held to the tensor's scale)."""
    torch.testing.assert_close(got, expected, rtol=TOL, atol=TOL * expected.abs().max().item(),
                               msg=lambda m: f"{what}: {m}")


def _packed(config):
    tokens, labels = batch(config, b=2, s=S)
    tokens = torch.where(tokens == EOD, torch.ones_like(tokens), tokens)
    for row, ends in enumerate(EODS):
        tokens[row, ends] = EOD
    mask, _, positions = get_ltor_masks_and_position_ids(tokens, EOD, True, True, False)
    return tokens, labels, positions, mask


def _weights(shape):
    # Position-dependent loss weights: every gradient depends on every token differently.
    return torch.linspace(0.5, 1.5, shape[0] * shape[1]).view(shape)


def _loss_and_grads(model, tokens, positions, mask, labels, weights=None):
    loss = model(tokens, positions, mask, labels=labels)
    (loss * (_weights(loss.shape) if weights is None else weights)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _assert_same(got, expected, what):
    _close(got[0], expected[0], f"{what} loss")
    assert got[1].keys() == expected[1].keys()
    for name in expected[1]:
        _close(got[1][name], expected[1][name], f"{what} {name}")


class _NoSquareTensors(TorchDispatchMode):
    """Records every op output whose last two dims are ``[s, s]``."""

    def __init__(self, s):
        super().__init__()
        self.s, self.found = s, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if torch.is_tensor(t) and t.dim() >= 2 and tuple(t.shape[-2:]) == (self.s, self.s):
                self.found.append((str(func), tuple(t.shape)))
        return out


def test_documents_equal_the_dense_mask_and_form_no_square_tensor():
    config = small_config()
    model = LlamaModel(config, pg_collection=current_groups())
    tokens, labels, positions, mask = _packed(config)
    assert mask.kind == "document" and len(mask.documents(0)) == 4
    dense = _loss_and_grads(model, tokens, positions, AttentionMask.from_dense(mask.to_dense()),
                            labels)
    with _NoSquareTensors(S) as spy:
        documents = _loss_and_grads(model, tokens, positions, mask, labels)
    assert spy.found == []
    _assert_same(documents, dense, "TP=1")
    # The spy sees a dense path's [s, s] tensors (it can fail).
    with _NoSquareTensors(S) as spy:
        _loss_and_grads(model, tokens, positions, AttentionMask.from_dense(mask.to_dense()), labels)
    assert spy.found


def test_attention_function_equals_dense_sdpa_with_gqa():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, S, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 2, S, 8, generator=gen, requires_grad=True) for _ in range(2))
    _, _, _, mask = _packed(small_config())
    results = []
    for m in (mask, AttentionMask.from_dense(mask.to_dense())):
        out = masked_attention(q, k, v, m)
        grads = torch.autograd.grad(out, (q, k, v), _weights((out.numel(), 1)).view_as(out))
        results.append((out.detach(), *grads))
    for a, e in zip(*results):
        _close(a, e, "attention")


def test_pipeline_stages_with_documents_equal_the_dense_whole_model():
    config = small_config(num_layers=4)
    whole = LlamaModel(config, pg_collection=current_groups())
    stages = [LlamaModel(config, pg_collection=current_groups(), pre_process=r == 0,
                         post_process=r == 1, layer_numbers=get_layer_numbers(4, 2, r))
              for r in range(2)]
    tokens, labels, positions, mask = _packed(config)
    expected = _loss_and_grads(whole, tokens, positions, AttentionMask.from_dense(mask.to_dense()),
                               labels)
    hidden = stages[0](tokens, positions, mask)
    sent = hidden.detach().requires_grad_()
    stages[1].set_input_tensor(sent)
    loss = stages[1](None, positions, mask, labels=labels)
    (loss * _weights(loss.shape)).sum().backward()
    hidden.backward(sent.grad)
    grads = {}
    for r, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            if name.startswith("layers."):
                i, rest = name[len("layers."):].split(".", 1)
                name = f"layers.{int(i) + 2 * r}.{rest}"
            grads[name] = p.grad
    _assert_same((loss.detach(), grads), expected, "PP=2")


def _tp_rank(config):
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(2, 1)
    config = config.replace(tensor_model_parallel_size=2, sequence_parallel=True)
    model = LlamaModel(config, pg_collection=current_groups())
    tokens, labels, positions, mask = _packed(config)
    dense = _loss_and_grads(model, tokens, positions, AttentionMask.from_dense(mask.to_dense()),
                            labels)
    documents = _loss_and_grads(model, tokens, positions, mask, labels)
    _assert_same(documents, dense, f"TP=2 SP rank {dist.get_rank()}")
    return documents[0]


def test_tensor_and_sequence_parallel_documents_equal_the_dense_mask():
    config = small_config()
    single = LlamaModel(config, pg_collection=current_groups())
    tokens, labels, positions, mask = _packed(config)
    with torch.no_grad():
        expected = single(tokens, positions, AttentionMask.from_dense(mask.to_dense()),
                          labels=labels)
    for loss in run_distributed(2, _tp_rank, config):
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def _cp_rank(config, comm_type):
    from megatron.core import parallel_state
    from megatron.core.context_parallel import get_batch_on_this_cp_rank, split_for_context_parallel
    groups = parallel_state.initialize_model_parallel(1, 1, context_parallel_size=2)
    config = config.replace(context_parallel_size=2, cp_comm_type=comm_type)
    model = LlamaModel(config, pg_collection=groups)
    tokens, labels, positions, mask = _packed(config)
    full = {"tokens": tokens, "labels": labels, "position_ids": positions, "attention_mask": mask}
    mine = get_batch_on_this_cp_rank(full, 2, groups.cp.rank)
    weights = split_for_context_parallel(_weights(tokens.shape), 2, groups.cp.rank)
    loss, grads = _loss_and_grads(model, mine["tokens"], mine["position_ids"],
                                  mine["attention_mask"], mine["labels"], weights)
    for g in grads.values():  # the gradient of the whole sequence's weighted loss
        dist.all_reduce(g, group=groups.cp.group)
    return loss, grads


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_context_parallel_documents_equal_one_process(comm_type):
    from megatron.core.context_parallel import split_for_context_parallel
    config = small_config()
    single = LlamaModel(config, pg_collection=current_groups())
    tokens, labels, positions, mask = _packed(config)
    loss, grads = _loss_and_grads(single, tokens, positions,
                                  AttentionMask.from_dense(mask.to_dense()), labels)
    for rank, got in enumerate(run_distributed(2, _cp_rank, config, comm_type)):
        _assert_same(got, (split_for_context_parallel(loss, 2, rank), grads), f"CP=2 rank {rank}")


def packed_and_alone(config, spy_length=None):
    """``(packed, alone)``: the per-token losses and weighted-sum gradients of one packed row of
    four documents, and of four runs of one document each (positions from 0, no mask); with
    ``spy_length`` the packed run is also checked to form no ``[s, s]`` tensor."""
    model = LlamaModel(config, pg_collection=current_groups())
    tokens, labels, positions, mask = _packed(config)
    tokens, labels, positions = tokens[:1], labels[:1], positions[:1]
    mask = AttentionMask.from_document_ids(mask.document_ids[:1])
    weights = _weights(tokens.shape)
    with _NoSquareTensors(spy_length or 0) as spy:
        packed = _loss_and_grads(model, tokens, positions, mask, labels, weights)
    assert spy.found == []
    losses, grads = [], {}
    for a, e in mask.documents(0):
        loss, g = _loss_and_grads(model, tokens[:, a:e], None, None, labels[:, a:e],
                                  weights[:, a:e])
        losses.append(loss)
        grads = {n: grads.get(n, 0) + g[n] for n in g}
    assert len(losses) == 4
    return packed, (torch.cat(losses, dim=1), grads)


def test_packed_documents_equal_each_document_alone():
    """One packed row of four documents against four runs of one document each."""
    packed, alone = packed_and_alone(small_config())
    _assert_same(packed, alone, "packed vs alone")


def test_a_dense_tensor_is_refused_with_the_fix():
    config = small_config()
    model = LlamaModel(config, pg_collection=current_groups())
    tokens, labels, positions, mask = _packed(config)
    with pytest.raises(TypeError, match="wrap a dense bool.*AttentionMask.from_dense"):
        model(tokens, positions, mask.to_dense())
    with pytest.raises(ValueError, match="must not decrease"):
        AttentionMask.from_document_ids(torch.tensor([[0, 1, 0]]))


@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="selective"),
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)],
    ids=["selective", "full"])
def test_recompute_with_documents_equals_the_dense_mask(recompute):
    """The mask object travels through both recompute paths (a non-tensor argument of the
    checkpointed core attention, a closure of the checkpointed layers)."""
    config = small_config()
    plain = LlamaModel(config, pg_collection=current_groups())
    recomputed = LlamaModel(small_config(**recompute), pg_collection=current_groups())
    tokens, labels, positions, mask = _packed(config)
    expected = _loss_and_grads(plain, tokens, positions, AttentionMask.from_dense(mask.to_dense()),
                               labels)
    _assert_same(_loss_and_grads(recomputed, tokens, positions, mask, labels), expected,
                 f"recompute {recompute['recompute_granularity']}")
