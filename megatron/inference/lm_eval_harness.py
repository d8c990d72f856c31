"""An lm-evaluation-harness backend: score a checkpoint where it lies, at its TP x PP (x EP) layout.

Importing this module registers the model ``megatron_llama3d`` with the harness (lm-eval 0.4.x,
``lm_eval.api.registry.register_model``). The harness's own ``lm_eval`` command cannot import a
plug-in model, so run it through this module (or the ``megatron-lm-eval`` command that
``pip install -e .[eval]`` installs), with the harness's arguments::

    python -m megatron.inference.lm_eval_harness --model megatron_llama3d \\
        --model_args load=ckpt --tasks hellaswag --batch_size 8
    torchrun --nproc-per-node 4 -m megatron.inference.lm_eval_harness --model megatron_llama3d \\
        --model_args load=ckpt_tp2pp2,tokenizer_type=Llama2Tokenizer,tokenizer_model=tok.model ...

or, in Python, ``import megatron.inference.lm_eval_harness`` before ``lm_eval.simple_evaluate``.

Processes: rank 0 runs the harness and schedules; every other rank follows its steps (the
engine's plans, :meth:`~megatron.inference.engine.Engine.follow`) and exits with status 0 when
rank 0 is done, as ``tools/serve.py``'s ranks do. The harness sees one process (rank 0,
world size 1): no data-parallel splitting of the requests.

The three request types, as the harness's HF backend (``--model hf``) computes them, so that a
checkpoint and its HF export (``tools/checkpoint/convert.py --saver hf``) get the same scores:

- ``loglikelihood``: the harness's encoding of (context, continuation) (``TemplateLM``: trailing
  spaces of the context move to the continuation; an empty context is the prefix token: BOS,
  else the end-of-document id); the last ``max_length`` + 1 tokens; the sum of the
  continuation's fp32 log-softmax (over the true vocabulary) and whether each of its tokens is
  the arg-max (:meth:`Engine.score`: one full forward per request, no other request in it).
- ``loglikelihood_rolling``: the harness's disjoint rolling windows of ``max_length`` tokens
  (``get_rolling_token_windows``, context 1, the prefix token first), summed.
- ``generate_until``: the continuous-batching engine, greedy unless the task samples
  (``do_sample``/``temperature``, seeded per request), ``until`` stop strings plus the
  end-of-document text, ``max_gen_toks`` (default 256); the context left-truncated to
  ``max_length - max_gen_toks`` tokens; the text cut at the first stop string.

Tokens: text is encoded without the tokenizer's special tokens (``add_special_tokens=False``,
the HF backend's default for causal models).
"""

from __future__ import annotations

import atexit
import sys
from typing import List, Optional

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (handle_stop_sequences, normalize_gen_kwargs,
                                  postprocess_generated_text)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

NAME = "megatron_llama3d"
MODULE = "megatron.inference.lm_eval_harness"
# What ``--model_args`` may name (the harness adds batch_size, max_batch_size and device itself).
MODEL_ARGS = ("load", "tokenizer_type", "tokenizer_model", "tokenizer_name_or_path", "max_length",
              "max_gen_toks", "batch_size", "kv_cache_blocks", "block_size", "prefill_chunk",
              "distributed_backend", "exit_followers")


def encode_plain(tokenizer, text: str) -> List[int]:
    """``text``'s ids without the special tokens the tokenizer's post-processor adds (BOS)."""
    lib = getattr(tokenizer, "_tok", None)  # a ``tokenizers`` tokenizer (HuggingFaceTokenizer)
    if lib is not None:
        return lib.encode(text, add_special_tokens=False).ids
    return list(tokenizer.tokenize(text))


