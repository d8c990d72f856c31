"""A rank that crashes while its DataLoader's workers live exits (hostile review of issue 31): the
workers ignore SIGTERM (preemption), which multiprocessing's exit hook sends to stop daemonic
children before joining them, so the crashed rank waited forever. Oracle: the child's status is
the crash's (1), its last line the crash's, within a bound far below a hang."""

import os
import subprocess
import sys
import textwrap

from tests.helpers.paths import ROOT

CHILD = textwrap.dedent("""
    import torch
    from megatron.data.samplers import build_pretraining_data_loader

    class Zeros(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return {"text": torch.zeros(3, dtype=torch.long)}

    loader = build_pretraining_data_loader(Zeros(), 0, micro_batch_size=2, data_parallel_rank=0,
                                           data_parallel_size=1, num_workers=2)
    batches = iter(loader)  # alive at exit, as in a crashed rank's traceback
    next(batches)
    raise RuntimeError("a crash while the workers live")
""")


def test_a_crash_with_live_loader_workers_exits():
    result = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == \
        "RuntimeError: a crash while the workers live", result.stderr
    assert "DataLoader worker" not in result.stderr, result.stderr
