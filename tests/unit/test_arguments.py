"""megatron.arguments: parsing, validation messages, derived values, flag policy, configs."""

import os

import pytest
import torch

from megatron import config as cfg
from megatron.arguments import (NOT_YET_SUPPORTED, parse_args, parser_defaults,
                                report_ignored_flags, validate_args)
from tests.helpers.arguments import base_argv, check
from tests.helpers.data import placeholder_dataset


def test_valid_demo_layout_and_derived_values(files):
    args = check(base_argv(files) + ["--tensor-model-parallel-size", "2",
                                     "--pipeline-model-parallel-size", "2"], world_size=8)
    assert (args.world_size, args.data_parallel_size) == (8, 2)
    assert args.kv_channels == 32 and args.num_query_groups == 4
    assert args.lr_decay_iters == 10 and args.distributed_backend in ("gloo", "nccl")
    assert args.normalization == "RMSNorm" and args.position_embedding_type == "rope"


def test_defaults_follow_megatron(files):
    argv = [a for a in base_argv(files)]
    for flag in ("--global-batch-size", "--ffn-hidden-size", "--max-position-embeddings"):
        i = argv.index(flag)
        del argv[i:i + 2]
    args = check(argv + ["--hidden-size", "4096", "--num-attention-heads", "32",
                         "--num-query-groups", "8"], world_size=2)
    assert args.global_batch_size == 2 * 2          # micro-batch x DP
    assert args.ffn_hidden_size == 10880            # int(4*4096*2/3/64)*64, Megatron's SwiGLU
    assert args.max_position_embeddings == 256
    assert args.split == "969, 30, 1" and args.make_vocab_size_divisible_by == 128


def test_megatron_llama_aliases(files):
    args = check(base_argv(files) + [
        "--RMSNorm", "--layernorm-epsilon", "1e-6", "--use-rotary-position-embeddings",
        "--no-position-embedding", "--swiglu", "--causal-lm", "--disable-bias-linear",
        "--reduce-bucket-size=2e8", "--override-opt_param-scheduler", "--data-impl", "mmap",
        "--dataloader-type", "cyclic", "--split", "98,2,0", "--job-name", "x",
        "--tensorboard-queue-size", "1000", "--log-timers-to-tensorboard",
        "--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard",
        "--distributed-timeout-minutes", "0.1", "--local_rank", "3"])
    assert args.norm_epsilon == 1e-6 and args.untie_embeddings_and_output_weights
    assert args.add_bias_linear is False and args.reduce_bucket_size == 2e8
    assert args.override_opt_param_scheduler and args.local_rank == 3
    assert args.distributed_timeout_minutes == 0.1
    assert parse_args(["--override-opt-param-scheduler"]).override_opt_param_scheduler
    assert parse_args(["--dataset-impl", "mmap"]).data_impl == "mmap"
    assert parse_args(["--norm-epsilon", "1e-6"]).norm_epsilon == 1e-6
    assert parse_args(["--normalization", "RMSNorm"]).normalization == "RMSNorm"


def test_ignored_flags_are_reported_once_each(files):
    args = check(base_argv(files) + ["--use-flash-attn", "--no-masked-softmax-fusion",
                                     "--data-impl", "mmap", "--use-cpu-initialization"])
    messages = report_ignored_flags(args)
    assert len(messages) == 4
    for flag in ("--use-flash-attn", "--no-masked-softmax-fusion", "--data-impl",
                 "--use-cpu-initialization"):
        assert sum(m.startswith(flag + " has no effect here") for m in messages) == 1
    assert report_ignored_flags(check(base_argv(files))) == []


TWO = ["--tensor-model-parallel-size", "2"]

