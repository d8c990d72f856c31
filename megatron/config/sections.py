"""Configuration sections that an entry script registers for its own flags.

A post-training script (SFT, DPO, a reward model) has flags that ``pretrain_llama.py`` does not:
it declares them once as a :class:`ConfigSection`, a frozen dataclass whose field names are the
flags' argparse ``dest`` names (docstring per field, as the built-in sections) and the function
that adds the flags to the parser. The script parses with
``parse_args(argv, extra_args_provider=section.add_arguments)`` and builds with
``build_config(args, vocab_size=..., sections=[section])``; the values are then
``config.extra[section.name]``, a frozen instance of the dataclass. Every flag the section adds
must land in one of its fields, and none may shadow a built-in flag (:func:`check_section`).

Example::

    @dataclass(frozen=True)
    class DPOConfig:
        dpo_beta: float = 0.1
        \"\"\"``--dpo-beta``: the DPO temperature. Default 0.1.\"\"\"

    def add_dpo_args(parser):
        parser.add_argument("--dpo-beta", type=float, default=0.1)
        return parser

    DPO = ConfigSection("dpo", DPOConfig, add_dpo_args)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from typing import Callable, Iterable

_RESERVED = {"help"}


@dataclass(frozen=True)
class ConfigSection:
    """An entry script's own section of the configuration.

    Attributes:
        name: the key in ``Config.extra`` (an identifier, e.g. ``"dpo"``).
        cls: a frozen dataclass; its fields are the ``dest`` names of the section's flags.
        add_arguments: ``add_arguments(parser) -> parser`` adds the flags (Megatron's
            ``extra_args_provider`` convention).
    """

    name: str
    cls: type
    add_arguments: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]

    def dests(self) -> set:
        """The ``dest`` of every flag :attr:`add_arguments` adds."""
        parser = argparse.ArgumentParser(add_help=False)
        self.add_arguments(parser)
        return {a.dest for a in parser._actions} - _RESERVED

    def given(self, argv) -> dict:
        """``{dest: the option as typed}`` of the section's flags that ``argv`` (a list;
        ``sys.argv[1:]`` when None) gives, whatever their value: a flag given at its default
        value is given. ``argv`` must already have parsed with the whole parser."""
        parser = _Given(add_help=False, allow_abbrev=False)
        self.add_arguments(parser)
        parser._defaults.clear()  # set_defaults of other flags (e.g. a changed built-in default)
        for action in parser._actions:
            action.default = argparse.SUPPRESS
        found, _ = parser.parse_known_args(argv)
        tokens = [t.split("=", 1)[0] for t in (sys.argv[1:] if argv is None else argv)]
        out = {}
        for action in parser._actions:
            if action.dest in vars(found) and action.dest not in _RESERVED:
                typed = [o for o in action.option_strings if o in tokens]
                out[action.dest] = typed[-1] if typed else action.option_strings[0]
        return out


class _Given(argparse.ArgumentParser):
    """The parser of :meth:`ConfigSection.given`: an error (never expected on an argv the whole
    parser took) is an exception, not an exit."""

    def error(self, message):
        raise ValueError(message)


def check_section(section: ConfigSection, builtin_dests: Iterable[str]) -> None:
    """Raises ValueError naming the flags when the section's flags and fields disagree: a flag
    without a field, a field that is no flag and has no default, a flag that a built-in section
    already has, a name that is no identifier, or a class that is not a frozen dataclass."""
    if not section.name.isidentifier():
        raise ValueError(f"config section name {section.name!r} must be an identifier")
    cls = section.cls
    if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
        raise ValueError(f"config section {section.name!r}: {cls.__name__} must be a frozen "
                         "dataclass")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    dests = section.dests()
    missing = sorted(dests - set(fields))
    if missing:
        raise ValueError(f"config section {section.name!r}: flags {missing} land in no field of "
                         f"{cls.__name__}; add a field named like each flag's dest")
    no_default = sorted(n for n, f in fields.items() if n not in dests
                        and f.default is dataclasses.MISSING
                        and f.default_factory is dataclasses.MISSING)
    if no_default:
        raise ValueError(f"config section {section.name!r}: fields {no_default} of "
                         f"{cls.__name__} are no flag and have no default")
    shadowed = sorted(dests & set(builtin_dests))
    if shadowed:
        raise ValueError(f"config section {section.name!r}: flags {shadowed} are built-in "
                         "flags already (megatron/arguments/parser.py); name yours differently")


def build_sections(args, sections: Iterable[ConfigSection], builtin_dests: Iterable[str]) -> dict:
    """``{name: frozen section}`` of ``args`` for each registered section (checked first).

    Raises:
        ValueError: :func:`check_section`'s refusals, or two sections of one name.
    """
    builtin_dests = set(builtin_dests)
    out = {}
    for section in sections:
        if section.name in out:
            raise ValueError(f"two config sections are named {section.name!r}")
        check_section(section, builtin_dests)
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(section.cls)
                  if hasattr(args, f.name)}
        out[section.name] = section.cls(**values)
    return out
