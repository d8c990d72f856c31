"""pretrain_llama.main() with the MLP parameters of every layer marked as expert parameters
(Megatron-Core's ``allreduce = False``): they take the expert paths (their own DDP buffers
reduced over expert-DP, their own optimizer part, their own checkpoint boxes) while the model
computes what it computes unmarked."""

from tests.helpers.pretrain import run_many


def run_with_mlp_experts(runs):
    """:func:`tests.helpers.pretrain.run_many` with the MLP parameters marked; also returns,
    per run, what the builders made: ``{name: (history, [(is_expert, buffer's group ranks)],
    [part is expert])}`` on the last rank."""
    import torch.distributed as dist

    import pretrain_llama
    from megatron.core.distributed.expert_params import mark_expert
    from megatron.training import builders

    provider, setup = pretrain_llama.model_provider, builders.setup_model_and_optimizer
    built = []

    def marked_provider(*args, **kwargs):
        model = provider(*args, **kwargs)
        for name, p in model.named_parameters():
            if ".mlp." in name:
                mark_expert(p)
        return model

    def recording_setup(*args, **kwargs):
        chunks, optimizer, scheduler = setup(*args, **kwargs)
        buffers = sorted({(buf.is_expert, tuple(dist.get_process_group_ranks(
            buf.data_parallel_group)) if buf.data_parallel_group is not None else ())
            for chunk in chunks for buf in chunk.buffers})
        parts = [part.expert for part in getattr(optimizer, "parts", [optimizer])]
        built.append((buffers, parts))
        return chunks, optimizer, scheduler

    pretrain_llama.model_provider = marked_provider
    builders.setup_model_and_optimizer = recording_setup
    try:
        histories = run_many(runs)
    finally:
        pretrain_llama.model_provider, builders.setup_model_and_optimizer = provider, setup
    if histories is None:
        return None
    return {name: (histories[name], *built[i]) for i, (name, _) in enumerate(runs)}