ERRORS = [
    (["--overlap-param-gather"], 4, r"--overlap-param-gather needs --use-distributed-optimizer"),
    (["--num-attention-heads", "6", "--num-query-groups", "3", "--tensor-model-parallel-size",
      "4"], 4, r"--num-attention-heads \(6\) must be divisible by --tensor-model-parallel-size \(4\)"),
    (["--num-query-groups", "2", "--tensor-model-parallel-size", "4"], 4,
     r"--num-query-groups \(2\) must be divisible by --tensor-model-parallel-size \(4\)"),
    (["--num-query-groups", "3"], 1,
     r"--num-attention-heads \(8\) must be divisible by --num-query-groups \(3\)"),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2,
     r"--num-layers \(3\) must be divisible by --pipeline-model-parallel-size \(2\)"),
    (TWO + ["--pipeline-model-parallel-size", "2"], 6,
     r"world size \(6\) must be divisible by --tensor-model-parallel-size \(2\) x "
     r"--pipeline-model-parallel-size \(2\)"),
    (["--global-batch-size", "6"], 4,
     r"--global-batch-size \(6\) must be divisible by --micro-batch-size \(2\) x data-parallel "
     r"size \(4\) = 8"),
    (["--seq-length", "512"], 1,
     r"--seq-length \(512\) must be <= --max-position-embeddings \(256\)"),
    (["--hidden-size", "250"], 1,
     r"--hidden-size \(250\) must be divisible by --num-attention-heads \(8\), or give "
     r"--kv-channels"),
    (["--train-samples", "80"], 1, r"exactly one of --train-iters and --train-samples"),
    (["--bf16", "--fp16"], 1, r"--bf16 and --fp16 are mutually exclusive"),
    (["--async-save", "--save", "{prefix}_ckpt"], 1,
     r"--async-save needs --ckpt-format torch_dist \(got --ckpt-format torch\)"),
    (["--async-save", "--ckpt-format", "torch_dist"], 1, r"--async-save needs --save DIR"),
    (["--ckpt-convert-format", "torch_dist"], 1,
     r"--ckpt-convert-format and --ckpt-convert-save go together"),
    (["--ckpt-convert-format", "torch", "--ckpt-convert-save", "{prefix}_out"], 1,
     r"--ckpt-convert-format torch needs --load DIR"),
    (["--ckpt-convert-format", "torch", "--ckpt-convert-save", "{prefix}_in", "--load",
      "{prefix}_in"], 1, r"--ckpt-convert-save \(.*_in\) must differ from --load"),
    (["--normalization", "LayerNorm"], 1, r"--normalization \(LayerNorm\) is not supported.*RMSNorm"),
    (["--position-embedding-type", "learned_absolute"], 1,
     r"--position-embedding-type \(learned_absolute\) is not supported.*rope"),
    (["--tokenizer-model", "/nonexistent/tokenizer.model"], 1,
     r"--tokenizer-model \(/nonexistent/tokenizer.model\) does not exist"),
    (["--tokenizer-type", "NullTokenizer"], 1, r"NullTokenizer needs --vocab-size"),
    (["--tokenizer-type", "HuggingFaceTokenizer"], 1,
     r"--tokenizer-name-or-path \(.*tokenizer.model\) is not a folder"),
    (["--tokenizer-type", "GPT2BPETokenizer"], 1, r"GPT2BPETokenizer needs --vocab-file"),
    (["--data-path", "/nonexistent/prefix"], 1,
     r"^--data-path \(/nonexistent/prefix\) with --split 969, 30, 1, training data: "
     r"/nonexistent/prefix.idx: file not found"),
    (["--data-path", "0.3", "{prefix}", "0.7", "/nonexistent/b"], 1,
     r"/nonexistent/b.idx: file not found"),
    (["--data-path", "0.3", "{prefix}", "nan", "{prefix}"], 1, r"^--data-path \(0.3 .* nan .*\): weight nan"),
    (["--data-path", "0.3", "{prefix}", "{prefix}"], 1, r"'0.3' reads as a weight"),
    (["--split", "nan,1,1"], 1, r"^--split \(nan,1,1\): every share must be a finite number"),
    (["--split", "100,0,0"], 1, r"^--split \(100,0,0\): the validation share is 0, but --eval-iters "
                                r"\(100\) and --eval-interval \(1000\) ask for evaluation; give validation a "
                                r"share \(e.g. --split 98,2,0\), or pass --eval-iters 0"),
    (["--split", "9999,1,0"], 1,
     r"^--data-path .* with --split 9999,1,0: the valid split of .*corpus_text_document holds 0 tokens "
     r"\(sequences \[1000, 1000\) of 1000\), fewer than one sample of --seq-length 256"),
    (["--min-lr", "1.0"], 1, r"--min-lr \(1.0\) must be <= --lr \(0.002\)"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"], 1, r"mutually exclusive"),
    (["--lr-decay-samples", "100"], 1, r"--lr-decay-samples / --lr-warmup-samples go with"),
    (["--lr-warmup-iters", "100", "--lr-decay-iters", "100"], 1,
     r"--lr-warmup-iters \(100\) leaves no decay: the warmup \(100 iters\) must be shorter than "
     r"the decay \(--lr-decay-iters, 100, which defaults to --train-iters\)"),
    (["--lr-warmup-fraction", "1.0"], 1, r"--lr-warmup-fraction \(1.0\) leaves no decay"),
    (["--save-interval", "5"], 1, r"--save-interval \(5\) needs --save DIR"),
    (["--finetune"], 1, r"--finetune needs --load DIR"),
    (["--split", "90,x"], 1, r"--split \(90,x\): expected up to three numbers"),
    (["--hidden-dropout", "1.5"], 1, r"--hidden-dropout \(1.5\) must be in \[0, 1\)"),
    (["--num-layers", "0"], 1, r"--num-layers \(0\) must be positive"),
    (["--data-impl", "lazy"], 1, r"--data-impl \(lazy\) is not supported"),
    (["--train-data-path", "{prefix}"], 1, r"--data-path and --train-data-path are mutually"),
    (TWO + ["--context-parallel-size", "2"], 6,
     r"world size \(6\) must be divisible by --tensor-model-parallel-size \(2\) x "
     r"--pipeline-model-parallel-size \(1\) x --context-parallel-size \(2\) = 4"),
    (["--context-parallel-size", "0"], 1, r"--context-parallel-size \(0\) must be positive: ranks"),
    (["--context-parallel-size", "2", "--reset-attention-mask"], 2,
     r"--attention-dropout \(0.1\) must be 0"),  # document masks split fine: dropout is next
    (["--context-parallel-size", "2"], 2,
     r"--attention-dropout \(0.1\) must be 0 with --context-parallel-size \(2\).*"
     r"--attention-dropout 0.0"),
    (["--context-parallel-size", "3", "--attention-dropout", "0"], 3,
     r"--seq-length \(256\) must be divisible by 2 x --context-parallel-size \(3\) = 6 .*"
     r"252 or 258"),
    (TWO + ["--context-parallel-size", "2", "--attention-dropout", "0", "--sequence-parallel",
            "--seq-length", "252", "--max-position-embeddings", "252"], 4,
     r"--seq-length \(252\) must be divisible by 2 x --context-parallel-size \(2\) x "
     r"--tensor-model-parallel-size \(2\) under --sequence-parallel = 8"),
    (["--cp-comm-type", "a2a"], 1, r"--cp-comm-type a2a \(all-to-all context parallelism\) is "
                                   r"not supported; use p2p or all_gather"),
    (["--cp-comm-type", "ring"], 1, r"--cp-comm-type ring is not one of p2p, all_gather"),
    (["--cp-comm-type", "p2p", "allgather"], 1, r"one communication type for every layer"),
    (TWO + ["--num-experts", "12", "--sequence-parallel", "--expert-model-parallel-size", "3"], 4,
     r"^--expert-model-parallel-size \(3\) x --expert-tensor-parallel-size \(2\) = 6 must "
     r"divide the ranks of one pipeline stage, TP x CP x DP = 4 .*divides 4$"),
    (["--num-experts", "12", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size",
      "2"], 2,
     r"^--expert-model-parallel-size \(2\) x --expert-tensor-parallel-size \(2\) = 4 must "
     r"divide .* = 2"),
    (["--expert-model-parallel-size", "0"], 1,
     r"--expert-model-parallel-size \(0\) must be positive: ranks"),
    (["--expert-tensor-parallel-size", "0"], 1,
     r"--expert-tensor-parallel-size \(0\) must be positive: ranks"),
]


