"""Pipeline schedules: 1F1B on gloo worlds equals no pipelining in one process (losses and every
gradient), follows the 1F1B order of operations, and forward-only leaves no gradients."""

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.schedules import PipelineConfig
from megatron.core.process_groups import ProcessGroupCollection
from tests.helpers.dist import run_distributed
from tests.helpers.pipeline import (B, H, LAYERS, S, ToyStage, check_losses, loss_func,
                                    make_batches, make_forward_step, make_grad_hooks, reference)

ONE = ProcessGroupCollection.world_of_one()


def expected_order(pp, rank, m):
    """Warmup forwards, steady one-forward-one-backward, cooldown backwards; the reduction is held
    back (no_sync) for every backward but the last."""
    w = min(pp - rank - 1, m)
    order = [("F", k) for k in range(w)]
    for j in range(m - w):
        order += [("F", w + j), ("B", j)]
    order += [("B", j) for j in range(m - w, m)]
    backwards = [i for i, op in enumerate(order) if op[0] == "B"]
    return [op + (i != backwards[-1],) if op[0] == "B" else op for i, op in enumerate(order)]


def _pipelined(pp, cases):
    groups = ps.initialize_model_parallel(1, pp)
    rank = groups.pp.rank
    per_stage = LAYERS // pp
    fn = schedules.get_forward_backward_func(groups)
    assert fn is schedules.forward_backward_pipelining_without_interleaving
    report = []
    for m, forward_only, per_token, deallocate in cases:
        model = ToyStage(range(rank * per_stage, (rank + 1) * per_stage))
        log = []
        no_sync, finalize, sync_state, finalized = make_grad_hooks()
        config = PipelineConfig(hidden_size=H, calculate_per_token_loss=per_token,
                                no_sync_func=no_sync, finalize_model_grads_func=finalize,
                                deallocate_pipeline_outputs=deallocate)
        losses = fn(forward_step_func=make_forward_step(log, sync_state),
                    data_iterator=iter(make_batches(m)), model=[model], num_microbatches=m,
                    seq_length=S, micro_batch_size=B, forward_only=forward_only, config=config,
                    pg_collection=groups)
        ref_losses, ref_model = reference(m, per_token)
        case = (m, forward_only, per_token, deallocate)
        check_losses(losses, ref_losses, case)
        if forward_only:
            assert all(p.grad is None for p in model.parameters()), case
            assert log == [("F", k) for k in range(m)], case
            assert finalized == [], case
        else:
            ref = ref_model.layers[rank * per_stage: (rank + 1) * per_stage]
            for got, want in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)
            assert log == expected_order(pp, rank, m), (case, log)
            assert len(finalized) == 1, case
            if per_token and groups.is_pipeline_last_stage():
                assert int(finalized[0]) == sum(int(b["mask"].sum()) for b in make_batches(m))
        report.append(case)
    return report


CASES = [(1, False, False, True), (2, False, False, True), (3, False, False, False),
         (5, False, False, True), (4, False, True, True), (3, True, False, True)]


@pytest.mark.parametrize("pp", [2, 4])
def test_1f1b_equals_no_pipelining(pp):
    # m = 1 and m < PP (all of a stage's forwards are warmup), m = PP, m > PP; per-token loss;
    # without deallocation of sent outputs; forward-only.
    outs = run_distributed(pp, _pipelined, pp, CASES)
    assert all(o == CASES for o in outs)


def test_no_pipelining_equals_plain_math():
    m = 3
    batches = make_batches(m)
    losses, ref = reference(m, per_token=False)
    grads = [p.grad for p in ref.parameters()]
    model = ToyStage(range(LAYERS))
    total = 0.0
    for b in batches:
        loss, n, _ = loss_func(b, model(b["x"]))
        total = total + loss / n / m
    total.backward()
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-7)
    # per-token: the mean over every unmasked token of the batch
    _, ref = reference(m, per_token=True)
    grads = [p.grad for p in ref.parameters()]
    model.zero_grad()
    out = [loss_func(b, model(b["x"])) for b in batches]
    (sum(o[0] for o in out) / sum(o[1] for o in out)).backward()
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-7)


def test_legacy_two_value_loss_is_averaged_over_micro_batches():
    batches = make_batches(2)
    model = ToyStage(range(LAYERS))

    def forward_step(it, model):
        b = next(it)
        return model(b["x"]), lambda out: (loss_func(b, out)[0], {"sum": 1})

    out = schedules.forward_backward_no_pipelining(
        forward_step_func=forward_step, data_iterator=[iter(batches)], model=[model],
        num_microbatches=2, seq_length=S, micro_batch_size=B, forward_only=False,
        config=PipelineConfig(hidden_size=H), pg_collection=ONE)
    assert out == [{"sum": 1}, {"sum": 1}]
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (sum(loss_func(b, model(b["x"]))[0] for b in batches) / 2).backward()
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-6)


