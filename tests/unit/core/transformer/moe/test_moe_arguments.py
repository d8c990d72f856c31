"""The MoE flags: the --moe-layer-freq parser (no eval), one-line refusals of nonsensical
combinations, and the MoEConfig section built by build_config."""

import pytest

from megatron.arguments import parse_args, parser_defaults
from megatron.arguments.moe import moe_layer_pattern, parse_layer_freq, validate_moe_flags
from megatron.config import MoEConfig, build_config
from megatron.usage_error import UsageError
from tests.helpers.arguments import base_argv, check


@pytest.mark.parametrize("text, value", [
    ("1", 1), ("2", 2), ("[1,0,1]", [1, 0, 1]), ("([1]*3+[0]*1)*2", [1, 1, 1, 0] * 2),
    ("[0]+[1]*3", [0, 1, 1, 1]), (" 2 * [1, 0] ", [1, 0, 1, 0]), ("((([1])))", [1])])
def test_layer_freq_parser(text, value):
    assert parse_layer_freq(text) == value


@pytest.mark.parametrize("text", [
    "__import__('os')", "[1]*", "[1]+2", "[1,]", "([1]", "[1] [0]", "[1]*[2]", "1.5", "[-1]",
    "[1]*10000000", "[1]*1000000*1000000", "1000000*1000000*[1]", "", "lambda: 1"])
def test_layer_freq_parser_refuses_everything_else(text):
    with pytest.raises(ValueError):
        parse_layer_freq(text)


def test_layer_freq_flag_is_one_usage_line():
    with pytest.raises(UsageError, match=r"argument --moe-layer-freq: '\[1\]\*': .*pattern"):
        parse_args(["--moe-layer-freq", "[1]*"])


def test_layer_pattern():
    assert moe_layer_pattern(1, 3) == (1, 1, 1)
    assert moe_layer_pattern(2, 5) == (1, 0, 1, 0, 1)
    assert moe_layer_pattern([0, 1], 2) == (0, 1)
    with pytest.raises(UsageError, match="one 0 or 1 per layer \\(--num-layers 3\\)"):
        moe_layer_pattern([1, 0], 3)
    with pytest.raises(UsageError, match="one 0 or 1 per layer"):
        moe_layer_pattern([1, 2], 2)


def _moe(flags, num_layers=4, ffn=688):
    args = parse_args(flags.split())
    args.num_layers, args.ffn_hidden_size = num_layers, ffn
    validate_moe_flags(args, parser_defaults())
    return args


REFUSED = [
    ("--moe-router-topk 4", "--moe-router-topk needs --num-experts"),
    ("--num-experts 4 --moe-token-dispatcher-type flex", "flex is not supported"),
    ("--num-experts 4 --moe-router-topk 5", r"--moe-router-topk \(5\) must be at most"),
    ("--num-experts 4 --moe-router-score-function sigmoid --moe-router-pre-softmax",
     "pre-softmax applies to"),
    ("--num-experts 4 --moe-router-enable-expert-bias", "needs --moe-router-score-function sigmoid"),
    ("--num-experts 8 --moe-router-num-groups 4", "go together"),
    ("--num-experts 6 --moe-router-num-groups 4 --moe-router-group-topk 2", "divisible by"),
    ("--num-experts 8 --moe-router-num-groups 4 --moe-router-group-topk 5", "at most"),
    ("--num-experts 8 --moe-router-topk 3 --moe-router-num-groups 4 --moe-router-group-topk 2",
     "multiple of"),
    ("--num-experts 4 --moe-apply-probs-on-input", "needs --moe-router-topk 1"),
    ("--num-experts 4 --moe-aux-loss-coeff 0.01 --moe-router-load-balancing-type none",
     "choose a loss type"),
    ("--num-experts 4 --moe-pad-expert-input-to-capacity", "needs --moe-expert-capacity-factor"),
    ("--num-experts 4 --moe-token-drop-policy position", "needs --moe-expert-capacity-factor"),
    ("--num-experts 4 --moe-expert-capacity-factor 1 --moe-pad-expert-input-to-capacity "
     "--moe-token-dispatcher-type allgather", "needs --moe-token-dispatcher-type alltoall"),
    ("--num-experts 4 --moe-shared-expert-gate", "needs --moe-shared-expert-intermediate-size"),
    ("--num-experts 4 --moe-layer-freq [1,0]", "one 0 or 1 per layer"),
]


@pytest.mark.parametrize("flags, message", REFUSED)
def test_nonsensical_combinations_are_one_line(flags, message):
    with pytest.raises(UsageError, match=message) as info:
        _moe(flags)
    assert "\n" not in str(info.value)


def test_valid_combination_fills_defaults():
    args = _moe("--num-experts 16 --moe-router-topk 4 --moe-router-score-function sigmoid "
                "--moe-router-enable-expert-bias --moe-router-num-groups 4 "
                "--moe-router-group-topk 2 --moe-layer-freq ([0]+[1]*1)*2")
    assert args.moe_ffn_hidden_size == 688 and args.moe_layer_freq == (0, 1, 0, 1)
    assert _moe("").moe_layer_freq == 1  # dense: left as given
    again = _moe("--num-experts 4 --moe-layer-freq 2")
    validate_moe_flags(again, parser_defaults())  # idempotent
    assert again.moe_layer_freq == (1, 0, 1, 0)


