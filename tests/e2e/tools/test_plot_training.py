"""tools/plot_training.py on a synthetic TensorBoard run and on Megatron log lines."""

import pytest

from megatron.training.logging import format_iteration_line, format_validation_block
from tools.plot_training import main, read_log, read_tensorboard

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _log_text():
    lines = []
    for it in (1, 2, 3):
        lines.append(format_iteration_line(
            iteration=it, train_iters=3, consumed_samples=8 * it, elapsed_ms=100.0,
            tokens_per_s=1000.0 * it, learning_rate=1e-3 / it, global_batch_size=8,
            losses={"lm loss": 10.0 - it}, loss_scale=1.0, grad_norm=2.0 * it, skipped=0, nans=0,
            tflops_per_device=0.01))
    lines.append(format_validation_block("iteration 3", {"lm loss": 6.5}))
    return "\n".join(lines) + "\n"


def test_log_series_and_png(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("some start-up line\n" + _log_text())
    series = read_log(str(log))
    assert series["lm loss"] == [(1, 9.0), (2, 8.0), (3, 7.0)]
    assert series["learning-rate"][2] == (3, pytest.approx(1e-3 / 3))
    assert series["grad-norm"] == [(1, 2.0), (2, 4.0), (3, 6.0)]
    assert series["throughput"] == [(1, 1000.0), (2, 2000.0), (3, 3000.0)]
    assert series["lm loss validation"] == [(3, 6.5)]
    out = tmp_path / "log.png"
    assert main([str(log), "--output", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_tensorboard_series_and_png(tmp_path):
    from torch.utils.tensorboard import SummaryWriter
    run = tmp_path / "tb"
    writer = SummaryWriter(log_dir=str(run))
    for it in (1, 2, 3, 4):
        writer.add_scalar("lm loss", 10.0 - it, it)
        writer.add_scalar("learning-rate", 1e-3, it)
        writer.add_scalar("grad-norm", 0.5 * it, it)
        writer.add_scalar("batch-size", 8, it)
        writer.add_scalar("iteration-time", 0.5, it)
    writer.close()
    series = read_tensorboard(str(run), seq_length=256)
    assert [v for _, v in series["lm loss"]] == [9.0, 8.0, 7.0, 6.0]
    assert series["throughput"][0] == (1, pytest.approx(8 * 256 / 0.5))
    out = tmp_path / "tb.png"
    assert main([str(run), "--output", str(out), "--seq-length", "256"]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_errors_name_the_source(tmp_path, capsys):
    assert main([str(tmp_path / "missing.log")]) == 2
    assert "does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    assert main([str(empty), "--output", str(tmp_path / "x.png")]) == 2
    assert "no training scalars" in capsys.readouterr().err


def test_one_grad_norm_spike_does_not_flatten_the_axis(tmp_path):
    """The grad-norm panel is logarithmic: with one spike 1e4 times the typical norm, the
    typical norms still span a readable share of the axis (a linear axis would squeeze them
    into its bottom 0.01%); non-finite norms are left out and counted; the title names the run
    and the iterations."""
    import math

    from tools.plot_training import plot, plot_title

    norms = [1.0 + 0.1 * (i % 5) for i in range(1, 101)]
    norms[49] = 1e4  # the spike, at iteration 50
    norms[79] = float("inf")  # an fp16 overflow, at iteration 80
    series = {"lm loss": [(i, 10.0 - 0.05 * i) for i in range(1, 101)],
              "grad-norm": list(zip(range(1, 101), norms))}
    title = plot_title(series, "19 M parameters, TP=2 x PP=2", "llama_cpu_demo/tensorboard")
    out = tmp_path / "spike.png"
    fig = plot(series, str(out), title=title)
    assert out.read_bytes()[:8] == PNG_MAGIC
    ax = fig.axes[2]
    assert ax.get_ylabel() == "grad norm" and ax.get_yscale() == "log"
    low, high = ax.get_ylim()
    assert low <= 1.0 and high >= 1e4  # both the typical norms and the spike are on the axis
    share = (math.log(1.4) - math.log(1.0)) / (math.log(high) - math.log(low))
    assert share > 0.02  # typical norms 1.0 .. 1.4: on a linear axis 4e-5 of its height
    assert ax.get_legend().get_texts()[0].get_text() == "grad-norm (1 non-finite or zero left out)"
    assert fig._suptitle.get_text() == ("19 M parameters, TP=2 x PP=2, iterations 1-100\n"
                                        "llama_cpu_demo/tensorboard")


def test_log_title_reads_the_start_up_report(tmp_path):
    from tools.plot_training import describe_log

    log = tmp_path / "train.log"
    log.write_text(" > parallel layout: world size 8 = tensor (TP) 2 x pipeline (PP) 2 x data "
                   "(DP) 2 x context (CP) 1; virtual ...\n > total number of parameters: "
                   "19021056 (19.021 M)\n" + _log_text())
    assert describe_log(str(log)) == "19.021 M parameters, TP=2 x PP=2 x DP=2"
    out = tmp_path / "t.png"
    assert main([str(log), "--output", str(out)]) == 0
