"""An entry script's own config section: its flags are parsed with the built-in ones and land in
the fields of its frozen dataclass under ``Config.extra``; a section whose flags and fields
disagree, or that shadows a built-in flag, is refused naming the flags."""

import dataclasses
import pickle
from dataclasses import dataclass

import pytest

from megatron import config as cfg
from megatron.arguments import parse_args, validate_args
from megatron.config.builder import builtin_dests
from tests.helpers.arguments import base_argv


@dataclass(frozen=True)
class _DPOConfig:
    dpo_beta: float = 0.1
    """``--dpo-beta``: the DPO temperature. Default 0.1."""
    dpo_sft_weight: float = 0.0
    """``--dpo-sft-weight``: weight of the SFT term. Default 0."""


def _add_dpo_args(parser):
    group = parser.add_argument_group("dpo")
    group.add_argument("--dpo-beta", type=float, default=0.1)
    group.add_argument("--dpo-sft-weight", type=float, default=0.0)
    return parser


@dataclass(frozen=True)
class _Bad:
    reference: str
    dpo_beta: float = 0.1
    dpo_sft_weight: float = 0.0


@dataclass
class _Loose:
    dpo_beta: float = 0.1
    dpo_sft_weight: float = 0.0


@dataclass(frozen=True)
class _Shadow(_DPOConfig):
    seed: int = 1


DPO = cfg.ConfigSection("dpo", _DPOConfig, _add_dpo_args)


def _config(files, extra_argv=(), sections=(DPO,)):
    args = parse_args(base_argv(files) + list(extra_argv), extra_args_provider=DPO.add_arguments)
    return cfg.build_config(validate_args(args, 4), vocab_size=100, sections=sections)


def test_a_registered_section_lands_in_config_extra(files):
    config = _config(files, ["--dpo-beta", "0.25"])
    assert config.extra["dpo"] == _DPOConfig(dpo_beta=0.25, dpo_sft_weight=0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.extra["dpo"].dpo_beta = 1.0
    with pytest.raises(TypeError):
        config.extra["other"] = 1  # read-only mapping
    assert _config(files, sections=()).extra == {}
    # Spawned ranks receive the configuration pickled.
    assert pickle.loads(pickle.dumps(config)).extra == config.extra
    # The built-in sections are untouched by the section's flags.
    assert not hasattr(config.training, "dpo_beta") and config.model.num_layers == 4


def test_the_builtin_dests_are_the_parsers():
    from megatron.arguments import parser_defaults
    assert set(parser_defaults()) <= builtin_dests()


@pytest.mark.parametrize("mistake,match", [
    ("flag-without-field", r"flags \['dpo_extra'\] land in no field of _DPOConfig"),
    ("shadows-builtin", r"flags \['seed'\] are built-in flags already"),
    ("field-without-default", r"fields \['reference'\] of _Bad are no flag and have no default"),
    ("not-frozen", r"_Loose must be a frozen dataclass"),
])
def test_a_section_whose_flags_and_fields_disagree_is_refused(files, mistake, match):
    def add(parser):
        _add_dpo_args(parser)
        if mistake == "flag-without-field":
            parser.add_argument("--dpo-extra", type=int, default=1)
        if mistake == "shadows-builtin":
            parser.add_argument("--dpo-seed", dest="seed", type=int, default=1)
        return parser

    cls = {"field-without-default": _Bad, "not-frozen": _Loose,
           "shadows-builtin": _Shadow}.get(mistake, _DPOConfig)
    section = cfg.ConfigSection("dpo", cls, add)
    args = validate_args(parse_args(base_argv(files), extra_args_provider=_add_dpo_args), 4)
    with pytest.raises(ValueError, match=match):
        cfg.build_config(args, vocab_size=100, sections=[section])
