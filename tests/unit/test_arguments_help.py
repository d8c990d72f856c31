"""Every flag of pretrain_llama.py has a help text that names its default (or says it is
required), and ``--help`` shows them."""

import re

from megatron.arguments import build_parser, parser_defaults
from megatron.arguments.help import REQUIRED


def _flags():
    return [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]


def test_every_flag_has_help_naming_its_default():
    flags = _flags()
    assert len(flags) >= 135
    missing = [a.option_strings[0] for a in flags
               if not a.help or not re.sub(r"\(default: .*\)|\(required\)", "", a.help).strip()]
    assert missing == []
    silent = [a.option_strings[0] for a in flags if "default" not in a.help and "(required)" not in a.help]
    assert silent == []


def test_help_shows_defaults_as_the_parser_has_them():
    text = re.sub(r"\s+", " ", build_parser().format_help())
    defaults = parser_defaults()
    assert f"(default: {defaults['seed']})" in text and "(default: 1234)" in text
    assert re.search(r"--split SPLIT train, valid, test proportions of --data-path "
                     r"\(default: 969, 30, 1\)", text)
    # A flag without a value: on when leaving it out has its effect, else off.
    assert re.search(r"--use-distributed-optimizer .*?\(default: off\)", text)
    assert re.search(r"--no-accumulate-allreduce-grads-in-fp32 .*?\(default: off\)", text)
    assert re.search(r"--swiglu SwiGLU MLP .*?\(default: on\)", text)
    assert re.search(r"--tensorboard-dir TENSORBOARD_DIR .*?\(default: none\)", text)
    for flag in REQUIRED:
        action = next(a for a in _flags() if a.option_strings[0] == flag)
        assert action.help.endswith("(required)"), flag
