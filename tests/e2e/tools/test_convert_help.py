"""tools/checkpoint/convert.py --help lists the general flags and every loader's and saver's own."""

import contextlib
import io

import pytest

from tools.checkpoint import convert


@pytest.mark.parametrize("argv", [["--help"], ["--loader", "hf", "--saver", "megatron", "--help"]])
def test_help_lists_every_loader_and_saver_flag(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        convert.main(argv)
    assert exit_.value.code == 0
    text = out.getvalue()
    for section in ("--loader hf: its own flags", "--loader megatron / megatron-lm: its own flags",
                    "--loader megatron-llama / megatron_llama: its own flags",
                    "--saver megatron: its own flags", "--saver hf: its own flags"):
        assert section in text, section
    for flag in ("--allow-unknown-hf-fields", "--true-vocab-size", "--norm-epsilon",
                 "--make-vocab-size-divisible-by", "--max-shard-size", "--tokenizer-dir",
                 "--target-tensor-parallel-size", "--include-optimizer"):
        assert flag in text, flag


def test_loader_flags_parse_once_chosen():
    parser, loader, saver = convert.build_parser(
        ["--loader", "megatron", "--saver", "hf", "--load-dir", "a", "--save-dir", "b"])
    args = parser.parse_args(["--loader", "megatron", "--saver", "hf", "--load-dir", "a",
                              "--save-dir", "b", "--true-vocab-size", "100", "--max-shard-size", "2GB"])
    assert args.true_vocab_size == 100 and loader.__name__.endswith("loader_megatron")
    assert saver.__name__.endswith("saver_hf")
