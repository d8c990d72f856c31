"""Command-line arguments with Megatron-LM's flag names: :mod:`.parser` (the parser, checkpoint
args), :mod:`.help` (help texts), :mod:`.ranges` (each flag's allowed range), :mod:`.validation`
(every flag against the others and the world size), :mod:`.moe` (mixture-of-experts flags)."""

from megatron.arguments.parser import (IGNORED_FLAGS, NOT_YET_SUPPORTED, build_parser,
                                       load_args_from_checkpoint, parse_args, parser_defaults,
                                       report_ignored_flags, validate_args)

__all__ = ["IGNORED_FLAGS", "NOT_YET_SUPPORTED", "build_parser", "load_args_from_checkpoint",
           "parse_args", "parser_defaults", "report_ignored_flags", "validate_args"]
