"""Boxes of global tensors: whole local tensors and flat ranges of them (every range of small
shapes, fused row blocks, partitions along either dimension), and the choice of writers."""

import itertools

import pytest
import torch

from megatron.core.dist_checkpointing.mapping import ParamSharding, ShardedTensor, balance_writers


def _assemble(boxes, shapes):
    """Global tensors (NaN where no box wrote) from boxes; each element written at most once."""
    out = {k: torch.full(s, float("nan")) for k, s in shapes.items()}
    for b in boxes:
        assert tuple(b.global_shape) == shapes[b.key]
        region = out[b.key][tuple(slice(o, o + n) for o, n in zip(b.global_offset, b.data.shape))]
        assert torch.isnan(region).all(), f"{b.key}: element written twice"
        region.copy_(b.data)
    return out


def _shardings(tp):
    """A fused [q; k; v] weight (rows 4, 2, 2 per rank), a row-parallel weight, a norm."""
    return [("fused", [ParamSharding.row_blocks([("q", 4), ("k", 2), ("v", 2)], (8, 3), r, tp)
                       for r in range(tp)]),
            ("row", [ParamSharding.partition("w", (5, 2), 1, r, tp) for r in range(tp)]),
            ("norm", [ParamSharding.partition("n", (7,), None, r, tp, replica_id=int(r > 0))
                      for r in range(tp)])]


def _globals(kind, tp, rng):
    if kind == "fused":
        return {"p.q": torch.randn(4 * tp, 3, generator=rng),
                "p.k": torch.randn(2 * tp, 3, generator=rng),
                "p.v": torch.randn(2 * tp, 3, generator=rng)}
    if kind == "row":
        return {"p.w": torch.randn(5, 2 * tp, generator=rng)}
    return {"p.n": torch.randn(7, generator=rng)}


def _local(kind, full, rank, tp):
    if kind == "fused":
        return torch.cat([full["p.q"].chunk(tp)[rank], full["p.k"].chunk(tp)[rank],
                          full["p.v"].chunk(tp)[rank]])
    if kind == "row":
        return full["p.w"].chunk(tp, dim=1)[rank].contiguous()
    return full["p.n"].clone()


@pytest.mark.parametrize("tp", [1, 2])
def test_whole_tensors_are_their_slices_of_the_global_tensors(tp):
    rng = torch.Generator().manual_seed(0)
    for kind, shardings in _shardings(tp):
        full = _globals(kind, tp, rng)
        boxes = [b for r, s in enumerate(shardings) for b in s.boxes(_local(kind, full, r, tp), "p.")
                 if not b.replica_id]
        got = _assemble(boxes, {k: tuple(v.shape) for k, v in full.items()})
        for key in full:
            assert torch.equal(got[key], full[key]), (kind, key)


@pytest.mark.parametrize("tp", [1, 2])
def test_every_flat_range_is_at_most_three_boxes_per_region_with_the_right_values(tp):
    rng = torch.Generator().manual_seed(1)
    for kind, shardings in _shardings(tp):
        full = _globals(kind, tp, rng)
        for rank, sharding in enumerate(shardings):
            local = _local(kind, full, rank, tp)
            n = local.numel()
            for start, stop in itertools.combinations(range(n + 1), 2):
                flat = local.reshape(-1)[start:stop].clone()
                boxes = sharding.flat_boxes(start, stop, flat, "p.")
                assert len(boxes) <= 3 * len(sharding.regions)
                assert sum(b.data.numel() for b in boxes) == stop - start
                for b in boxes:
                    assert b.data.data_ptr() >= flat.data_ptr()  # views of the flat values
                    index = tuple(slice(o, o + m) for o, m in zip(b.global_offset, b.data.shape))
                    assert torch.equal(b.data, full[b.key][index]), (kind, start, stop, b)


def test_flat_ranges_of_all_ranks_rebuild_the_global_tensors():
    """Distributed-optimizer pieces: ranges of each rank's local tensor, cut at odd places."""
    rng = torch.Generator().manual_seed(2)
    tp = 2
    for kind, shardings in _shardings(tp):
        full = _globals(kind, tp, rng)
        boxes = []
        for rank, sharding in enumerate(shardings):
            local = _local(kind, full, rank, tp).reshape(-1)
            cuts = [0, 5, 6, 11, local.numel()] if local.numel() > 11 else [0, 3, local.numel()]
            for a, b in zip(cuts, cuts[1:]):
                boxes += [x for x in sharding.flat_boxes(a, b, local[a:b], "p.") if not x.replica_id]
        got = _assemble(boxes, {k: tuple(v.shape) for k, v in full.items()})
        for key in full:
            assert torch.equal(got[key], full[key])


