"""The KV-cache block pool and the scheduler's admission control, against hand-counted blocks."""

import pytest

from megatron.inference.engine import BlockAllocator, SamplingParams, blocks_needed, bytes_per_block
from megatron.inference.engine.scheduler import Request, Scheduler


def test_blocks_needed_and_bytes():
    assert [blocks_needed(n, 4) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]
    # 2 (k, v) x 16 positions x 3 layers x 2 groups x 8 channels x 4 bytes (fp32)
    assert bytes_per_block(16, 3, 2, 8, 4) == 2 * 16 * 3 * 2 * 8 * 4


def test_free_list_hands_out_lowest_ids_and_takes_them_back():
    pool = BlockAllocator(5)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert (a, b, pool.free) == ([0, 1], [2, 3], 1)
    assert not pool.can_allocate(2)
    with pytest.raises(RuntimeError, match="2 KV-cache blocks asked, 1 free"):
        pool.allocate(2)
    pool.release(a)
    assert pool.allocate(3) == [0, 1, 4]
    with pytest.raises(ValueError, match="at least one block"):
        BlockAllocator(0)


def _request(rid, prompt_len, max_tokens):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))


def test_admission_reserves_prompt_plus_max_tokens_and_waits_for_free_blocks():
    # 6 blocks of 4: a request of 5 + 3 = 8 positions takes 2 blocks, one of 9 + 3 = 12 takes 3.
    sched = Scheduler(BlockAllocator(6), 4, max_batch_size=8, max_tokens_per_step=8,
                      prefill_chunk=4)
    for r in (_request(0, 5, 3), _request(1, 9, 3), _request(2, 5, 3)):
        sched.waiting.append(r)
    plan = sched.plan()
    # 2 + 3 blocks fit, the third request (2 more) waits: first come, first served.
    assert [r.rid for r in sched.running] == [0, 1] and sched.allocator.free == 1
    # Budget 8: request 0's first chunk (4 tokens) and request 1's (4).
    assert [(e.rid, len(e.tokens), e.position, e.sample) for e in plan] == \
        [(0, 4, 0, None), (1, 4, 0, None)]
    sched.finish(sched.running[0])
    sched.admit()
    assert [r.rid for r in sched.running] == [1, 2] and sched.allocator.free == 1


def test_decodes_come_first_and_a_chunk_is_never_cut_to_fit():
    sched = Scheduler(BlockAllocator(16), 4, max_batch_size=4, max_tokens_per_step=5,
                      prefill_chunk=4)
    a, b = _request(0, 2, 4), _request(1, 6, 4)
    a.computed, a.output = 2, [7]  # a is decoding
    sched.running = [b, a]
    plan = sched.plan()
    assert [(e.rid, e.tokens, e.position) for e in plan] == [(0, [7], 2), (1, [1, 2, 3, 4], 0)]
    b.computed = 4
    sched.max_tokens_per_step = 4
    plan = sched.plan()  # a's decode (1) leaves 3: b's last chunk (2 tokens) still fits
    assert [(e.rid, len(e.tokens), e.sample is not None) for e in plan] == [(0, 1, True), (1, 2, True)]
    with pytest.raises(ValueError, match="must hold one prefill chunk"):
        Scheduler(BlockAllocator(4), 4, max_tokens_per_step=2, prefill_chunk=4)


def test_static_batching_admits_only_into_an_empty_batch():
    sched = Scheduler(BlockAllocator(16), 4, max_batch_size=2, static=True)
    for i in range(3):
        sched.waiting.append(_request(i, 2, 2))
    sched.admit()
    sched.finish(sched.running[0])
    sched.admit()
    assert [r.rid for r in sched.running] == [1]
    sched.finish(sched.running[0])
    sched.admit()
    assert [r.rid for r in sched.running] == [2]


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"temperature": 0.0}, "temperature must be > 0"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_p": 1.5}, "top_p must be in"),
    ({"stop": ("",)}, "stop must be non-empty strings"),
])
def test_sampling_params_refuse_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
