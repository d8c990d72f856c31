"""DistributedDataParallel and finalize_model_grads against single-process gradients (gloo, fp32)."""

import pytest
import torch

from megatron.core import parallel_state as ps
from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups
from tests.helpers.toy import Net, toy_data


def _reference_grads(x, y):
    torch.manual_seed(0)
    ref = Net()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


def _train_iteration(ddp, x, y, num_mb):
    ddp.zero_grad_buffer()
    for i, (xm, ym) in enumerate(zip(x.chunk(num_mb), y.chunk(num_mb))):
        last = i == num_mb - 1
        ctx = ddp.no_sync() if not last else torch.enable_grad()
        with ctx:
            (torch.nn.functional.mse_loss(ddp(xm), ym) / num_mb).backward()
    ddp.finish_grad_sync()


def _ddp_equals_single_process(num_mb, mbs):
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel

    ps.initialize_model_parallel(1, 1)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    x, y = toy_data(dp * num_mb * mbs)
    ref = _reference_grads(x, y)
    local = slice(rank * num_mb * mbs, (rank + 1) * num_mb * mbs)
    n_buckets = {}
    for bucket_size, overlap in [(None, False), (60, False), (60, True)]:
        torch.manual_seed(0)
        ddp = DistributedDataParallel(Net(), data_parallel_group=ps.get_data_parallel_group(),
                                      bucket_size=bucket_size, overlap_grad_reduce=overlap)
        for _ in range(2):  # the second iteration proves zero_grad_buffer resets everything
            _train_iteration(ddp, x[local], y[local], num_mb)
        (buf,) = ddp.buffers
        for name, p in ddp.module.named_parameters():
            assert p.grad is None
            assert p.main_grad.dtype == torch.float32
            assert p.main_grad.untyped_storage().data_ptr() == buf.grad_data.untyped_storage().data_ptr()
            torch.testing.assert_close(p.main_grad, ref[name], rtol=1e-5, atol=1e-7,
                                       msg=f"{name} bucket_size={bucket_size} overlap={overlap}")
        n_buckets[(bucket_size, overlap)] = len(buf.buckets)

        # Layout: buckets tile the buffer, each padded to a multiple of DP, no param straddles.
        end = 0
        for b in buf.buckets:
            assert b.offset == end and b.numel_padded % dp == 0
            assert 0 <= b.numel_padded - b.numel_unpadded < dp
            shards = [b.shard_range(r) for r in range(dp)]
            assert shards[0][0] == 0 and shards[-1][1] == b.numel_padded
            end = b.offset + b.numel_padded
            for p in b.params:
                start, stop, idx = buf.param_index_map[p]
                assert idx == b.index and b.offset <= start and stop <= b.offset + b.numel_unpadded
        assert end == buf.numel
        # Reverse registration order: the output layer (grads first in backward) leads.
        assert buf.param_index_map[ddp.module.out.bias][0] == 0
    dist.barrier()
    return n_buckets


@pytest.mark.parametrize("dp", [2, 4])
def test_ddp_equals_single_process(dp):
    out = run_distributed(dp, _ddp_equals_single_process, 3, 2)
    n_buckets = out[0]
    assert n_buckets[(None, False)] == 1
    assert n_buckets[(60, False)] == 3 and n_buckets[(60, True)] == 3


def _wrapper_behaviour():
    from megatron.core.distributed import DistributedDataParallel

    ps.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(3, 8)
    expected = net(x)
    ddp = DistributedDataParallel(net, data_parallel_group=ps.get_data_parallel_group(),
                                  bucket_size=50, use_distributed_optimizer=True)
    assert list(ddp.state_dict().keys()) == list(Net().state_dict().keys())
    ddp.load_state_dict(net.state_dict())
    torch.testing.assert_close(ddp(x), expected, rtol=0, atol=0)
    ddp.set_input_tensor("t")  # reaches the wrapped module
    assert net.input_tensor == "t"
    (buf,) = ddp.buffers
    for p in net.parameters():  # parameters now live in the contiguous param buffer
        assert p.untyped_storage().data_ptr() == buf.param_data.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="gloo"):
        DistributedDataParallel(Net(), data_parallel_group=ps.get_data_parallel_group(),
                                average_in_collective=True)
    return True


def test_wrapper_state_dict_forward_and_param_buffer():
    assert run_distributed(1, _wrapper_behaviour) == [True]


def _finalize_tp2_pp2():
    """4 ranks, TP=2 x PP=2: sequence-parallel, shared-embedding and per-token-loss reductions."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

    ps.initialize_model_parallel(2, 2)
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Module()
    net.emb = torch.nn.Parameter(torch.zeros(3, 2))
    net.emb.shared_embedding = True
    net.norm = torch.nn.Parameter(torch.zeros(2))
    net.norm.sequence_parallel = True
    net.other = torch.nn.Parameter(torch.zeros(2))
    ddp = DistributedDataParallel(net, data_parallel_group=ps.get_data_parallel_group())
    ddp.zero_grad_buffer()
    for p in net.parameters():
        p.main_grad.fill_(float(rank + 1))
    last_stage = ps.is_pipeline_last_stage()
    # Only the last stage knows the token count; other stages pass a dummy.
    finalize_model_grads([ddp], num_tokens=torch.tensor(4 if last_stage else -99),
                         pg_collection=current_groups())
    return {n: p.main_grad.flatten()[0].item() for n, p in net.named_parameters()}


def test_finalize_model_grads_tp2_pp2():
    out = run_distributed(4, _finalize_tp2_pp2)
    # ranks: tp groups [0,1] [2,3]; embedding groups [0,2] [1,3]; 4 tokens over DP=1.
    for rank, grads in enumerate(out):
        tp_peer = rank ^ 1
        emb_peer = (rank + 2) % 4
        assert grads["other"] == pytest.approx((rank + 1) / 4)
        assert grads["norm"] == pytest.approx((rank + 1 + tp_peer + 1) / 4)
        assert grads["emb"] == pytest.approx((rank + 1 + emb_peer + 1) / 4)


def _per_token_loss_dp2():
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

    ps.initialize_model_parallel(1, 1)
    rank = ps.get_data_parallel_rank()
    x, y = toy_data(6)
    torch.manual_seed(0)
    ref = Net()
    torch.nn.functional.mse_loss(ref(x), y, reduction="sum").backward()
    total_tokens = y.numel()
    torch.manual_seed(0)
    ddp = DistributedDataParallel(Net(), data_parallel_group=ps.get_data_parallel_group())
    ddp.zero_grad_buffer()
    xl, yl = x[rank * 3:(rank + 1) * 3], y[rank * 3:(rank + 1) * 3]
    tokens = 0
    for xm, ym in zip(xl.split([1, 2]), yl.split([1, 2])):
        torch.nn.functional.mse_loss(ddp(xm), ym, reduction="sum").backward()
        tokens += ym.numel()
    finalize_model_grads([ddp], num_tokens=torch.tensor(tokens), pg_collection=current_groups())
    for name, p in ddp.module.named_parameters():
        torch.testing.assert_close(p.main_grad, ref.get_parameter(name).grad / total_tokens,
                                   rtol=1e-5, atol=1e-7)
    return True


def test_finalize_per_token_loss_dp2():
    assert run_distributed(2, _per_token_loss_dp2) == [True, True]