def test_bad_boxes_and_ranges_are_refused():
    with pytest.raises(ValueError, match=r"outside the global shape"):
        ShardedTensor("k", torch.zeros(2, 2), (3, 2), (2, 0))
    with pytest.raises(ValueError, match=r"dimensions of the global shape"):
        ShardedTensor("k", torch.zeros(2), (3, 2), (0, 0))
    sharding = ParamSharding.partition("w", (4, 3), 0, 0, 1)
    with pytest.raises(ValueError, match=r"elements \[5, 20\)"):
        sharding.flat_boxes(5, 20, torch.zeros(15), "")
    with pytest.raises(ValueError, match=r"experts 2..3 outside the 3 experts"):
        ParamSharding.expert_axis("x", (2, 2, 2), 3, 2)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_grouped_expert_flat_ranges_rebuild_the_global_expert_axis(ep):
    """Grouped experts ``[E_local, r, c]`` of EP rank q are experts ``q E_local ..`` of the global
    ``[E, r, c]``: every flat range of every rank (the distributed optimizer's pieces) is at most
    five boxes whose values are the global tensor's, and the ranks' whole boxes rebuild it."""
    experts, rows, cols = 4, 3, 5
    full = torch.randn(experts, rows, cols, generator=torch.Generator().manual_seed(3))
    local_n = experts // ep
    whole = []
    for q in range(ep):
        local = full[q * local_n:(q + 1) * local_n]
        sharding = ParamSharding.expert_axis("w", local.shape, experts, q * local_n)
        whole += sharding.boxes(local, "p.")
        flat_all = local.reshape(-1)
        for start, stop in itertools.combinations(range(0, flat_all.numel() + 1, 2), 2):
            boxes = sharding.flat_boxes(start, stop, flat_all[start:stop].clone(), "p.")
            assert len(boxes) <= 5 and sum(b.data.numel() for b in boxes) == stop - start
            for b in boxes:
                index = tuple(slice(o, o + m) for o, m in zip(b.global_offset, b.data.shape))
                assert b.global_shape == (experts, rows, cols)
                assert torch.equal(b.data, full[index]), (q, start, stop, b)
    got = _assemble(whole, {"p.w": (experts, rows, cols)})
    assert torch.equal(got["p.w"], full)


def test_resizable_rows_are_clipped():
    box = ShardedTensor("emb", torch.arange(12.).view(4, 3), (8, 3), (4, 0), resizable=True)
    clipped = box.clipped_rows(6)
    assert clipped.global_shape == (6, 3) and torch.equal(clipped.data, box.data[:2])
    assert box.clipped_rows(4) is None


def test_writers_are_balanced_and_unique():
    sizes = [100, 70, 60, 30, 30, 5, 1]
    boxes = [ShardedTensor(f"t{i}", torch.zeros(n), (n,), (0,)) for i, n in enumerate(sizes)]
    boxes.append(ShardedTensor("replica", torch.zeros(50), (50,), (0,), replica_id=1))
    per_rank = [balance_writers(boxes, r, 3) for r in range(3)]
    for i in range(len(sizes)):
        assert sum(p[i].replica_id == 0 for p in per_rank) == 1  # exactly one writer
    assert all(p[-1].replica_id == 1 for p in per_rank)  # a replica everywhere stays one
    written = [sum(b.nbytes for b in p if not b.replica_id) for p in per_rank]
    assert written == [400, 400, 384]  # 100 | 70+30 | 60+30+5+1 elements of 4 bytes
    assert balance_writers(boxes, 0, 1) == boxes


def test_writers_are_chosen_within_each_boxes_replica_group():
    from megatron.core.dist_checkpointing import balance_writers_by_group

    # 4 ranks: dense boxes replicated over all four (dp_cp), expert boxes over [0, 2] or
    # [1, 3] (expt_dp at EP=2: ranks 0, 2 hold one expert, 1, 3 the other), one owned shard.
    def boxes_of(rank):
        experts = (0, 2) if rank in (0, 2) else (1, 3)
        out = [ShardedTensor(f"dense{i}", torch.zeros(n), (n,), (0,), replica_group=(0, 1, 2, 3))
               for i, n in enumerate((40, 30, 20, 10))]
        out += [ShardedTensor(f"expert{experts[0]}.{i}", torch.zeros(n), (n,), (0,),
                              replica_group=experts) for i, n in enumerate((25, 5))]
        out.append(ShardedTensor(f"owned{rank}", torch.zeros(3), (3,), (0,)))
        return out

    chosen = {r: balance_writers_by_group(boxes_of(r), r) for r in range(4)}
    writers = {}
    for r, boxes in chosen.items():
        assert [b.key for b in boxes] == [b.key for b in boxes_of(r)]  # order kept
        for b in boxes:
            if not b.replica_id:
                writers.setdefault(b.key, []).append(r)
    # every box exactly one writer, a member of its replica group
    assert writers == {"dense0": [0], "dense1": [1], "dense2": [2], "dense3": [3],
                       "expert0.0": [0], "expert0.1": [2], "expert1.0": [1], "expert1.1": [3],
                       "owned0": [0], "owned1": [1], "owned2": [2], "owned3": [3]}
    # the oracle: within a group, the plain balance_writers over the group's own boxes
    dense = [b for b in boxes_of(0) if b.key.startswith("dense")]
    assert [b.replica_id for b in chosen[0][:4]] == [b.replica_id
                                                     for b in balance_writers(dense, 0, 4)]
    with pytest.raises(ValueError, match=r"replica group \[1, 3\] does not hold rank 0"):
        balance_writers_by_group([ShardedTensor("x", torch.zeros(1), (1,), (0,),
                                                replica_group=(1, 3))], 0)
