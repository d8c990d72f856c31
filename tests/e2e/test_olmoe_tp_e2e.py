"""End to end: pretrain_llama.py with OLMoE's attention (``--qk-layernorm
--qk-layernorm-full-width``: q/k RMSNorm over the whole projection width, its mean square
all-reduced across the tensor ranks, its weights sharded with the heads) and its router
(top-2, ``--moe-router-pre-softmax``) on tests/e2e/test_moe_e2e.py's MoE model: TP=2 with
sequence parallelism (expert-TP 1) gives one process's losses, grad norms and validation losses
(rtol 1e-6, fp32, every iteration clipped, 20 iterations; global batch 4: 2 micro-batches, the
fewest that accumulate gradients, since each micro-batch costs the TP pair its sequence-parallel
all-gathers and reduce-scatters: the TP=2 run at 4 took 13 s)."""

from tests.e2e.test_moe_layouts_e2e import SP, _argv
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import assert_close_history, layout_args, run_many

OLMOE = ["--qk-layernorm", "--qk-layernorm-full-width", "--moe-router-pre-softmax"]
GLOBAL_BATCH_4 = ["--global-batch-size", "4"]


def test_olmoe_tp2_with_sequence_parallelism_matches_one_process(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("olmoe_tp_cache"))
    one = run_distributed(1, run_many, [
        ("olmoe", _argv(data_prefix, cache, *OLMOE, *GLOBAL_BATCH_4)),
        ("per head", _argv(data_prefix, cache, "--qk-layernorm", "--moe-router-pre-softmax",
                           *GLOBAL_BATCH_4))],
        timeout=900)[0]
    # the full-width norm changes the run (the comparison below has teeth)
    assert one["olmoe"]["lm loss"][1:] != one["per head"]["lm loss"][1:]
    got = run_distributed(2, run_many, [
        ("tp2 sp", _argv(data_prefix, cache, *OLMOE, *GLOBAL_BATCH_4, *layout_args(2, 1), *SP))],
        timeout=900)[-1]
    assert_close_history(got["tp2 sp"], one["olmoe"], "OLMoE TP=2 with SP")
