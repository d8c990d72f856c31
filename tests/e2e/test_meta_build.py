"""The model built for a checkpoint load (meta device, then uninitialised storage) draws no random
numbers and, once loaded, equals the eagerly initialised model loaded from the same checkpoint,
at TP=2 x PP=2 (tied embeddings: the last stage's copy keeps its attributes)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import e2e_argv

RANDOM_OPS = ("normal", "uniform", "random", "bernoulli", "rand", "exponential", "multinomial",
              "cauchy", "geometric", "log_normal")


class CountDraws(TorchDispatchMode):
    """Counts the random-number operators (aten) that produce a tensor with storage."""

    def __init__(self):
        super().__init__()
        self.draws = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        if any(op in name for op in RANDOM_OPS):
            outs = out if isinstance(out, (tuple, list)) else [out]
            if any(isinstance(t, torch.Tensor) and not t.is_meta for t in outs):
                self.draws += 1
        return out


def _config(argv):
    from megatron import arguments
    from megatron.config import build_config
    from megatron.tokenizer import build_tokenizer

    args = arguments.parse_args(argv)
    arguments.validate_args(args, 4)
    return build_config(args, vocab_size=build_tokenizer(args).vocab_size)


def _state(model):
    return {k: v.clone() for chunk in model for k, v in chunk.module.state_dict().items()}


def _rank(save_argv, load_argv):
    import pretrain_llama
    from megatron import checkpointing
    from megatron.config import checkpoint_args
    from megatron.training import builders
    from megatron.training.initialize import initialize_megatron

    saving = _config(save_argv)
    device, _, groups = initialize_megatron(saving)
    counter = CountDraws()
    with counter:
        model, optimizer, scheduler = builders.setup_model_and_optimizer(
            saving, pretrain_llama.model_provider, groups, device)
    eager_draws = counter.draws
    checkpointing.save_checkpoint(3, model, optimizer, scheduler, saving.checkpoint, groups,
                                  run_flags=checkpoint_args(saving), consumed_train_samples=24,
                                  consumed_valid_samples=0)
    saved = _state(model)

    loading = _config(load_argv)  # another --seed: its initial weights differ from the saved ones
    assert checkpointing.weights_will_be_loaded(loading.checkpoint)
    results = {}
    for meta in (False, True):
        generator = torch.default_generator.get_state()
        counter = CountDraws()
        with counter:
            model, optimizer, scheduler = builders.setup_model_and_optimizer(
                loading, pretrain_llama.model_provider, groups, device,
                weights_from_checkpoint=meta)
        draws, unchanged = counter.draws, torch.equal(generator, torch.default_generator.get_state())
        before = _state(model)
        loaded = checkpointing.load_checkpoint(model, optimizer, scheduler, loading.checkpoint,
                                               groups, run_flags=checkpoint_args(loading))
        params = [p for chunk in model for p in chunk.module.parameters()]
        results[meta] = {
            "draws": draws, "generator unchanged": unchanged, "before": before,
            "after": _state(model), "iteration": loaded["iteration"],
            "attributes": [(getattr(p, "tensor_model_parallel", None), getattr(p, "partition_dim", None),
                            getattr(p, "shared_embedding", False), p.requires_grad, p.dtype,
                            p.device.type) for p in params],
            "main grads": [tuple(p.main_grad.shape) for p in params],
            "lr": optimizer.param_groups[0]["lr"]}
    return eager_draws, saved, results, groups.tp.rank, groups.pp.rank


def test_meta_build_draws_nothing_and_loads_the_eager_weights(data_prefix, tmp_path):
    ckpt, cache = str(tmp_path / "ckpt"), str(tmp_path / "cache")
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    save_argv = e2e_argv(data_prefix, cache, *layout, "--save", ckpt)
    load_argv = e2e_argv(data_prefix, cache, *layout, "--load", ckpt)
    load_argv[load_argv.index("--seed") + 1] = "99"
    out = run_distributed(4, _rank, save_argv, load_argv, timeout=600)
    assert sorted((t, p) for *_, t, p in out) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for eager_draws, saved, results, tp, pp in out:
        eager, meta = results[False], results[True]
        assert eager_draws > 0 and eager["draws"] > 0  # the counter sees the eager draws
        assert meta["draws"] == 0 and meta["generator unchanged"]
        # The other seed's eager weights differ from the checkpoint, so the load did the work.
        assert any(not torch.equal(eager["before"][k], saved[k]) for k in saved)
        assert eager["after"].keys() == meta["after"].keys() == saved.keys()
        for k in saved:
            assert torch.equal(meta["after"][k], saved[k]) and torch.equal(eager["after"][k], saved[k]), k
        assert meta["attributes"] == eager["attributes"] and meta["main grads"] == eager["main grads"]
        if pp == 1:  # the last stage holds the tied copy of the word embeddings
            assert any(shared for _, _, shared, *_ in meta["attributes"])
        assert meta["iteration"] == eager["iteration"] == 3 and meta["lr"] == eager["lr"]
