"""Help texts of the flags of :mod:`megatron.arguments` declared without one, and every flag's
default shown in its help.

Kept apart from the declarations so the parser's groups stay readable; :func:`apply_help` fills
``help`` of each action from :data:`HELP` by its first option string, and
``tests/unit/test_arguments_help.py`` checks that no flag is left without help. Texts follow
Megatron-LM's meaning of each flag; where a flag has no effect here
(:data:`megatron.arguments.validation.IGNORED_FLAGS`) the text says so.
"""

from __future__ import annotations

import argparse

# The flags validation requires (megatron.arguments.validation._validate_required): their help
# says "(required)" instead of a default.
REQUIRED = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
            "--micro-batch-size", "--lr", "--tokenizer-type")

HELP = {
    # network size
    "--hidden-size": "transformer hidden width h",
    "--num-attention-heads": "query attention heads (h must divide by them)",
    "--group-query-attention": "grouped-query attention: --num-query-groups key/value heads",
    "--norm-epsilon": "RMSNorm epsilon (LLaMA-2: 1e-5, Llama 3: 1e-5 or 1e-6)",
    "--use-rotary-position-embeddings": "Megatron-LLaMA's spelling of "
                                        "--position-embedding-type rope",
    "--disable-bias-linear": "no biases in the linear layers (LLaMA has none)",
    "--untie-embeddings-and-output-weights": "a separate output layer instead of the word "
                                             "embeddings' transpose (LLaMA: untied)",
    "--init-method-std": "standard deviation of the normal initial weights (output projections "
                         "scaled by 1/sqrt(2 x layers), as Megatron)",
    # regularization
    "--hidden-dropout": "dropout after attention and MLP (LLaMA pretraining: 0)",
    "--attention-dropout": "dropout of the attention probabilities",
    "--weight-decay": "AdamW's decoupled weight decay (not on norms and biases)",
    "--adam-beta1": "Adam beta1",
    "--adam-beta2": "Adam beta2 (LLaMA: 0.95)",
    "--adam-eps": "Adam epsilon",
    # training
    "--rampup-batch-size": "grow the global batch from START by INCR over SAMPLES consumed "
                           "samples (needs --train-samples)",
    "--train-iters": "iterations to train (or --train-samples)",
    "--train-samples": "samples to train (or --train-iters); the lr schedule then counts samples",
    "--exit-duration-in-mins": "stop (saving first, with --save) after this many minutes of "
                               "wall-clock time",
    "--exit-signal-handler": "on SIGTERM save a checkpoint after the current iteration and stop "
                             "(needs --save)",
    "--seed": "seed of the initial weights, dropout and data shuffles",
    "--recompute-granularity": "activation recompute: full layers, or the selective parts "
                               "(--recompute-modules)",
    "--recompute-num-layers": "full recompute: layers per group (uniform) or per stage (block)",
    "--eod-mask-loss": "no loss on end-of-document tokens",
    "--reset-position-ids": "position ids restart after each end-of-document token",
    "--reset-attention-mask": "no attention across end-of-document tokens (document masks)",
    # kernels (no effect here)
    "--use-flash-attn": "no effect here: attention runs through torch's "
                        "scaled_dot_product_attention, which picks a flash kernel where it applies",
    "--no-masked-softmax-fusion": "no effect here: no fused softmax kernel (SDPA)",
    "--no-bias-dropout-fusion": "no effect here: no fused bias-dropout kernel",
    "--no-bias-swiglu-fusion": "no effect here: no fused bias-SwiGLU kernel",
    "--no-rope-fusion": "no effect here: no fused RoPE kernel",
    "--attention-softmax-in-fp32": "no effect here: SDPA accumulates the softmax in fp32 already",
    "--use-cpu-initialization": "no effect here: the initial weights are always drawn on the CPU "
                                "(layout-independent initialisation)",
    # learning rate
    "--min-lr": "learning rate at the end of the decay",
    "--lr-decay-style": "shape of the decay from --lr to --min-lr after the warmup",
    "--lr-warmup-iters": "iterations of linear warmup from 0 to --lr",
    "--lr-warmup-samples": "samples of linear warmup (sample-based runs)",
    "--use-checkpoint-opt_param-scheduler": "take the schedule from the checkpoint, not from the "
                                            "flags",
    # mixed precision
    "--fp16": "fp16 model with fp32 main params and grads and a dynamic loss scale",
    "--initial-loss-scale": "fp16: the dynamic loss scale to start from",
    "--min-loss-scale": "fp16: the dynamic loss scale never goes below this",
    "--loss-scale-window": "fp16: iterations without overflow before the scale doubles",
    "--hysteresis": "fp16: overflows tolerated before the scale halves",
    # distributed
    "--tensor-model-parallel-size": "TP: ranks sharing each layer's weights (Megatron's column/"
                                    "row split)",
    "--pipeline-model-parallel-size": "PP: pipeline stages (1F1B schedule)",
    "--num-layers-per-virtual-pipeline-stage": "interleaved schedule: layers per model chunk "
                                               "(or --virtual-pipeline-model-parallel-size)",
    "--virtual-pipeline-model-parallel-size": "interleaved schedule: model chunks per pipeline "
                                              "rank",
    "--use-distributed-optimizer": "shard the optimizer state and fp32 main params over the "
                                   "data-parallel ranks (ZeRO-1)",
    "--overlapped-distributed-optimizer": "Megatron-LLaMA's flag: --use-distributed-optimizer "
                                          "--overlap-grad-reduce --overlap-param-gather",
    "--overlap-grad-reduce": "reduce gradient buckets during the backward pass",
    "--overlap-param-gather": "all-gather the updated parameters during the next forward (needs "
                              "--use-distributed-optimizer)",
    "--distributed-checkpointing": "no effect here: with --use-distributed-optimizer each "
                                   "data-parallel rank always writes its own optimizer shard",
    # checkpointing
    "--no-save-optim": "checkpoints without the optimizer state",
    "--no-save-rng": "checkpoints without the RNG states",
    "--no-load-optim": "load the weights and scheduler but not the optimizer state",
    "--no-load-rng": "do not restore the RNG states of the checkpoint",
    "--keep-last-checkpoints": "delete older checkpoints, keeping this many (needs --save)",
    # data
    "--train-data-path": "training data: PREFIX or WEIGHT PREFIX ... (instead of --data-path)",
    "--valid-data-path": "validation data: PREFIX or WEIGHT PREFIX ...",
    "--test-data-path": "test data: PREFIX or WEIGHT PREFIX ...",
    "--dataloader-type": "single: the samples in the order of the dataset's shuffled index; "
                         "cyclic: freshly shuffled epochs over them, endlessly (Megatron's)",
    "--mock-data": "synthetic tokens instead of --data-path (smoke tests; e.g. with --tokenizer-type "
                   "NullTokenizer --vocab-size N)",
    # logging and evaluation
    "--log-interval": "iterations between log lines (the first iteration is always logged)",
    "--log-num-zeros-in-grad": "count the zero gradient elements (a host read per step)",
    "--eval-interval": "iterations between evaluations on the validation split",
    "--eval-iters": "iterations (global batches) per evaluation; 0 = no evaluation",
    "--tensorboard-dir": "write TensorBoard scalars here (Megatron's tags)",
    "--tensorboard-queue-size": "TensorBoard events buffered before a flush",
    "--log-timers-to-tensorboard": "no effect here: the iteration-time scalar is always written",
    "--log-batch-size-to-tensorboard": "no effect here: the batch-size scalar is always written",
    "--log-validation-ppl-to-tensorboard": "no effect here: the validation perplexity is always "
                                           "written",
    "--job-name": "a name recorded in the checkpoints' saved arguments (no other effect here)",
}


def default_text(action, parser_default) -> str:
    """`` (default: X)`` for a flag's help: for a flag without a value (``store_true``,
    ``store_false``, ``store_const``) ``on`` when not giving it already has its effect, else
    ``off``; for others the value, ``none`` when unset. Empty when the help says it already."""
    text = action.help or ""
    if action.option_strings[0] in REQUIRED:
        return " (required)"
    if "default" in text or action.default is argparse.SUPPRESS:
        return ""
    if action.nargs == 0:
        shown = "on" if parser_default == action.const else "off"
    elif parser_default is None:
        shown = "none"
    elif isinstance(parser_default, (list, tuple)):
        shown = " ".join(map(str, parser_default))
    else:
        shown = str(parser_default)
    return " (default: {})".format(shown.replace("%", "%%"))


def apply_help(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give every flag of ``parser`` its help from :data:`HELP` where it has none (by its first
    option string), and end every flag's help with its default (:func:`default_text`); returns
    the parser."""
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        if not action.help:
            action.help = HELP.get(action.option_strings[0], action.help)
        action.help = (action.help or "") + default_text(action, parser.get_default(action.dest))
    return parser