def test_bad_input_is_refused():
    config = PipelineConfig(hidden_size=H, sequence_parallel=True, tensor_model_parallel_size=2)
    assert schedules.get_tensor_shape(4, 2, config) == [2, 2, H]
    with pytest.raises(ValueError, match="--seq-length"):
        schedules.get_tensor_shape(3, 2, config)
    with pytest.raises(ValueError, match="interleaved"):
        schedules.forward_backward_no_pipelining(
            forward_step_func=None, data_iterator=None, model=[ToyStage([0]), ToyStage([1])],
            num_microbatches=1, seq_length=S, micro_batch_size=B, config=PipelineConfig(H),
            pg_collection=ONE)
    with pytest.raises(ValueError, match="loss_func must return"):
        schedules.forward_backward_no_pipelining(
            forward_step_func=lambda it, m: (m(torch.zeros(S, B, H)), lambda o: (o.sum(),)),
            data_iterator=None, model=ToyStage([0]), num_microbatches=1, seq_length=S,
            micro_batch_size=B, config=PipelineConfig(H), pg_collection=ONE)


def test_warmup_counts():
    assert [schedules.get_num_warmup_microbatches(8, 4, r) for r in range(4)] == [3, 2, 1, 0]
    assert [schedules.get_num_warmup_microbatches(2, 4, r) for r in range(4)] == [2, 2, 1, 0]


def _llama_pipelined(tp, pp, tied, m):
    from megatron.config import ModelConfig
    from megatron.model import LlamaModel, get_layer_numbers

    groups = ps.initialize_model_parallel(tp, pp)
    rank = groups.pp.rank
    config = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                         num_query_groups=2, padded_vocab_size=64, max_position_embeddings=16,
                         untie_embeddings_and_output_weights=not tied,
                         tensor_model_parallel_size=tp, seed=3)
    s, b = 8, 2
    g = torch.Generator().manual_seed(11)
    batches = [{"tokens": torch.randint(0, 64, (b, s + 1), generator=g),
                "mask": (torch.rand(b, s, generator=g) > 0.2).float()} for _ in range(m)]

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        tokens = batch["tokens"]
        out = model(tokens[:, :-1], labels=tokens[:, 1:])  # [b, s] loss on the last stage

        def loss_func(per_token):
            loss = (per_token * batch["mask"]).sum()
            return loss, batch["mask"].sum().to(torch.int64), {"lm loss": loss.detach()}
        return out, loss_func

    def finalize(chunks, *, num_tokens=None):
        # The tied embedding's two copies (first and last stage) sum their gradients.
        for p in chunks[0].parameters():
            if getattr(p, "shared_embedding", False):
                torch.distributed.all_reduce(p.grad, group=groups.embedding.group)

    pcfg = PipelineConfig(hidden_size=32, finalize_model_grads_func=finalize)
    stage = LlamaModel(config, pg_collection=groups, pre_process=groups.is_pipeline_first_stage(),
                       post_process=groups.is_pipeline_last_stage(),
                       layer_numbers=get_layer_numbers(4, pp, rank))
    losses = schedules.get_forward_backward_func(groups)(
        forward_step_func=forward_step, data_iterator=iter(batches), model=stage,
        num_microbatches=m, seq_length=s, micro_batch_size=b, config=pcfg, pg_collection=groups)

    whole = LlamaModel(config,
                       pg_collection=groups)  # same TP partition, every layer: the reference
    ref_losses = schedules.forward_backward_no_pipelining(
        forward_step_func=forward_step, data_iterator=iter(batches), model=whole,
        num_microbatches=m, seq_length=s, micro_batch_size=b, config=PipelineConfig(hidden_size=32),
        pg_collection=groups)
    if groups.is_pipeline_last_stage():
        torch.testing.assert_close(torch.stack([d["lm loss"] for d in losses]),
                                   torch.stack([d["lm loss"] for d in ref_losses]), rtol=1e-6, atol=1e-6)
    else:
        assert losses == []
    expected = dict(whole.named_parameters())
    checked = 0
    for name, p in stage.named_parameters():
        if name.startswith("layers."):
            i, rest = name[len("layers."):].split(".", 1)
            name = f"layers.{stage.layers[int(i)].layer_number - 1}.{rest}"
        name = name.replace("word_embeddings_for_head", "word_embeddings")
        torch.testing.assert_close(p.grad, expected[name].grad, rtol=1e-5, atol=1e-6, msg=name)
        checked += 1
    return checked


@pytest.mark.parametrize("tp,pp,tied", [(2, 2, True), (1, 4, False)])
def test_1f1b_llama_stages_equal_the_whole_model(tp, pp, tied):
    checked = run_distributed(tp * pp, _llama_pipelined, tp, pp, tied, 3)
    assert all(c > 0 for c in checked)