@pytest.mark.parametrize("flag, value", [("--num-experts", "0"), ("--moe-router-topk", "0"),
                                         ("--moe-aux-loss-coeff", "-1"),
                                         ("--moe-expert-capacity-factor", "0"),
                                         ("--moe-z-loss-coeff", "nan")])
def test_ranges(files, flag, value):
    with pytest.raises(UsageError, match=flag):
        check(base_argv(files) + ["--num-experts", "4", flag, value])


@pytest.mark.parametrize("extra, flag", [
    ("--context-parallel-size 2 --moe-expert-capacity-factor 1 --moe-token-drop-policy position",
     "--moe-token-drop-policy position at --context-parallel-size 2"),
    ("--calculate-per-token-loss", "--calculate-per-token-loss"),
])
def test_what_training_does_not_run_with_experts_yet_is_one_line(files, extra, flag):
    with pytest.raises(UsageError, match=f"--num-experts with {flag} is not supported yet") as e:
        check(base_argv(files) + ["--num-experts", "4"] + extra.split())
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("extra, match", [
    ("--tensor-model-parallel-size 2 --expert-tensor-parallel-size 1", "needs --sequence-parallel"),
    ("--expert-model-parallel-size 4 --num-experts 6", "must be divisible by"),
    ("--expert-tensor-parallel-size 2 --moe-ffn-hidden-size 33",
     r"--moe-ffn-hidden-size \(33\) must be divisible by --expert-tensor-parallel-size \(2"),
    ("--tensor-model-parallel-size 2 --sequence-parallel --moe-ffn-hidden-size 33",
     r"--expert-tensor-parallel-size \(2, default TP\)"),
    ("--expert-tensor-parallel-size 2 --save ckpt",
     "--expert-tensor-parallel-size 2 with --tensor-model-parallel-size 1, --save and "
     "--ckpt-format torch saves the experts' optimizer state only with the distributed "
     "optimizer: add --use-distributed-optimizer, or use --ckpt-format torch_dist$"),
    ("--moe-token-dispatcher-type flex", "flex is not supported"),
    ("--moe-router-bias-update-rate 0.1", "needs --moe-router-enable-expert-bias"),
    ("--moe-layer-freq [0,0,0,0]", "no layer is MoE"),
    ("--recompute-granularity selective --recompute-modules act mlp",
     "--recompute-modules act mlp recomputes nothing when every layer is MoE"),
])
def test_expert_layouts_not_built_are_one_line(files, extra, match):
    with pytest.raises(UsageError, match=match) as e:
        check(base_argv(files) + ["--num-experts", "4"] + extra.split())
    assert "\n" not in str(e.value)


def test_expert_parallelism_without_experts_is_one_line(files):
    with pytest.raises(UsageError, match="--expert-model-parallel-size 2 needs --num-experts"):
        check(base_argv(files) + ["--expert-model-parallel-size", "2"])


@pytest.mark.parametrize("extra, etp", [
    ("--expert-model-parallel-size 4", 1),
    ("--expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel "
     "--expert-tensor-parallel-size 1", 1),
    ("--expert-model-parallel-size 4 --context-parallel-size 2 --attention-dropout 0", 1),
    ("--expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel", 2),
    ("--expert-tensor-parallel-size 2", 2),
    # experts split over expert-TP = TP: the legacy format saves each tensor rank's slice
    ("--expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel "
     "--save ckpt --load ckpt", 2),
    # torch_dist saves whole experts at any expert-TP (tests/unit/test_expert_tp_checkpoint.py)
    ("--tensor-model-parallel-size 2 --sequence-parallel --save ckpt --ckpt-format torch_dist",
     2),
    ("--expert-tensor-parallel-size 2 --save ckpt --load ckpt --ckpt-format torch_dist", 2),
    # legacy at expert-TP != TP: whole experts, the distributed optimizer's state (docs/moe.md)
    ("--expert-tensor-parallel-size 2 --save ckpt --use-distributed-optimizer", 2),
    ("--expert-tensor-parallel-size 2 --use-megatron-fsdp", 2),  # ZeRO-3 at expert-TP 2
    ("--tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 "
     "--attention-dropout 0", 2),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1", 1),
    ("--recompute-activations --moe-router-load-balancing-type seq_aux_loss", 1),
    ("--moe-router-load-balancing-type global_aux_loss --moe-aux-loss-coeff 0.01", 1),
    ("--recompute-granularity selective --recompute-modules mlp --moe-layer-freq [1,0,1,0]", 1),
])
def test_expert_layouts_proven_pass(files, extra, etp):
    args = check(base_argv(files) + ["--num-experts", "4"] + extra.split())
    assert args.expert_tensor_parallel_size == etp


def test_build_config_moe_section(files):
    args = check(base_argv(files) + "--num-experts 4 --moe-router-topk 1 "
                 "--moe-layer-freq 2 --moe-grouped-gemm".split())
    config = build_config(args, vocab_size=32000)
    assert config.moe == MoEConfig(num_experts=4, moe_router_topk=1, moe_ffn_hidden_size=688,
                                   moe_layer_freq=(1, 0, 1, 0), moe_grouped_gemm=True)
    dense = build_config(check(base_argv(files)), vocab_size=32000)
    assert dense.moe == MoEConfig() and not dense.moe.is_moe
