"""Measuring a DDP-wrapped LlamaModel's bytes over an iteration, for the planner's tests."""

import torch


def measured_iteration(ddp, opt, groups, num_microbatches: int, seq: int = 16,
                       vocab: int = 128) -> None:
    """Two iterations of ``num_microbatches`` micro-batches of 2 x ``seq`` token ids (fixed
    seed); the meters (gradient peak, ZeRO-3's gathered peak) are reset before the second, so
    after the call they hold that iteration's peaks."""
    from megatron.core.distributed import finalize_model_grads

    ids = torch.randint(0, vocab, (2 * num_microbatches, seq),
                        generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        ddp.zero_grad_buffer()
        ddp.grad_meter.reset_peak()
        if ddp.param_units is not None:
            ddp.param_units.reset_peak()
        for i, mb in enumerate(ids.chunk(num_microbatches)):
            with ddp.no_sync() if i < num_microbatches - 1 else torch.enable_grad():
                ddp(mb, labels=mb).float().mean().backward()
        finalize_model_grads([ddp], pg_collection=groups)
        opt.step()
