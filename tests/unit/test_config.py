"""megatron.config: one frozen carrier built from the validated flags; every flag lands in a field
(or is listed with its reason), every field names its flag (or says how it is derived), the
checkpoint's args keep Megatron's names and values, and nothing below pretrain() reads the
namespace."""

import ast
import dataclasses
import inspect
import os
import re

import pytest

from megatron import config as cfg
from megatron.arguments import build_parser, parser_defaults
from megatron.arguments.validation import IGNORED_FLAGS
from megatron.config.saved_args import plain
from tests.helpers.arguments import base_argv, check
from tests.helpers.paths import ROOT

SECTIONS = [f.type for f in dataclasses.fields(cfg.Config)]
CLASSES = [cfg.ModelConfig, cfg.ParallelConfig, cfg.OptimizerConfig, cfg.SchedulerConfig,
           cfg.TrainingConfig, cfg.DataConfig, cfg.CheckpointConfig, cfg.LoggingConfig,
           cfg.MoEConfig]


def _field_docs(cls):
    """``{field: docstring}`` of a dataclass: the string literal under each field (torchtitan's
    attribute docstrings)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and \
                isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = after.value.value
    return docs


def _option_strings():
    """``{dest: [--flag, ...]}`` of the parser."""
    out = {}
    for action in build_parser()._actions:
        out.setdefault(action.dest, []).extend(action.option_strings)
    return out


def test_every_flag_lands_in_a_field_and_every_field_names_its_flag():
    assert [c.__name__ for c in CLASSES] == SECTIONS  # every section is checked
    dests, flags = set(parser_defaults()), _option_strings()
    fields, derived = set(), set()
    for cls in CLASSES:
        docs = _field_docs(cls)
        for f in dataclasses.fields(cls):
            doc = docs.get(f.name)
            assert doc, f"{cls.__name__}.{f.name} has no docstring"
            fields.add(f.name)
            if doc.startswith("Derived"):
                derived.add(f.name)
                continue
            assert f.name in dests, f"{cls.__name__}.{f.name} is no flag's dest and not Derived"
            assert any(flag in doc for flag in flags[f.name]), \
                f"{cls.__name__}.{f.name}: the docstring names none of {flags[f.name]}"
            assert re.search(r"[Dd]efault|Required", doc), \
                f"{cls.__name__}.{f.name}: the docstring gives no default"
    unlisted = sorted(d for d in dests if d not in fields and d not in cfg.FLAGS_NOT_IN_CONFIG)
    assert unlisted == [], "flags in no field and not listed in FLAGS_NOT_IN_CONFIG"
    assert sorted(set(cfg.FLAGS_NOT_IN_CONFIG) & fields) == []  # a listed flag has no field
    assert sorted(set(cfg.FLAGS_NOT_IN_CONFIG) - dests) == []   # and is a flag
    assert all(len(reason) > 10 for reason in cfg.FLAGS_NOT_IN_CONFIG.values())
    # Accepted-and-ignored flags are listed, except the one recorded in the checkpoints' args.
    assert sorted(d for d in IGNORED_FLAGS if d in fields) == ["job_name"]
    assert derived == {"padded_vocab_size", "true_vocab_size", "rope_scaling", "params_dtype",
                       "world_size",
                       "data_parallel_size", "num_microbatches", "num_iterations",
                       "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps"}


def test_derived_values_are_computed_once_in_the_builder(files):
    argv = [a for a in base_argv(files) if a not in ("--train-iters", "10")]
    args = check(argv + ["--tensor-model-parallel-size", "2", "--train-samples", "200",
                         "--rampup-batch-size", "4", "4", "16", "--lr-warmup-samples", "8",
                         "--use-rope-scaling", "--rope-scaling-factor", "4"], world_size=4)
    c = cfg.build_config(args, vocab_size=100)
    assert c.model.padded_vocab_size == 256  # 100 rounded up to 128 x TP
    assert (c.parallel.world_size, c.parallel.data_parallel_size) == (4, 2)
    assert c.training.num_microbatches == 8 // (2 * 2)
    # Ramp-up 4 4 16 at micro-batch 2 x DP 2: batches 4, 4, 4, 4, 8 consume 24 (> 16); then
    # (200 - 24) // 8 = 22 iterations of the full batch.
    assert c.training.num_iterations == 5 + 22 and c.training.rampup_batch_size == (4, 4, 16)
    assert (c.scheduler.lr_warmup_steps, c.scheduler.lr_decay_steps,
            c.scheduler.wd_incr_steps) == (8, 200, 200)
    assert c.model.rope_scaling["factor"] == 4.0 and c.data.data_path == (files["prefix"],)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.training.micro_batch_size = 4
    with pytest.raises(ValueError, match="--seed"):
        dataclasses.replace(c, training=dataclasses.replace(c.training, seed=1))


@pytest.mark.parametrize("extra", [[], ["--use-rope-scaling", "--rope-scaling-factor", "4",
                                        "--bf16", "--recompute-activations"]],
                         ids=["plain", "rope-scaling-bf16"])
def test_checkpoint_args_keep_megatron_names_and_values(files, extra):
    """The checkpoint's ``args`` hold every value the namespace held under the same name (what
    --use-checkpoint-args, our converters and Megatron's tools read), plus the derived values;
    only flags without a field that validation does not fold into one are left out."""
    args = check(base_argv(files) + ["--pipeline-model-parallel-size", "2"] + extra, world_size=4)
    saved = cfg.checkpoint_args(cfg.build_config(args, vocab_size=32000))
    left_out = set(cfg.FLAGS_NOT_IN_CONFIG) - {
        "normalization", "position_embedding_type", "swiglu", "group_query_attention",
        "use_rope_scaling", "rope_scaling_factor", "rope_scaling_low_freq_factor",
        "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings"}
    for name, value in vars(args).items():
        if name not in left_out:
            assert name in saved and saved[name] == plain(value), (name, saved.get(name), value)
    assert saved["padded_vocab_size"] == 32000 and saved["data_parallel_size"] == 2
    assert "params_dtype" not in saved  # Megatron stores a torch.dtype there
    assert all(isinstance(v, (type(None), bool, int, float, str, list, dict))
               for v in saved.values())


PACKAGES_BELOW_PRETRAIN = ["megatron/training", "megatron/core", "megatron/model",
                           "megatron/data", "megatron/inference", "megatron/checkpointing/__init__.py",
                           "megatron/checkpointing/legacy.py",
                           "megatron/checkpointing/torch_dist.py"]


def test_nothing_below_pretrain_reads_the_namespace():
    """``grep -nw "args\\." megatron/training megatron/core megatron/model megatron/data
    megatron/inference megatron/checkpointing/{__init__,legacy,torch_dist}.py`` finds nothing (``kwargs.get`` is no read of it)."""
    namespace_read = re.compile(r"(?<![\w])args\.")
    found = []
    for entry in PACKAGES_BELOW_PRETRAIN:
        path = os.path.join(ROOT, entry)
        files = [path] if path.endswith(".py") else [
            os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".py")]
        for name in files:
            with open(name, encoding="utf-8") as f:
                found += [f"{name}:{i}" for i, line in enumerate(f, 1) if namespace_read.search(line)]
    assert found == []
