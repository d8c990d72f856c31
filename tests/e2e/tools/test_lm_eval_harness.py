"""The lm-evaluation-harness backend ``megatron_llama3d`` against the harness's own HF backend.

A random LLaMA (tests.helpers.convert.make_hf) with a byte-pair tokenizer trained in the test is
converted to our format at PP=2 and TP=2 x PP=2 (slow) and back to HF (``tools/checkpoint/convert.py``). Three
tasks, one per request type (multiple choice: ``loglikelihood``; ``loglikelihood_rolling``;
``generate_until``), are task YAMLs over a JSON-lines file written by the test: the harness's
built-in tasks fetch their data from the Hub when they run (none ships its documents in the
package), and the test runs without network. Oracle: ``lm_eval --model hf`` on the HF export,
in this process: the same scores (accuracies and exact match equal, perplexities to 1e-5), every
document's log-likelihoods to fp32 rounding with the same arg-max flags, the same generated text.
"""

import os
import subprocess
import sys

import pytest

from tests.helpers.dist import run_distributed

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # the HF backend's

from tests.helpers.lm_eval_tasks import TASKS, make_tasks, make_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _offline(cache: str) -> None:
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=cache,
                      TOKENIZERS_PARALLELISM="false")


def _plain(out: dict) -> dict:
    """Scores and per-document answers as plain Python values."""
    results = {task: {k: (float(v) if isinstance(v, (int, float)) or hasattr(v, "item") else v)
                      for k, v in out["results"][task].items() if "," in k and "stderr" not in k}
               for task in TASKS}
    answers = {task: [[list(r) if isinstance(r, tuple) else r for r in s["filtered_resps"]]
                      for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])]
               for task in TASKS}
    return {"results": results, "answers": answers}


def _ours(load: str, tokenizer_dir: str, tasks: str, cache: str):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from megatron.inference.lm_eval_harness import MegatronLlama3dLM

    _offline(cache)
    lm = MegatronLlama3dLM(load=load, tokenizer_type="HuggingFaceTokenizer",
                           tokenizer_name_or_path=tokenizer_dir, batch_size=4,
                           exit_followers=False)
    if not lm.is_leader:
        return None
    try:
        out = lm_eval.simple_evaluate(model=lm, tasks=list(TASKS), bootstrap_iters=0,
                                      task_manager=TaskManager(include_path=tasks))
    finally:
        lm.close()
    return _plain(out)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.helpers.convert import convert, make_hf

    root = tmp_path_factory.mktemp("lm_eval")
    hf, export, tasks = root / "hf", root / "export", root / "tasks"
    for folder in (hf, tasks):
        folder.mkdir()
    make_hf(str(hf))
    os.remove(hf / "tokenizer.model")  # make_hf's stand-in: the trained tokenizer instead
    make_tokenizer(str(hf))
    for name, tp, pp in (("pp2", 1, 2), ("tp2pp2", 2, 2)):
        convert("--loader", "hf", "--saver", "megatron", "--load-dir", hf, "--save-dir",
                root / name, "--target-tensor-parallel-size", tp,
                "--target-pipeline-parallel-size", pp)
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", root / "tp2pp2", "--save-dir",
            export, "--tokenizer-dir", hf)
    return {"root": root, "hf": str(hf), "export": str(export), "ckpt": str(root / "tp2pp2"),
            "tasks": make_tasks(str(tasks)), "cache": str(root / "datasets")}


