"""Sequence parallelism (``--sequence-parallel``) equals none at TP=2, TP=4 and TP=2 x PP=2: the
same losses and every gradient on every rank, through the pipeline schedule (activations between
stages ``[s/T, b, h]``) and ``finalize_model_grads`` (norm-weight gradients summed over TP).
Under sequence parallelism, activation recompute with dropout equals no recompute with dropout."""

import pytest
import torch

from megatron.arguments import parse_args, validate_args
from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups
from tests.helpers.model import small_config

S, B, M = 8, 2, 2  # sequence, micro-batch, micro-batches

DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)
RECOMPUTE = {
    "selective": dict(recompute_granularity="selective",
                      recompute_modules=("core_attn", "act", "layernorm", "mlp")),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


def _step(config, tp, pp):
    """One iteration's forward/backward of this rank's stage; ``(losses, {name: grad})``."""
    from functools import partial

    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel.schedules import PipelineConfig, get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_manual_seed
    from megatron.model import LlamaModel, get_layer_numbers

    groups = current_groups()
    stage = LlamaModel(config, pg_collection=groups, pre_process=groups.is_pipeline_first_stage(),
                       post_process=groups.is_pipeline_last_stage(),
                       layer_numbers=get_layer_numbers(config.num_layers, pp, groups.pp.rank))
    g = torch.Generator().manual_seed(11)
    batches = [torch.randint(0, config.padded_vocab_size, (B, S + 1), generator=g) for _ in range(M)]

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        out = model(tokens[:, :-1], labels=tokens[:, 1:])

        def loss_func(per_token):
            return per_token.sum(), torch.tensor(per_token.numel()), {"lm loss": per_token.sum().detach()}
        return out, loss_func

    pcfg = PipelineConfig(hidden_size=config.hidden_size, sequence_parallel=config.sequence_parallel,
                          tensor_model_parallel_size=tp,
                          finalize_model_grads_func=partial(finalize_model_grads,
                                                            pg_collection=groups))
    model_parallel_manual_seed(9 + 100 * groups.pp.rank, groups.tp.rank)
    losses = get_forward_backward_func(groups)(
        forward_step_func=forward_step, data_iterator=iter(batches), model=stage,
        num_microbatches=M, seq_length=S, micro_batch_size=B, config=pcfg, pg_collection=groups)
    if config.sequence_parallel:
        norms = [n for n, p in stage.named_parameters() if "layernorm" in n]
        assert norms and all(stage.get_parameter(n).sequence_parallel for n in norms)
    return [d["lm loss"] for d in losses], {n: p.grad.clone() for n, p in stage.named_parameters()}


def _assert_same(got, want, what, rel):
    (losses, grads), (ref_losses, ref_grads) = got, want
    assert len(losses) == len(ref_losses)
    for a, b in zip(losses, ref_losses):
        torch.testing.assert_close(a, b, rtol=rel, atol=0, msg=f"{what}: loss")
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        err = (grads[name] - ref).abs().max() / ref.abs().max()
        assert err <= rel, f"{what}: grad of {name} differs by {err:.2e} of its largest element"


def _rank(tp, pp, changes):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tp, pp)
    config = small_config(num_layers=4, tensor_model_parallel_size=tp, **changes)
    none = _step(config, tp, pp)
    sp = _step(config.replace(sequence_parallel=True), tp, pp)
    # Reduce-scatter / all-gather sum in another order than all-reduce: fp32 rounding.
    _assert_same(sp, none, "sequence parallel vs none", 1e-5)

    sp_dropout = _step(config.replace(sequence_parallel=True, **DROPOUT), tp, pp)
    assert not torch.equal(torch.stack(sp_dropout[0] or [torch.zeros(())]),
                           torch.stack(sp[0] or [torch.ones(())])), "dropout had no effect"
    for name, changes in RECOMPUTE.items():
        got = _step(config.replace(sequence_parallel=True, **DROPOUT, **changes), tp, pp)
        _assert_same(got, sp_dropout, f"{name} recompute under SP with dropout", 4e-7)
    return True


@pytest.mark.parametrize("tp,pp,changes", [
    (2, 1, {}),
    (4, 1, {"num_query_groups": 4}),
    (2, 2, {"untie_embeddings_and_output_weights": False}),
], ids=["tp2", "tp4", "tp2-pp2-tied"])
def test_sequence_parallel_equals_none(tp, pp, changes):
    assert all(run_distributed(tp * pp, _rank, tp, pp, changes))


def _args(*extra, world=2):
    argv = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--data-path", "unused",
            *extra]
    return validate_args(parse_args(argv), world, check_files=False)


def test_sequence_parallel_flags():
    assert _args("--sequence-parallel", "--tensor-model-parallel-size", "2").sequence_parallel
    with pytest.warns(UserWarning, match="--sequence-parallel has no effect"):
        assert not _args("--sequence-parallel", world=1).sequence_parallel
    with pytest.raises(ValueError, match=r"--seq-length \(16\) must be divisible by "
                                         r"--tensor-model-parallel-size \(32\)"):
        _args("--sequence-parallel", "--tensor-model-parallel-size", "32",
              "--num-attention-heads", "32", "--hidden-size", "64", world=32)


def test_recompute_flags():
    args = _args("--recompute-activations")
    assert args.recompute_granularity == "selective"
    args = _args("--recompute-granularity", "full", "--recompute-method", "block",
                 "--recompute-num-layers", "2", "--pipeline-model-parallel-size", "2")
    assert (args.recompute_method, args.recompute_num_layers) == ("block", 2)
    with pytest.raises(ValueError, match=r"--recompute-num-layers \(3\) must be <= the layers"):
        _args("--recompute-granularity", "full", "--recompute-method", "uniform",
              "--recompute-num-layers", "3", "--pipeline-model-parallel-size", "2")
    with pytest.raises(ValueError, match="needs --recompute-method"):
        _args("--recompute-granularity", "full", "--recompute-num-layers", "1")
    with pytest.raises(ValueError, match="contradicts"):
        _args("--recompute-activations", "--recompute-granularity", "full")
