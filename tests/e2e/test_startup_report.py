"""The start-up report of pretrain_llama.main(), parsed line by line: Megatron-LM's argument block,
padded vocabulary and per-(tensor, pipeline)-rank parameter lines, the layout and its groups, the
dataset sizes, the phase timings, and the first iteration logged at iteration 1."""

import contextlib
import io
import re

from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import e2e_argv

H, HEADS, GROUPS, FFN, LAYERS = 32, 4, 2, 64, 4
PADDED = 144  # NullTokenizer's 128 ids, --make-vocab-size-divisible-by 48 -> 144 (16 dummy rows)


def _layer_params():
    d = H // HEADS
    qkv, dense = (HEADS * d + 2 * GROUPS * d) * H, HEADS * d * H
    return 2 * H + qkv + dense + 3 * FFN * H  # two RMSNorms, attention, gate/up and down


def _main(argv):
    import pretrain_llama

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pretrain_llama.main(argv)
    return out.getvalue()


def test_startup_report_lines(data_prefix, tmp_path):
    argv = e2e_argv(data_prefix, str(tmp_path / "cache"), "--pipeline-model-parallel-size", "2",
                    "--make-vocab-size-divisible-by", "48", "--log-interval", "4",
                    "--train-iters", "5")
    logs = run_distributed(2, _main, argv, timeout=600)
    log = logs[0]

    # Megatron-LM's argument block: every argument once, sorted, dots to column 48.
    block = log.split("------------------------ arguments ------------------------\n")[1]
    block = block.split("\n-------------------- end of arguments ---------------------")[0]
    rows = [re.fullmatch(r"  (\S+) (\.+) (.*)", line) for line in block.splitlines()]
    assert all(rows), block
    names = [r.group(1) for r in rows]
    assert names == sorted(names, key=str.lower)
    assert all(len(r.group(1)) + len(r.group(2)) == 48 for r in rows)
    values = {r.group(1): r.group(3) for r in rows}
    assert values["pipeline_model_parallel_size"] == "2" and values["hidden_size"] == str(H)
    assert values["data_parallel_size"] == "1" and values["micro_batch_size"] == "2"

    assert " > padded vocab (size: 128) with 16 dummy tokens (new size: 144)" in log

    layout = re.search(r" > parallel layout: world size (\d+) = tensor \(TP\) (\d+) x pipeline "
                       r"\(PP\) (\d+) x data \(DP\) (\d+) x context \(CP\) (\d+); virtual "
                       r"pipeline \(VP\) stages per pipeline rank: (\w+); ZeRO: none", log)
    assert layout.groups() == ("2", "1", "2", "1", "1", "none")
    groups = re.search(r" > process groups of rank 0: (.*)", log).group(1)
    assert "tensor [0] (rank 0)" in groups and "pipeline [0, 1] (rank 0)" in groups
    assert "data [0] (rank 0)" in groups and "embedding [0, 1] (rank 0)" in groups

    counts = {(int(t), int(p)): int(n) for t, p, n in re.findall(
        r" > number of parameters on \(tensor, pipeline\) model parallel rank \((\d+), (\d+)\): "
        r"(\d+)", log)}
    embedding = PADDED * H
    # Stage 0: embedding and layers 1-2; stage 1: layers 3-4, the final norm, the tied copy.
    assert counts == {(0, 0): embedding + 2 * _layer_params(),
                      (0, 1): 2 * _layer_params() + H + embedding}
    total = int(re.search(r" > total number of parameters: (\d+)", log).group(1))
    assert total == embedding + LAYERS * _layer_params() + H  # the tied copy counted once

    # 200 documents of 3..40 tokens + EOD split 90:10:0; the samples the run asks for.
    splits = {name: tuple(map(int, m)) for name, *m in re.findall(
        r" > (\w+) split: documents: (\d+) \| tokens: (\d+) \| samples: (\d+) \| epochs: (\d+)",
        log)}
    assert splits["train"][0] == 180 and splits["validation"][0] == 20
    assert " > test split: none" in log
    for documents, tokens, samples, epochs in splits.values():
        assert tokens > 3 * documents and samples >= 1 and epochs >= 1
        assert samples == (epochs * tokens - 1) // 16  # the sample index spans whole epochs
    assert splits["train"][2] >= 5 * 8  # 5 iterations of 8 samples

    after = log.split("(min, max) time across ranks (ms):\n")[1].splitlines()
    phases = [re.fullmatch(r"    (\S+) \.+: \(([0-9.]+), ([0-9.]+)\)", line)
              for line in after[:3]]
    assert [p.group(1) for p in phases] == [  # no --load: no checkpoint-load phase
        "initialization", "model-and-optimizer-setup", "train/valid/test-data-iterators-setup"]
    assert all(0 < float(p.group(2)) <= float(p.group(3)) for p in phases)
    assert not after[3].startswith("    ")

    # The report comes before training; the last rank logs iterations 1 and 4 (--log-interval 4).
    assert log.index("(min, max) time across ranks") < log.index(" training from iteration 0")
    logged = [int(i) for i in re.findall(r" iteration +(\d+)/ +5 \|", logs[1])]
    assert logged == [1, 4]