@pytest.mark.parametrize("extra, world_size, message", ERRORS)
def test_validation_errors_name_flag_value_and_fix(files, extra, world_size, message):
    argv = base_argv(files) + [a.replace("{prefix}", files["prefix"]) for a in extra]
    with pytest.raises(ValueError, match=message):
        check(argv, world_size)


def test_context_parallel_layout_and_config(files):
    cp = ["--context-parallel-size", "2", "--attention-dropout", "0"]
    args = check(base_argv(files) + TWO + cp + ["--cp-comm-type", "allgather"], world_size=8)
    assert (args.data_parallel_size, args.cp_comm_type) == (2, "all_gather")  # Megatron's spelling
    c = cfg.build_config(args, vocab_size=32001)
    assert c.parallel.context_parallel_size == c.model.context_parallel_size == 2
    assert c.model.cp_comm_type == "all_gather" and c.parallel.data_parallel_size == 2
    assert check(base_argv(files) + cp + ["--reset-position-ids"], 2).cp_comm_type == "p2p"
    with pytest.raises(ValueError, match=r"TP \(1\) x CP \(2\) x PP \(1\) x DP \(2\) = 4 != "
                                         r"world size \(2\)"):
        cfg.ParallelConfig(world_size=2, context_parallel_size=2, data_parallel_size=2)


