"""Optimizer state in global coordinates: a bf16 distributed optimizer's state saved at DP=2
(bucket shards cutting parameters mid-row) is exactly the state a plain optimizer reads back in
one process, and the distributed optimizer at DP=4 reads back too (fp32 main params, both Adam
moments, step, parameter-group hyperparameters); a plain optimizer's checkpoint loads into the
distributed one."""

import torch

from megatron.core import parallel_state as ps
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups
from tests.helpers.toy import BUCKET, CLIP, LR, Net, WD, distrib_iteration


def _distributed(bf16=True):
    from megatron.core.distributed import DistributedDataParallel

    torch.manual_seed(0)
    net = Net().to(torch.bfloat16) if bf16 else Net()
    ddp = DistributedDataParallel(net, data_parallel_group=ps.get_data_parallel_group(),
                                  bucket_size=BUCKET, use_distributed_optimizer=True)
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP, bf16=bf16,
                                                 use_distributed_optimizer=True), [ddp],
                                 pg_collection=current_groups())
    return net, ddp, opt


def _full_state(opt):
    """``{name: {param, exp_avg, exp_avg_sq}}`` of the whole model, gathered over DP."""
    import torch.distributed as dist

    pieces = [None] * ps.get_data_parallel_world_size()
    dist.all_gather_object(pieces, opt.parameter_state()["params"],
                           group=ps.get_data_parallel_group())
    out = {}
    for name, p in opt.model_chunks[0].module.named_parameters():
        values = {k: torch.zeros(p.numel()) for k in ("param", "exp_avg", "exp_avg_sq")}
        for part in pieces:
            if f"0.{name}" in part:
                s, e = part[f"0.{name}"]["range"]
                for k in values:
                    values[k][s:e] = part[f"0.{name}"][k]
        out[name] = {k: v.view(p.shape) for k, v in values.items()}
    return out


def _save(opt, ddp, directory):
    from megatron.core.dist_checkpointing import balance_writers, save
    from megatron.model.sharded_state import model_shardings, model_sharded_tensors

    ddp.finish_param_sync()
    groups = current_groups()
    state = opt.sharded_state_dict(model_shardings([ddp], groups))
    boxes = balance_writers(model_sharded_tensors([ddp], groups) + state.replicated,
                            ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    save(boxes + state.owned, directory)
    return state.common


def _load(opt, model, directory, common):
    from megatron.core.dist_checkpointing import load, read_metadata, tensor_shapes
    from megatron.model.sharded_state import model_shardings, model_sharded_tensors

    saved = set(tensor_shapes(read_metadata(directory)))
    targets = opt.sharded_load_targets(model_shardings([model], current_groups()), saved)
    load(model_sharded_tensors([model], current_groups()) + targets.replicated + targets.owned, directory)
    targets.finish(common)


def _train_and_save(directory):
    ps.initialize_model_parallel(1, 1)
    net, ddp, opt = _distributed()
    for step in range(2):
        distrib_iteration(ddp, opt, step, 1)
    shapes = {f"0.{n}": p.shape for n, p in ddp.module.named_parameters()}
    assert any((pc.start % shapes[pc.name][1] or pc.end % shapes[pc.name][1])
               for r in opt.runs for pc in r.pieces if len(shapes[pc.name]) == 2)  # mid-row cuts
    common = _save(opt, ddp, directory)
    return _full_state(opt), common


def _load_distributed(directory, common):
    ps.initialize_model_parallel(1, 1)
    net, ddp, opt = _distributed()
    _load(opt, ddp, directory, common)
    return _full_state(opt), opt.optimizer.param_groups[0]["lr"], int(
        next(iter(opt.optimizer.state.values()))["step"])


def _plain_state(opt, net):
    out = {}
    pairs = dict(zip((p for g in opt.float16_groups for p in g),
                     (m for g in opt.fp32_from_float16_groups for m in g)))
    for name, p in net.named_parameters():
        main = pairs[p]
        st = opt.optimizer.state[main]
        out[name] = {"param": main.detach(), "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"],
                     "step": int(st["step"])}
    return out


def test_distributed_state_reads_back_as_plain_and_at_another_dp(tmp_path):
    directory = str(tmp_path / "ckpt")
    full, common = run_distributed(2, _train_and_save, directory)[0]
    assert common["step"] == 2 and len(common["param_groups"]) == 2

    torch.manual_seed(0)
    net = Net().to(torch.bfloat16)  # plain bf16 optimizer, one process, no torch.distributed
    plain = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP,
                                                   bf16=True), [net],
                                   pg_collection=current_groups())
    common["param_groups"][0]["lr"] = 0.123  # hyperparameters come from the checkpoint
    _load(plain, net, directory, common)
    got = _plain_state(plain, net)
    for name, values in full.items():
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[name][k], values[k]), (name, k)
        assert got[name]["step"] == 2
        assert torch.equal(dict(net.named_parameters())[name].detach(),
                           values["param"].to(torch.bfloat16))
    assert plain.optimizer.param_groups[0]["lr"] == 0.123

    # The distributed optimizer at DP=4 (other shard cuts) reads the same state.
    results = run_distributed(4, _load_distributed, directory, common)
    for state, lr, step in results:
        assert lr == 0.123 and step == 2
        for name, values in full.items():
            for k in values:
                assert torch.equal(state[name][k], values[k]), (name, k)


def _load_plain_into_distributed(directory, common, expected):
    ps.initialize_model_parallel(1, 1)
    net, ddp, opt = _distributed(bf16=False)
    _load(opt, ddp, directory, common)
    state = _full_state(opt)
    for name, values in expected.items():
        for k in values:
            assert torch.equal(state[name][k], values[k]), (name, k)
    return True


def test_plain_state_loads_into_the_distributed_optimizer(tmp_path):
    from megatron.core.dist_checkpointing import save
    from megatron.model.sharded_state import model_shardings, model_sharded_tensors

    torch.manual_seed(0)
    net = Net()  # fp32: the main params are the weights, saved once as model.<key>
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP), [net],
                                 pg_collection=current_groups())
    net(torch.randn(4, 8)).square().mean().backward()
    for p in net.parameters():
        p.main_grad = p.grad
    assert opt.step()[0]
    state = opt.sharded_state_dict(model_shardings([net], current_groups()))
    assert not [b for b in state.replicated if "fp32_param" in b.key]
    directory = str(tmp_path / "plain")
    save(model_sharded_tensors([net], current_groups()) + state.replicated, directory)
    expected = {n: {"param": p.detach().clone(), "exp_avg": opt.optimizer.state[p]["exp_avg"],
                    "exp_avg_sq": opt.optimizer.state[p]["exp_avg_sq"]}
                for n, p in net.named_parameters()}
    assert run_distributed(2, _load_plain_into_distributed, directory, state.common,
                           expected) == [True, True]
