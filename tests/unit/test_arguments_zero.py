"""--use-megatron-fsdp, --data-parallel-sharding-strategy, --optimizer-cpu-offload and
--optimizer-offload-fraction: what they turn on, and one line naming the flag for what is refused."""

import pytest

from tests.helpers.arguments import base_argv, check

FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy"]


@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
def test_strategy_turns_the_distributed_optimizer_on(files, strategy):
    args = check(base_argv(files) + FSDP + [strategy])
    assert args.use_distributed_optimizer and args.data_parallel_sharding_strategy == strategy
    from megatron.config.builder import build_config
    config = build_config(args, vocab_size=32000)
    assert config.parallel.data_parallel_sharding_strategy == strategy
    assert config.optimizer.use_distributed_optimizer


def test_defaults_are_plain(files):
    args = check(base_argv(files))
    assert args.data_parallel_sharding_strategy == "no_shard" and not args.use_megatron_fsdp
    assert not args.use_distributed_optimizer and not args.optimizer_cpu_offload
    args = check(base_argv(files) + ["--use-megatron-fsdp"])  # no_shard: plain DP
    assert not args.use_distributed_optimizer


@pytest.mark.parametrize("extra, message", [
    (["--data-parallel-sharding-strategy", "optim_grads"],
     r"^--data-parallel-sharding-strategy optim_grads needs --use-megatron-fsdp$"),
    (FSDP + ["optim_grads_params", "--overlapped-distributed-optimizer"],
     r"--overlap-param-gather \(also set by --overlapped-distributed-optimizer\) does not apply "
     r"to --data-parallel-sharding-strategy optim_grads_params"),
    (["--optimizer-cpu-offload"], r"--optimizer-cpu-offload needs --use-distributed-optimizer"),
    (["--use-distributed-optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction",
      "0.5"], r"--optimizer-offload-fraction \(0.5\) is not supported: only 1.0"),
])
def test_refused_with_one_line(files, extra, message):
    with pytest.raises(ValueError, match=message):
        check(base_argv(files) + extra)


def test_unknown_strategy_is_refused_by_the_parser(files):
    from megatron.usage_error import UsageError

    with pytest.raises(UsageError, match=r"--data-parallel-sharding-strategy: invalid choice: "
                                         r"'zero3' \(choose from 'no_shard', 'optim', "
                                         r"'optim_grads', 'optim_grads_params'\)"):
        check(base_argv(files) + FSDP + ["zero3"])
