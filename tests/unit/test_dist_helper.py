import torch
from tests.helpers.dist import run_distributed
def f():
    import torch.distributed as dist
    return {"t": torch.ones(3, dtype=torch.bfloat16) * dist.get_rank(), "x": [1.5, (2, "a")]}
def test_tensors_come_back():
    out = run_distributed(2, f)
    assert out[1]["t"].dtype == torch.bfloat16 and out[1]["t"].tolist() == [1.0, 1.0, 1.0]
    assert out[0]["x"] == [1.5, (2, "a")]
