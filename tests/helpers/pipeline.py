"""A toy stack of Linear + tanh layers split into pipeline stages, its batches, forward step and
the no-pipelining reference: the shared pieces of the schedule tests."""

import contextlib
from functools import partial

import torch
from torch import nn

from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.schedules import PipelineConfig
from megatron.core.process_groups import ProcessGroupCollection


S, B, H, LAYERS, SEED = 3, 2, 8, 4, 1234


class ToyStage(nn.Module):
    """Linear + tanh layers ``layer_ids`` of a LAYERS-deep stack; layer i is seeded by i, so a
    stage equals the same layers of the full model."""

    def __init__(self, layer_ids):
        super().__init__()
        self.layer_ids = list(layer_ids)
        layers = []
        for i in self.layer_ids:
            torch.manual_seed(SEED + i)
            layers.append(nn.Linear(H, H))
        self.layers = nn.ModuleList(layers)
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, x):
        h = x if self.input_tensor is None else self.input_tensor
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


def make_batches(m):
    g = torch.Generator().manual_seed(7)
    batches = []
    for i in range(m):
        mask = torch.rand(S, B, generator=g) > 0.3
        mask[0, 0] = True
        batches.append({"x": torch.randn(S, B, H, generator=g),
                        "target": torch.randn(S, B, H, generator=g), "mask": mask})
    return batches


def loss_func(batch, output):
    """Megatron-Core convention: (sum of masked per-token losses, token count, dict)."""
    per_token = ((output - batch["target"]) ** 2).sum(-1)  # [s, b]
    mask = batch["mask"].float()
    loss = (per_token * mask).sum()
    num_tokens = batch["mask"].sum()
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}


def make_forward_step(log=None, sync_state=None):
    counter = iter(range(10 ** 6))

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        k = next(counter)
        output = model(batch["x"])
        if log is not None:
            log.append(("F", k))
            if output.requires_grad:
                output.register_hook(lambda g: log.append(("B", k, sync_state["held"])))
        return output, partial(loss_func, batch)

    return forward_step


def reference(m, per_token, layers=LAYERS):
    """No pipelining on the full ``layers``-deep model: (loss dicts, the model with its grads)."""
    batches = make_batches(m)
    model = ToyStage(range(layers))
    config = PipelineConfig(hidden_size=H, calculate_per_token_loss=per_token)
    losses = schedules.forward_backward_no_pipelining(
        forward_step_func=make_forward_step(), data_iterator=iter(batches), model=model,
        num_microbatches=m, seq_length=S, micro_batch_size=B, config=config,
        pg_collection=ProcessGroupCollection.world_of_one())
    if per_token:
        total = sum(int(b["mask"].sum()) for b in batches)
        for p in model.parameters():
            p.grad /= total
    return losses, model


def check_losses(losses, ref_losses, case):
    """The last stage returns every micro-batch's loss dict, in order; the others nothing."""
    if ps.is_pipeline_last_stage():
        assert len(losses) == len(ref_losses), case
        for got, want in zip(losses, ref_losses):
            torch.testing.assert_close(got["lm loss"], want["lm loss"], rtol=1e-6, atol=1e-6)
    else:
        assert losses == [], case


def make_grad_hooks():
    """A no_sync_func that records whether reduction is held back, and a finalize_model_grads_func
    that does what the real one does with per-token loss: the token count lives on the last stage;
    every stage divides its gradients by it."""
    sync_state, finalized = {"held": False}, []

    @contextlib.contextmanager
    def no_sync():
        sync_state["held"] = True
        yield
        sync_state["held"] = False

    def finalize(chunks, *, num_tokens=None):
        assert not sync_state["held"]
        finalized.append(num_tokens)
        if num_tokens is not None:
            count = num_tokens.clone().float()
            torch.distributed.broadcast(count, src=ps.get_pipeline_model_parallel_ranks()[-1],
                                        group=ps.get_pipeline_model_parallel_group())
            for chunk in chunks:
                for p in chunk.parameters():
                    p.grad /= count

    return no_sync, finalize, sync_state, finalized