@pytest.fixture(scope="module")
def reference(model):
    """``lm_eval --model hf`` on the HF export, in this process."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    _offline(model["cache"])
    return _plain(lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={model['export']},dtype=float32", device="cpu",
        tasks=list(TASKS), batch_size=1, bootstrap_iters=0,
        task_manager=TaskManager(include_path=model["tasks"])))


@pytest.mark.slow  # the HF backend's run and ours: 6 to 12 minutes on a loaded 2-core machine
@pytest.mark.parametrize("layout", ["pp2", "tp2pp2"])
def test_scores_equal_the_hf_backend_on_the_export(model, reference, layout):
    world = 2 if layout == "pp2" else 4
    out = run_distributed(world, _ours, str(model["root"] / layout), model["hf"], model["tasks"],
                          model["cache"], timeout=900)
    assert out[1:] == [None] * (world - 1)
    ours = out[0]
    for task in TASKS:
        want, got = reference["results"][task], ours["results"][task]
        assert want.keys() == got.keys() and want, task
        for metric, value in want.items():
            if "perplexity" in metric or "bits_per_byte" in metric:
                assert got[metric] == pytest.approx(value, rel=1e-5), (task, metric)
            else:
                assert got[metric] == value, (task, metric)
    assert len(reference["answers"]["tiny_choice"]) == 10
    for want, got in zip(reference["answers"]["tiny_choice"], ours["answers"]["tiny_choice"]):
        assert [g for _, g in got] == [g for _, g in want]  # arg-max flags
        assert [s for s, _ in got] == pytest.approx([s for s, _ in want], abs=1e-4)
    for want, got in zip(reference["answers"]["tiny_rolling"], ours["answers"]["tiny_rolling"]):
        assert got == pytest.approx(want, abs=1e-4)
    # the generations (the tiny random model's text): the same strings, stop strings cut
    assert ours["answers"]["tiny_until"] == reference["answers"]["tiny_until"]
    assert any(a[0] for a in ours["answers"]["tiny_until"])


@pytest.mark.slow  # a fresh interpreter importing the harness: minutes on a loaded machine
def test_the_command_line_runs_the_registered_model(model, tmp_path):
    """``python -m megatron.inference.lm_eval_harness --model megatron_llama3d ...`` (the
    harness's own command line with the model registered), one process on a TP=1 checkpoint."""
    from tests.helpers.convert import convert

    tp1 = tmp_path / "tp1"
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", model["hf"], "--save-dir", tp1)
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_CACHE=model["cache"], PYTHONPATH=ROOT)
    run = subprocess.run(
        [sys.executable, "-m", "megatron.inference.lm_eval_harness", "--model", "megatron_llama3d",
         "--model_args", f"load={tp1},distributed_backend=gloo", "--tasks", "tiny_until",
         "--include_path", model["tasks"], "--batch_size", "4", "--output_path",
         str(tmp_path / "out")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "megatron_llama3d" in run.stdout and "tiny_until" in run.stdout
    assert "exact_match" in run.stdout


def test_a_wrong_process_count_is_one_line_before_any_group(model):
    import torch.distributed as dist

    from megatron.inference.lm_eval_harness import MegatronLlama3dLM
    from megatron.usage_error import UsageError

    with pytest.raises(UsageError) as caught:
        MegatronLlama3dLM(load=model["ckpt"])  # a TP=2 x PP=2 checkpoint in one process
    message = str(caught.value)
    assert "\n" not in message and "needs 4 processes; this run has 1" in message
    assert (f"torchrun --nproc-per-node 4 -m megatron.inference.lm_eval_harness --model "
            f"megatron_llama3d --model_args load={model['ckpt']}") in message
    assert not dist.is_initialized()


def test_an_unknown_model_argument_is_one_line_naming_the_accepted_ones(tmp_path, monkeypatch,
                                                                        capsys):
    """``--model_args`` the backend does not take were dropped silently (a misspelt
    ``max_lenght=64`` ran at the full context); now one line, before anything is read."""
    import inspect

    import torch.distributed as dist

    from megatron.inference import lm_eval_harness
    from megatron.inference.lm_eval_harness import MODEL_ARGS, MegatronLlama3dLM
    from megatron.usage_error import UsageError

    taken = set(inspect.signature(MegatronLlama3dLM.__init__).parameters) - {"self", "unknown"}
    assert set(MODEL_ARGS) | {"max_batch_size", "device"} == taken
    missing = str(tmp_path / "none")
    with pytest.raises(UsageError) as caught:  # the harness's own path from --model_args
        MegatronLlama3dLM.create_from_arg_string(f"load={missing},max_lenght=64",
                                                 {"batch_size": 4, "device": None})
    message = str(caught.value)
    assert message == ("--model_args max_lenght=64: megatron_llama3d takes no argument "
                       f"'max_lenght'; it takes {', '.join(MODEL_ARGS)}")
    assert not dist.is_initialized()

    def cli_evaluate():  # the harness's command line up to the model's construction
        MegatronLlama3dLM.create_from_arg_string(f"load={missing},foo=1", {"batch_size": 1})

    import lm_eval.__main__

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", cli_evaluate)
    assert lm_eval_harness.main(["--model", "megatron_llama3d"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"lm_eval_harness: error: --model_args foo=1: megatron_llama3d takes no "
                     f"argument 'foo'; it takes {', '.join(MODEL_ARGS)}"]
