"""Which records :func:`read_shards` takes from a :class:`ShardFiles` (the legacy format's
distributed-optimizer shards at EP > 1): dense records from the ``dense`` files only; expert
records from the ``expert`` files whose ``expert_tensor_rank`` is this rank's (a file without it
only when it is a ``dense`` one), their global ranges cut to this rank's slice and made local."""

import torch

from megatron.core.optimizer.distrib_optimizer_checkpoint import ShardFiles, read_shards


def _record(start, end, base):
    values = torch.arange(start, end, dtype=torch.float32) + base
    return {"range": [start, end], "param": values, "exp_avg": values + 0.5,
            "exp_avg_sq": values + 0.25}


def _write(tmp_path, name, params, **extra):
    path = str(tmp_path / name)
    torch.save({"params": params, "step": 3, **extra}, path)
    return path


def test_expert_records_by_expert_tensor_rank_and_global_range(tmp_path):
    # global expert tensor of 12 elements; this rank (EP rank 1 of 2) holds elements [6, 12)
    own = _write(tmp_path, "own.pt", {"0.dense": _record(0, 4, 0.0),
                                       "0.experts.w": _record(4, 9, 0.0)}, expert_tensor_rank=1)
    other_tp = _write(tmp_path, "other_tp.pt", {"0.dense": _record(0, 4, 100.0),
                                                 "0.experts.w": _record(0, 12, 100.0)},
                      expert_tensor_rank=0)
    other_ep = _write(tmp_path, "other_ep.pt", {"0.experts.w": _record(9, 12, 0.0)},
                      expert_tensor_rank=1)
    old = _write(tmp_path, "old.pt", {"0.experts.w": _record(6, 12, 200.0)})
    files = ShardFiles(dense=[own], expert=[own, other_tp, other_ep, old],
                       expert_ranges={"0.experts.w": (6, 6)}, expert_tensor_rank=1)
    pieces, step = read_shards(files)
    assert step == 3
    assert [r["range"] for r in pieces["0.dense"]] == [[0, 4]]  # not the other tensor rank's
    assert torch.equal(pieces["0.dense"][0]["param"], torch.arange(4.0))
    got = sorted(pieces["0.experts.w"], key=lambda r: r["range"])
    # own [4, 9) cut to [6, 9) -> local [0, 3); other_ep [9, 12) -> local [3, 6); other_tp and
    # the file without expert_tensor_rank (not a dense one) are skipped
    assert [r["range"] for r in got] == [[0, 3], [3, 6]]
    assert torch.equal(torch.cat([r["param"] for r in got]), torch.arange(6.0, 12.0))
    assert torch.equal(torch.cat([r["exp_avg"] for r in got]), torch.arange(6.0, 12.0) + 0.5)


def test_a_list_takes_every_record_as_saved(tmp_path):
    a = _write(tmp_path, "a.pt", {"0.w": _record(0, 2, 0.0)})
    b = _write(tmp_path, "b.pt", {"0.w": _record(2, 5, 0.0)})
    pieces, _ = read_shards([a, b])
    assert [r["range"] for r in pieces["0.w"]] == [[0, 2], [2, 5]]