def test_expert_layout_defaults_and_config(files):
    args = check(base_argv(files) + TWO, world_size=8)
    # Megatron-Core's defaults: EP 1, expert-TP = TP.
    assert (args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (1, 2)
    args = check(base_argv(files) + TWO + ["--num-experts", "4", "--sequence-parallel",
                                           "--expert-model-parallel-size", "4",
                                           "--expert-tensor-parallel-size", "1"], world_size=8)
    c = cfg.build_config(args, vocab_size=32001)
    assert (c.parallel.expert_model_parallel_size, c.parallel.expert_tensor_parallel_size) == (4, 1)


def test_query_groups_without_gqa_flag(files):
    argv = base_argv(files)
    argv.remove("--group-query-attention")
    with pytest.raises(ValueError, match=r"--num-query-groups \(4\) is given without "
                                         r"--group-query-attention"):
        check(argv)
    i = argv.index("--num-query-groups")
    assert check(argv[:i] + argv[i + 2:]).num_query_groups == 8  # plain multi-head attention


def test_missing_idx_is_named(files):
    os.remove(files["prefix"] + ".idx")
    with pytest.raises(ValueError, match=r"corpus_text_document\.idx: file not found"):
        check(base_argv(files))


def test_data_is_checked_from_its_index_before_anything_is_built(files, tmp_path):
    """What validation accepts is built as read (one parser); damaged and empty datasets and
    splits without data are refused here, naming the flag that gave them."""
    other = placeholder_dataset(str(tmp_path / "other_text_document"), num_docs=500)
    prefix = files["prefix"]
    # An unweighted list of two datasets, as Megatron-LM reads it (it used to pass validation
    # and fail in the builder after the model was built).
    args = check(base_argv(files) + ["--data-path", prefix, other, "--split", "98,2,0", "--eval-iters", "2"])
    assert args.data_path == [prefix, other]
    # ... whose one epoch is all it gives (Megatron-Core's rule): (20 + 10) x 300 tokens of
    # validation data, 23 + 11 samples, not the 100 x 8 of the default --eval-iters.
    with pytest.raises(ValueError, match=r"one epoch .* 34 samples of --seq-length 256 for the validation "
                                         r"split, which needs 800"):
        check(base_argv(files) + ["--data-path", prefix, other, "--split", "98,2,0"])
    with open(other + ".idx", "r+b") as f:  # int32 behind a uint16 header: pointers disagree
        f.seek(17)
        f.write(bytes([4]))
    with pytest.raises(ValueError, match=r"^--data-path \(.*\) with --split 969, 30, 1, training data: "
                                         r".*other_text_document\.idx: sequence 1 starts at byte 600"):
        check(base_argv(files) + ["--data-path", "1", prefix, "1", other])
    empty = placeholder_dataset(str(tmp_path / "empty_text_document"), num_docs=0)
    with pytest.raises(ValueError, match=r"^--valid-data-path \(.*empty_text_document\), validation "
                                         r"data: dataset .*empty_text_document holds no tokens"):
        check(base_argv(files)[:-2] + ["--train-data-path", prefix, "--valid-data-path", empty])
    # Without evaluation a zero validation share is fine.
    check(base_argv(files) + ["--split", "100,0,0", "--eval-iters", "0"])
    # Nor enough training samples for --train-iters 10**6, unless the loader cycles.
    with pytest.raises(ValueError, match=r"without weights each dataset is used for one epoch"):
        check(base_argv(files) + ["--data-path", prefix, prefix, "--train-iters", "1000000"])
    check(base_argv(files) + ["--data-path", prefix, prefix, "--train-iters", "1000000",
                              "--dataloader-type", "cyclic"])


def test_missing_required_flag(files):
    argv = base_argv(files)
    i = argv.index("--micro-batch-size")
    with pytest.raises(ValueError, match=r"--micro-batch-size is required"):
        check(argv[:i] + argv[i + 2:])


def test_check_files_false_skips_existence(files):
    argv = base_argv(files) + ["--data-path", "/nonexistent/prefix"]
    validate_args(parse_args(argv), 1, check_files=False)


def _not_yet_argv(dest):
    flag = NOT_YET_SUPPORTED[dest][0]
    default = parser_defaults()[dest]
    if isinstance(default, bool):
        return [flag]
    if dest == "rampup_batch_size":
        return [flag, "4", "4", "100"]
    if dest in ("recompute_granularity",):
        return [flag, "full"]
    if dest == "recompute_method":
        return [flag, "uniform"]
    return [flag, "3"]


@pytest.mark.parametrize("dest", sorted(NOT_YET_SUPPORTED))
def test_not_yet_supported_flags_are_refused(files, dest):
    flag = NOT_YET_SUPPORTED[dest][0]
    with pytest.raises(ValueError, match=f"{flag}.* is not supported yet .*: remove the flag"):
        check(base_argv(files) + _not_yet_argv(dest))


def test_bf16_forces_fp32_grad_accumulation(files):
    args = check(base_argv(files) + ["--bf16"])
    assert args.accumulate_allreduce_grads_in_fp32


def test_configs_from_args(files):
    args = check(base_argv(files) + TWO + ["--bf16", "--causal-lm", "--rotary-base", "500000"],
                 world_size=4)
    with pytest.raises(ValueError, match="padded vocabulary size is unknown"):
        cfg.build_model_config(args)
    c = cfg.build_config(args, vocab_size=32001)  # padded to a multiple of 128 x TP = 256
    assert c.model.padded_vocab_size == 32256 and c.model.num_query_groups == 4
    assert c.model.params_dtype == torch.bfloat16 and c.model.rotary_base == 500000.0
    assert c.model.untie_embeddings_and_output_weights and c.model.tensor_model_parallel_size == 2
    assert c.model.ffn_hidden_size == 688 and c.model.kv_channels == 32
    assert (c.parallel.world_size, c.parallel.data_parallel_size) == (4, 2)
    assert c.training.num_microbatches == 8 // (2 * 2)
    assert c.optimizer.lr == 2e-3
    assert c.optimizer.bf16 and c.optimizer.adam_beta2 == 0.999 and c.optimizer.optimizer == "adam"
    assert list(c.data.data_path) == [files["prefix"]] and c.data.seq_length == 256
    assert c.checkpoint.ckpt_format == "torch"
    with pytest.raises(Exception):
        c.parallel.world_size = 8  # frozen
    with pytest.raises(ValueError, match=r"!= world size"):
        cfg.ParallelConfig(world_size=4, tensor_model_parallel_size=2, data_parallel_size=1)


# Flags whose whole meaning is checked or derived by validate_args itself (LLaMA-only choices,
# aliases that imply another flag).
VALIDATION_ONLY = {"normalization", "position_embedding_type", "swiglu", "no_position_embedding",
                   "causal_lm", "group_query_attention"}
VALIDATION_ONLY |= {"recompute_activations"}  # becomes --recompute-granularity selective
# Megatron-LLaMA's flag: sets --use-distributed-optimizer and both overlaps.
VALIDATION_ONLY |= {"overlapped_distributed_optimizer", "use_megatron_fsdp"}
# Derives --virtual-pipeline-model-parallel-size (Megatron's rule).
VALIDATION_ONLY |= {"num_layers_per_virtual_pipeline_stage"}


def test_no_flag_is_silently_ignored():
    """Every dest is read by the product code, or reported as ignored, or refused as not yet
    supported, or fully handled by validation."""
    import glob
    import re
    from tests.helpers.paths import ROOT as root
    # The configuration package names every field after its flag: it does not count as a reader.
    config_package = os.path.join(root, "megatron", "config") + os.sep
    sources = [p for p in glob.glob(os.path.join(root, "megatron", "**", "*.py"), recursive=True)
               if not os.path.basename(p).startswith("arguments")
               and not p.startswith(config_package)]
    sources.append(os.path.join(root, "pretrain_llama.py"))
    text = "\n".join(open(p).read() for p in sources if os.path.exists(p))
    from megatron.arguments import IGNORED_FLAGS
    unused = [d for d in parser_defaults() if d not in NOT_YET_SUPPORTED and d not in IGNORED_FLAGS
              and d not in VALIDATION_ONLY and not re.search(rf"\b{d}\b", text)]
    assert unused == []


def test_overlapped_distributed_optimizer_means_both_overlaps(files):
    args = check(base_argv(files) + ["--overlapped-distributed-optimizer"])
    assert args.use_distributed_optimizer and args.overlap_grad_reduce and args.overlap_param_gather
    args = check(base_argv(files) + ["--use-distributed-optimizer"])
    assert not args.overlap_grad_reduce and not args.overlap_param_gather


def test_validate_is_idempotent(files):
    args = check(base_argv(files) + TWO)
    before = dict(vars(args))
    validate_args(args, 4)
    assert vars(args) == before
