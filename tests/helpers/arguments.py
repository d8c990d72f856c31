"""Argument lists for validation tests (the dataset and tokenizer files are the ``files`` fixture)."""

from megatron.arguments import parse_args, validate_args


def base_argv(files):
    # The CPU demo's shape: 4 layers, hidden 256, 8 heads in 4 query groups.
    return ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention "
            "--num-query-groups 4 --ffn-hidden-size 688 --seq-length 256 "
            "--max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 8 --lr 2e-3 "
            f"--train-iters 10 --tokenizer-type Llama2Tokenizer --tokenizer-model {files['model']} "
            f"--data-path {files['prefix']}").split()


def check(argv, world_size=4):
    return validate_args(parse_args(argv), world_size)