@register_model(NAME)
class MegatronLlama3dLM(TemplateLM):
    """The harness's model ``megatron_llama3d`` over a checkpoint folder.

    Args (``--model_args key=value,...``):
        load: the checkpoint folder (``--load``), at the layout it was saved in (the process
            count must equal its TP x PP x EP).
        tokenizer_type / tokenizer_model / tokenizer_name_or_path: as ``tools/generate.py``
            (default: the checkpoint's).
        max_length: longest sequence scored or generated (default: the model's
            ``max_position_embeddings``).
        max_gen_toks: default ``max_gen_toks`` of ``generate_until`` (256, the harness's).
        batch_size: requests decoding at once in ``generate_until`` (the harness's
            ``--batch_size``; scoring runs one forward per request).
        kv_cache_blocks / block_size / prefill_chunk: the engine's KV cache and chunking.
        distributed_backend: ``nccl`` or ``gloo`` (default: from the hardware).
        exit_followers: ranks other than 0 exit the process once rank 0 is done (default
            True; a test that runs the ranks in its own workers passes False).

    Raises:
        UsageError: a model argument this backend does not take (naming it and the accepted
            ones; the harness's own ``batch_size``, ``max_batch_size`` and ``device`` are
            taken), before anything is read; ``max_length`` beyond the model's context.
        UsageError / CheckpointError / ValueError: as ``tools/generate.py``: a wrong process
            count, checkpoint or tokenizer, before any process group exists.
    """

    def __init__(self, load: str, tokenizer_type: Optional[str] = None,
                 tokenizer_model: Optional[str] = None,
                 tokenizer_name_or_path: Optional[str] = None, max_length: Optional[int] = None,
                 max_gen_toks: int = 256, batch_size=1, max_batch_size=None,
                 kv_cache_blocks: Optional[int] = None, block_size: int = 16,
                 prefill_chunk: int = 256, distributed_backend: Optional[str] = None,
                 exit_followers: bool = True, device=None, **unknown):
        from megatron.usage_error import UsageError

        if unknown:  # a misspelt argument would otherwise run with its default
            name = sorted(unknown)[0]
            raise UsageError(f"--model_args {name}={unknown[name]}: {NAME} takes no argument "
                             f"'{name}'; it takes {', '.join(MODEL_ARGS)}")
        super().__init__()
        import argparse

        import torch

        from megatron.inference.engine import Engine
        from megatron.inference.launch import eod_of, open_checkpoint

        del max_batch_size, device  # the harness's; the device follows the backend
        flags = argparse.Namespace(tokenizer_type=tokenizer_type, tokenizer_model=tokenizer_model,
                                   tokenizer_name_or_path=tokenizer_name_or_path)
        self._opened = open_checkpoint(str(load), flags, distributed_backend=distributed_backend,
                                       tool=f"-m {MODULE} --model {NAME}", exact=True,
                                       load_flag="--model_args load=")
        torch.set_grad_enabled(False)
        opened = self._opened
        config = opened.model.config
        context = config.max_position_embeddings
        self._max_length = int(max_length or context)
        if not 1 < self._max_length <= context:
            opened.close()
            raise UsageError(f"--model_args max_length={max_length}: must be in [2, {context}] "
                             "(the model's context)")
        self._max_gen_toks = int(max_gen_toks)
        self.tokenizer_ = opened.tokenizer
        self._eod = eod_of(opened.tokenizer)
        bos = getattr(opened.tokenizer, "bos", None)
        self._prefix = bos if bos is not None else self._eod
        batch = int(batch_size) if str(batch_size).isdigit() else 1
        if kv_cache_blocks is None:  # every running request's whole context fits
            kv_cache_blocks = max(1, batch) * -(-self._max_length // int(block_size))
        self.engine = Engine(opened.model, opened.groups, num_blocks=int(kv_cache_blocks),
                             block_size=int(block_size), max_batch_size=max(1, batch),
                             max_tokens_per_step=max(int(prefill_chunk), max(1, batch)),
                             prefill_chunk=int(prefill_chunk), vocab_size=opened.vocab_size,
                             eod=self._eod, detokenize=opened.tokenizer.detokenize,
                             device=opened.device)
        self._closed = False
        if not self.engine.is_leader:
            while self.engine.follow():
                pass
            self.close()
            if exit_followers:
                sys.exit(0)
            return
        atexit.register(self.close)

    # -- lifetime -------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        return self.engine.is_leader

    def close(self) -> None:
        """Release the following ranks (rank 0) and the process groups; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.engine.is_leader:
            self.engine.shutdown()
        self._opened.close()

    # -- the harness's interface ----------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self._eod

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> List[int]:
        return encode_plain(self.tokenizer_, string)

    def tok_decode(self, tokens) -> str:
        return self.tokenizer_.detokenize(list(tokens))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        sequences, counts = [], []
        for _, context_enc, continuation_enc in requests:
            whole = (list(context_enc) + list(continuation_enc))[-(self._max_length + 1):]
            sequences.append(whole)
            counts.append(len(continuation_enc))
        results = self.engine.score(sequences, counts)
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        out = []
        for (string,) in [r.args for r in requests]:
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self._max_length, context_len=1)]
            scores = self._loglikelihood_tokens([(None, c, t) for c, t in windows])
            total = sum(s for s, _ in scores)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        from megatron.inference.engine import SamplingParams

        eos = self.tok_decode([self._eod]) if self._eod is not None else None
        prompts, params, stops = [], [], []
        for i, (context, gen_kwargs) in enumerate(r.args for r in requests):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self._max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks"))
            if max_gen >= self._max_length:
                raise ValueError(f"max_gen_toks ({max_gen}) must be below max_length "
                                 f"({self._max_length})")
            temperature = float(kwargs.get("temperature") or 0.0)
            greedy = not kwargs.get("do_sample") or temperature == 0.0
            prompts.append(self.tok_encode(context)[-(self._max_length - max_gen):])
            params.append(SamplingParams(
                max_tokens=max_gen, greedy=greedy, temperature=temperature if not greedy else 1.0,
                top_k=int(kwargs.get("top_k") or 0), top_p=float(kwargs.get("top_p") or 0.0),
                seed=i, stop=tuple(s for s in until if s)))
            stops.append(until)
        finished = self.engine.generate(prompts, params) if prompts else []
        out = []
        for (context, gen_kwargs), request, until in zip((r.args for r in requests), finished,
                                                         stops):
            text = postprocess_generated_text(self.tok_decode(request.output), until, None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out


def main(argv=None) -> int:
    """``lm_eval``'s command line with ``megatron_llama3d`` registered; a usage error of the
    model (an unknown model argument, a wrong process count, checkpoint or tokenizer) is one
    line ``lm_eval_harness: error: ...`` and status 2."""
    from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError
    from megatron.usage_error import UsageError, run_command

    def run(argv):
        import lm_eval.__main__

        if argv is not None:
            sys.argv = [sys.argv[0]] + list(argv)
        lm_eval.__main__.cli_evaluate()

    return run_command("lm_eval_harness", run, argv, usage_errors=(UsageError, CheckpointError))


if __name__ == "__main__":
    sys.exit(main())
