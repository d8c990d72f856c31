"""Every examples/ recipe agrees with tools/plan.py for the hardware it states, or says why not.

Each script runs under bash with a fake launcher (tests/e2e/test_examples_flags.py's sandbox);
its recorded ``pretrain_llama.py`` flags give the model shape, batch, sequence and layout, its
launcher the number of GPUs, its header the GPU memory ("(80 GB)") and the vocabulary ("N rows
exactly"). The planner (``megatron.planner.cost.rank_layouts`` with ``tools/plan.py``'s default
hardware model) ranks the layouts of that shape; the recipe's (TP, CP, PP, DP, micro-batch,
recompute, sequence parallel, distributed optimizer) must be its first, or the script's comments
must hold a paragraph starting "Not tools/plan.py's first layout" that names the planner's
first layout as :func:`describe` writes it (so the reason goes stale when the ranking changes).
The CPU demo states no GPU: it must say why not.
"""

import os
import re

import pytest

from megatron.arguments import parse_args, validate_args
from megatron.config import ModelConfig
from megatron.config.builder import build_moe_config
from megatron.planner.cost import Hardware, Layout, rank_layouts
from tests.e2e.test_examples_flags import SCRIPTS, _launches, _option, sandbox  # noqa: F401
from tests.helpers.paths import ROOT

MARKER = "Not tools/plan.py's first layout"
GIB = 2 ** 30


def describe(layout: Layout) -> str:
    """``TP=1 x CP=8 x PP=8 x DP=1, micro-batch 1, distributed optimizer`` (+ recompute, SP)."""
    text = (f"TP={layout.tp} x CP={layout.cp} x PP={layout.pp} x DP={layout.dp}, "
            f"micro-batch {layout.micro_batch_size}")
    if layout.ep > 1 or layout.etp > 1:  # a mixture-of-experts recipe
        text += f", EP={layout.ep} x expert-TP={layout.etp}"
    if layout.recompute != "none":
        text += f", {layout.recompute} recompute"
    if layout.sequence_parallel:
        text += ", sequence parallel"
    if layout.use_distributed_optimizer:
        text += ", distributed optimizer"
    return text


def comments(path: str) -> str:
    """The script's comment text, lines joined by single spaces."""
    lines = [re.sub(r"^#+ ?", "", line.strip()) for line in open(path)
             if line.lstrip().startswith("#")]
    return re.sub(r"\s+", " ", " ".join(lines))


def recipe_files(path: str) -> list:
    """The script and, for a Slurm variant, the recipe it sources (where the model is stated and
    a reason the variant shares may be given)."""
    base = re.search(r"^source .*examples/(pretrain_\w+\.sh)", open(path).read(), re.M)
    return [path] + ([os.path.join(ROOT, "examples", base.group(1))] if base else [])


def recipe_flags(sandbox, script, tmp_path):
    argv = next(a for a in _launches(sandbox, script, tmp_path)
                if any(w.endswith("pretrain_llama.py") for w in a))
    entry = next(i for i, a in enumerate(argv) if a.endswith("pretrain_llama.py"))
    launcher = argv[:entry]
    gpus = (int(_option(launcher, "--nproc_per_node", "--nproc-per-node", default="1"))
            * int(_option(launcher, "--nnodes", default="1").split(":")[-1]))
    return validate_args(parse_args(argv[entry + 1:]), gpus), gpus


def planner_first(args, gpus: int, gpu_memory_gb: float, vocab: int) -> Layout:
    config = ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
        padded_vocab_size=vocab, max_position_embeddings=args.seq_length,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights)
    hw = Hardware(num_gpus=gpus, gpu_memory=gpu_memory_gb * GIB)  # plan.py's defaults otherwise
    moe = build_moe_config(args) if args.num_experts else None
    ranked = rank_layouts(config, hw, args.global_batch_size, args.seq_length, bf16=args.bf16,
                          vocab_size=vocab,
                          make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                          moe=moe, expert_tensor_parallel_size=expert_tp(args))
    assert ranked, "the planner finds no layout that fits"
    return ranked[0].layout


def expert_tp(args) -> int:
    """The recipe's expert-TP (1 for a dense model; the default is TP, as Megatron-Core's)."""
    if not args.num_experts:
        return 1
    return args.expert_tensor_parallel_size or args.tensor_model_parallel_size


def recipe_layout(args) -> Layout:
    return Layout(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                  dp=args.data_parallel_size, micro_batch_size=args.micro_batch_size,
                  num_microbatches=args.global_batch_size // (args.micro_batch_size
                                                              * args.data_parallel_size),
                  recompute=args.recompute_granularity or "none",
                  sequence_parallel=bool(args.sequence_parallel),
                  use_distributed_optimizer=bool(args.use_distributed_optimizer),
                  cp=args.context_parallel_size,
                  ep=args.expert_model_parallel_size if args.num_experts else 1, etp=expert_tp(args))


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_recipe_is_the_planners_first_or_says_why_not(sandbox, script, tmp_path):  # noqa: F811
    files = recipe_files(script)
    text = "".join(open(f).read() for f in files)
    said = " ".join(comments(f) for f in files)
    memory = re.search(r"\((\d+) GB\)", text)
    if memory is None:  # no GPU stated (the CPU demo): the planner has nothing to rank
        assert MARKER in said, f"{script}: states no GPU; say why the planner does not apply"
        return
    args, gpus = recipe_flags(sandbox, script, tmp_path)
    vocab = int(re.search(r"(\d+) rows exactly", text).group(1))
    first = planner_first(args, gpus, float(memory.group(1)), vocab)
    ours = recipe_layout(args)
    if ours != first:
        assert MARKER in said, (f"{os.path.basename(script)} on {gpus} GPUs runs {describe(ours)}; "
                                f"tools/plan.py ranks {describe(first)} first: use it, or say why "
                                f"not in a comment starting '{MARKER}'")
        assert describe(first) in said, (f"{os.path.basename(script)}: the reason names another "
                                         f"layout than the planner's first, {describe(first)}")


def test_describe_and_comments(tmp_path):
    layout = Layout(tp=2, pp=1, dp=2, micro_batch_size=1, num_microbatches=64, recompute="none",
                    sequence_parallel=True, use_distributed_optimizer=True, cp=2)
    assert describe(layout) == ("TP=2 x CP=2 x PP=1 x DP=2, micro-batch 1, sequence parallel, "
                                "distributed optimizer")
    script = tmp_path / "x.sh"
    script.write_text("#!/bin/bash\n# Not tools/plan.py's first layout: it ranks TP=1 x\n"
                      "#   CP=8 first.\nrun # trailing\n")
    assert comments(str(script)) == ("!/bin/bash Not tools/plan.py's first layout: it ranks "
                                     "TP=1 x CP=8 first.")


def test_mock_data_smoke_test_of_a_recipe(sandbox, tmp_path):  # noqa: F811
    """MOCK_DATA=1 runs a recipe without DATA_PATH: --mock-data replaces the data flags and the
    flags still validate at the recipe's world size."""
    script = os.path.join(ROOT, "examples", "pretrain_llama3_8b.sh")
    argv = next(a for a in _launches(sandbox, script, tmp_path, MOCK_DATA="1", DATA_PATH="")
                if any(w.endswith("pretrain_llama.py") for w in a))
    flags = argv[next(i for i, a in enumerate(argv) if a.endswith("pretrain_llama.py")) + 1:]
    assert "--mock-data" in flags and "--data-path" not in flags
    args = validate_args(parse_args(flags), 8)
    assert args.mock_data and args.context_parallel_size == 2
