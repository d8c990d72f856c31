"""The start-up report of a training run, printed by rank 0 before the first iteration, in
Megatron-LM's formats where Megatron-LM prints the same thing.

What a Megatron-LM user looks for, in the order it appears:

* the ``------------------------ arguments ------------------------`` block: every argument,
  sorted case-insensitively, dot-padded to column 48 (Megatron-LM's ``_print_args``);
* ``> padded vocab (size: V) with P dummy tokens (new size: N)`` (its ``_vocab_size_with_padding``);
* the layout: world size as TP x PP x DP x CP, virtual pipeline stages, the ZeRO strategy, and
  the ranks of each process group of rank 0 (ours: Megatron prints only the sizes); the
  planner's bytes per rank of parameters, gradients and optimizer state for that strategy;
* ``> number of parameters on (tensor, pipeline) model parallel rank (t, p): N`` for every
  (t, p) (Megatron-LM prints it from each data-parallel rank 0; here rank 0 gathers and prints
  them in order), then the model's total (the tied copy of the word embeddings on the last
  pipeline stage counted once);
* documents, tokens, samples and epochs of each data split;
* ``(min, max) time across ranks (ms):`` of each start-up phase, Megatron-LM's timer block
  (``Timers.log``): initialization, model-and-optimizer-setup, checkpoint-load,
  train/valid/test-data-iterators-setup.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterable, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron.model import unwrap_model

SPLITS = ("train", "validation", "test")


def format_arguments(values: dict, title: str = "arguments") -> str:
    """Megatron-LM's argument block: one ``  name ..... value`` line per argument, the name
    padded with dots to 48 characters, lines sorted case-insensitively, between a title line and
    an end line."""
    lines = ["  {} {} {}".format(name, "." * (48 - len(name)), value)
             for name, value in values.items()]
    return "\n".join([f"------------------------ {title} ------------------------",
                      *sorted(lines, key=str.lower),
                      f"-------------------- end of {title} ---------------------"])


def format_padded_vocab(vocab_size: int, padded_vocab_size: int) -> str:
    """Megatron-LM's line about the vocabulary padding (rows added so that every
    tensor-parallel partition of the embedding has equal, aligned rows)."""
    return (f" > padded vocab (size: {vocab_size}) with {padded_vocab_size - vocab_size} dummy "
            f"tokens (new size: {padded_vocab_size})")


def print_arguments(args, vocab_size: int, padded_vocab_size: int) -> None:
    """Print the argument block and the padded-vocabulary line (the caller runs it on rank 0,
    after validation, as Megatron-LM does)."""
    print(format_arguments(vars(args)), flush=True)
    print(format_padded_vocab(vocab_size, padded_vocab_size), flush=True)


ZERO_LABELS = {"optim": "ZeRO-1", "optim_grads": "ZeRO-2", "optim_grads_params": "ZeRO-3"}


def zero_strategy(use_distributed_optimizer: bool, sharding_strategy: str) -> str:
    """The ``--data-parallel-sharding-strategy`` a run uses: ``no_shard`` without the
    distributed optimizer, ``optim`` for ``--use-distributed-optimizer`` alone (as
    :func:`megatron.training.builders.setup_model_and_optimizer` builds it)."""
    if not use_distributed_optimizer:
        return "no_shard"
    return "optim" if sharding_strategy == "no_shard" else sharding_strategy


def format_zero(groups, strategy: str) -> str:
    """What the strategy shards, over how many ranks, and the flags that chose it."""
    n = groups.dp_cp.size
    if strategy == "no_shard":
        return "none (every data-parallel rank holds the whole optimizer state)"
    flags = ("--use-distributed-optimizer" if strategy == "optim" else
             f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy}")
    what = {"optim": "optimizer state and fp32 main parameters",
            "optim_grads": "optimizer state, fp32 main parameters and gradients (each bucket "
                           "reduce-scattered in every micro-batch into the rank's shard)",
            "optim_grads_params": "optimizer state, fp32 main parameters, gradients and "
                                  "parameters (gathered one transformer layer at a time)"}
    return (f"{ZERO_LABELS[strategy]} ({flags}: {what[strategy]} sharded over the {n} data x "
            "context-parallel ranks)")


def format_layout(groups, *, use_distributed_optimizer: bool,
                  sharding_strategy: str = "no_shard") -> List[str]:
    """The parallel layout and the ranks of each of this rank's groups.

    Args:
        groups: this rank's :class:`~megatron.core.process_groups.ProcessGroupCollection`.
        use_distributed_optimizer: ``--use-distributed-optimizer`` (set by validation for
            ``--use-megatron-fsdp`` with a sharding strategy).
        sharding_strategy: ``--data-parallel-sharding-strategy`` (``optim`` ZeRO-1,
            ``optim_grads`` ZeRO-2, ``optim_grads_params`` ZeRO-3).
    """
    vp = groups.virtual_pipeline_model_parallel_size
    zero = format_zero(groups, zero_strategy(use_distributed_optimizer, sharding_strategy))
    lines = [f" > parallel layout: world size {groups.world_size} = tensor (TP) {groups.tp.size} x "
             f"pipeline (PP) {groups.pp.size} x data (DP) {groups.dp.size} x context (CP) "
             f"{groups.cp.size}; virtual pipeline (VP) stages per pipeline rank: "
             f"{vp if vp is not None else 'none'}; ZeRO: {zero}"]
    kinds = (("tensor", groups.tp), ("pipeline", groups.pp), ("data", groups.dp),
             ("context", groups.cp), ("data x context", groups.dp_cp), ("model", groups.model),
             ("embedding", groups.embedding))
    parts = [f"{name} {list(g.ranks)} (rank {g.rank})" for name, g in kinds if g.is_member]
    lines.append(f" > process groups of rank {groups.rank}: " + " | ".join(parts))
    return lines


def format_memory(model_config, *, tp: int, pp: int, dp: int, cp: int, bf16: bool,
                  use_distributed_optimizer: bool, sharding_strategy: str,
                  bucket_size: Optional[int], overlap_grad_reduce: bool) -> str:
    """The planner's bytes per rank of parameters, gradients (at their peak) and optimizer
    state for this run's layout and ZeRO strategy (:func:`megatron.planner.memory.estimate_memory`,
    the busiest pipeline stage; ``bf16``: 2-byte parameters, bf16 or fp16)."""
    from megatron.planner.memory import estimate_memory

    strategy = zero_strategy(use_distributed_optimizer, sharding_strategy)
    est = estimate_memory(model_config, tp=tp, pp=pp, dp=dp, cp=cp, seq_length=cp,
                          micro_batch_size=1, num_microbatches=1, bf16=bf16,
                          use_distributed_optimizer=use_distributed_optimizer,
                          bucket_size=bucket_size, sharding_strategy=strategy,
                          overlap_grad_reduce=overlap_grad_reduce)
    opt = est.optimizer_distributed if use_distributed_optimizer else est.optimizer
    gib = lambda n: f"{n} B ({n / 2 ** 30:.3f} GiB)"  # noqa: E731
    label = ZERO_LABELS.get(strategy, "no ZeRO")
    return (f" > memory per rank ({label}, --data-parallel-sharding-strategy {strategy}; "
            f"planner, busiest pipeline stage): parameters {gib(est.parameters)} | gradients "
            f"at their peak {gib(est.gradients)} | optimizer state {gib(opt)}")


def count_parameters(model_chunks) -> tuple[int, int, int]:
    """``(parameters, tied copies, expert parameters)`` of this rank's model chunks: every element
    of every parameter (Megatron-LM's count), those of the last stage's copy of the word embeddings
    (``word_embeddings_for_head``, tied weights with PP > 1), which the model's total counts once,
    and those of its grouped experts (modules with ``num_local_experts``: this EP rank's
    ``E_local`` experts)."""
    total = copies = experts = 0
    for chunk in model_chunks:
        module = unwrap_model(chunk)
        total += sum(p.nelement() for p in module.parameters())
        head = getattr(module, "word_embeddings_for_head", None)
        if head is not None:
            copies += sum(p.nelement() for p in head.parameters())
        experts += sum(p.nelement() for m in module.modules()
                       if getattr(m, "num_local_experts", None) is not None
                       for p in m.parameters(recurse=False))
    return total, copies, experts


def format_parameter_counts(rows: Iterable[tuple], moe=None) -> List[str]:
    """Megatron-LM's per-(tensor, pipeline)-rank parameter lines, then the total; for a
    mixture-of-experts model (``moe``: its :class:`~megatron.core.transformer.moe.moe_config.MoEConfig`) per
    (tensor, pipeline, expert) rank, with the experts' share, and the active parameters.

    Active parameters (what one token passes through): the dense ones plus top-k / E of the
    expert ones, ``dense + k / E * experts`` (per rank: its dense parameters plus k / E of the
    experts of its whole pipeline stage, every EP rank's).

    Args:
        rows: ``(tp_rank, pp_rank, parameters, tied_copies[, ep_rank, expert_parameters[,
            expert_tp_rank]])`` of every rank; duplicates of one (tp_rank, pp_rank[, ep_rank[,
            expert_tp_rank]]) (its data- and context-parallel replicas) are counted once. Under
            expert-TP each expert-TP rank holds its own slice of the experts.
    """
    rows = [tuple(r) + (0, 0, 0)[len(r) - 4:] for r in rows]
    unique = {}
    for tp_rank, pp_rank, count, copies, ep_rank, experts, etp_rank in rows:
        unique.setdefault((tp_rank, pp_rank, ep_rank, etp_rank), (count, copies, experts))

    def scaled(n):
        return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.3f} M"

    if moe is None or not moe.num_experts:
        lines = [f" > number of parameters on (tensor, pipeline) model parallel rank ({t}, {p}): "
                 f"{n}" for (t, p, _, _), (n, _, _) in sorted(unique.items())]
        total = sum(n - c for n, c, _ in unique.values())
        lines.append(f" > total number of parameters: {total} ({scaled(total)})")
        return lines
    share = moe.moe_router_topk / moe.num_experts
    # experts of a stage: every (EP rank, expert-TP rank)'s slice once (the same on every tensor
    # rank at expert-TP 1)
    stage_experts = {}
    for (t, p, e, r), (_, _, x) in unique.items():
        stage_experts.setdefault(p, {}).setdefault((e, r), x)
    split = any(r for (_, _, _, r) in unique)
    lines = []
    for (t, p, e, r), (n, _, x) in sorted(unique.items()):
        active = n - x + round(share * sum(stage_experts[p].values()))
        kind, ranks = (("expert, expert-tensor", f"{t}, {p}, {e}, {r}") if split else
                       ("expert", f"{t}, {p}, {e}"))
        lines.append(f" > number of parameters on (tensor, pipeline, {kind}) model parallel rank "
                     f"({ranks}): {n} (experts {x}; active {active})")
    dense_of = {}  # the dense parameters are the same on every EP rank of (t, p)
    for (t, p, _, _), (n, c, x) in unique.items():
        dense_of.setdefault((t, p), n - c - x)
    dense = sum(dense_of.values())
    experts = sum(sum(per_ep.values()) for per_ep in stage_experts.values())
    total, active = dense + experts, dense + round(share * experts)
    lines.append(f" > total number of parameters: {total} ({scaled(total)}; experts {experts})")
    lines.append(f" > active parameters per token: {active} ({scaled(active)}; top-"
                 f"{moe.moe_router_topk} of {moe.num_experts} experts)")
    return lines


def dataset_summary(dataset) -> dict:
    """Documents, tokens, samples and epochs of one split's dataset (a
    :class:`~megatron.data.gpt_dataset.GPTDataset` or a blend of them: the blend's own samples,
    the components' documents and tokens summed, their largest epoch count)."""
    from megatron.data.gpt_dataset import get_num_epochs

    parts = getattr(dataset, "datasets", None) or [dataset]
    documents = tokens = epochs = 0
    for part in parts:
        sizes = np.asarray(part.indexed_dataset.sizes)
        part_tokens = int(np.sum(sizes[part.documents], dtype=np.int64))
        documents += len(part.documents)
        tokens += part_tokens
        # The epochs the sample index spans (its last sample may end inside the last one).
        epochs = max(epochs, get_num_epochs(part_tokens, part.seq_length, len(part)))
    return {"documents": documents, "tokens": tokens, "samples": len(dataset), "epochs": epochs}


def format_datasets(datasets: Sequence) -> List[str]:
    """One line per split: documents, tokens, samples and epochs, or ``none``."""
    lines = []
    for name, dataset in zip(SPLITS, datasets):
        if dataset is None or len(dataset) == 0:
            lines.append(f" > {name} split: none")
            continue
        describe = getattr(dataset, "describe", None)  # --mock-data: no documents to count
        if describe is not None:
            lines.append(f" > {name} split: {describe()}")
            continue
        s = dataset_summary(dataset)
        blend = getattr(dataset, "datasets", None)
        lines.append(f" > {name} split: documents: {s['documents']} | tokens: {s['tokens']} | "
                     f"samples: {s['samples']} | epochs: {s['epochs']}"
                     + (f" | blend of {len(blend)} datasets" if blend else ""))
    return lines


def format_timings(timings: dict) -> str:
    """Megatron-LM's timer block: ``(min, max) time across ranks (ms):`` then one line per
    phase, ``{name} ....: (min, max)``.

    Args:
        timings: ``{phase: (min_ms, max_ms)}`` in the order of the phases.
    """
    lines = ["(min, max) time across ranks (ms):"]
    lines += ["    {}: ({:.2f}, {:.2f})".format((name + " ").ljust(48, "."), low, high)
              for name, (low, high) in timings.items()]
    return "\n".join(lines)


class StartupReport:
    """Times the start-up phases of :func:`megatron.training.train.pretrain` and prints the
    report's parts on rank 0 as they become known. The methods that gather (parameters,
    timings) are collectives: every rank calls them."""

    def __init__(self):
        self.seconds: dict = {}
        self.datasets: Optional[tuple] = None

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the block as phase ``name`` (seconds of this rank, summed over repeats)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def recording(self, datasets_provider: Callable) -> Callable:
        """``datasets_provider`` that also keeps the datasets it returns, for
        :meth:`print_datasets`."""
        def provider(*args, **kwargs):
            self.datasets = tuple(datasets_provider(*args, **kwargs))
            return self.datasets
        return provider

    @staticmethod
    def print_layout(groups, config) -> None:
        """The layout, groups, ZeRO strategy and the planner's memory per rank (rank 0)."""
        if groups.rank != 0:
            return
        parallel, distopt = config.parallel, config.optimizer.use_distributed_optimizer
        strategy = parallel.data_parallel_sharding_strategy
        bucket = parallel.reduce_bucket_size
        lines = format_layout(groups, use_distributed_optimizer=distopt,
                              sharding_strategy=strategy)
        lines.append(format_memory(
            config.model, tp=groups.tp.size, pp=groups.pp.size, dp=groups.dp.size,
            cp=groups.cp.size, bf16=config.model.params_dtype != torch.float32,
            use_distributed_optimizer=distopt, sharding_strategy=strategy,
            bucket_size=None if bucket is None else int(bucket),
            overlap_grad_reduce=parallel.overlap_grad_reduce))
        print("\n".join(lines), flush=True)

    @staticmethod
    def print_parameters(model_chunks, groups, moe=None) -> None:
        count, copies, experts = count_parameters(model_chunks)
        row = (groups.tp.rank, groups.pp.rank, count, copies, groups.ep.rank, experts,
               groups.expt_tp.rank)
        rows = [row]
        if groups.world_size > 1:
            rows = [None] * groups.world_size
            dist.all_gather_object(rows, row)
        if groups.rank == 0:
            print("\n".join(format_parameter_counts(rows, moe)), flush=True)

    def print_datasets(self, groups) -> None:
        if groups.rank == 0 and self.datasets is not None:
            print("\n".join(format_datasets(self.datasets)), flush=True)

    def print_timings(self, groups, device: torch.device) -> None:
        names = list(self.seconds)
        ms = torch.tensor([self.seconds[n] * 1000.0 for n in names], dtype=torch.float64,
                          device=device)
        low, high = ms.clone(), ms.clone()
        if groups.world_size > 1:
            dist.all_reduce(low, op=dist.ReduceOp.MIN)
            dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if groups.rank == 0:
            print(format_timings({n: (float(a), float(b))
                                  for n, a, b in zip(names, low.tolist(), high.tolist())}),
                  flush=True)
