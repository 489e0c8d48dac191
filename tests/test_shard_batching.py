"""A worker computes the blocks of sessions waiting at once in one forward (`step_many`,
`BatchQueue` on the runtime's engine thread), each session's bits unchanged: outputs equal the single-process reference
byte for byte; one item's refusal, cancel or failure stays that item's (a failed forward,
its sessions'); blocks queued while the engine computes go together in its next call, and
a call waits a little for the sessions of the previous one."""

import asyncio
import threading

import numpy as np
import pytest

from inference_engine.errors import InvariantViolation, SessionNotFound
from inference_engine.shard.protocol.errors import WorkCancelled
from inference_engine.shard.protocol.types import LayerRange, ShardWork, StepItem
from inference_engine.runtime.batch_queue import BatchQueue
from inference_engine.runtime.scheduler import Scheduler
from inference_engine.shard.worker.mlx_engine import MlxShardEngine
from inference_engine.execution import executor as executor_module
from tests.shard_helpers import GEOMETRY, ref_block, reference, run_chain

TOKENS = np.random.default_rng(5).integers(0, 256, 80).tolist()
PROMPTS = {"a": TOKENS[:3], "b": TOKENS[10:17], "c": TOKENS[20:21]}  # b wraps the window (2 + 5)


@pytest.fixture
def chain(tiny):
    """Head [0, 1) and tail [1, 2), sessions a, b, c prefilled; with their single-process references."""
    engines = [MlxShardEngine(tiny.model, LayerRange(i, i + 1), block=4, max_rollback=4) for i in (0, 1)]
    refs = {}
    for e in engines:
        e.load()
    for sid, prompt in PROMPTS.items():
        for e in engines:
            e.open_session(sid, GEOMETRY)
        run_chain(engines, sid, 1, 0, prompt, all_logits=False)
        refs[sid] = reference(tiny)
        ref_block(refs[sid], prompt)
    return engines, refs


def _step_all(engines, blocks: dict[str, list[int]], work_id: int, all_logits: bool = True) -> dict[str, object]:
    """Each session's block through the chain, all sessions in one `step_many` per engine."""
    sids = list(blocks)
    hidden = {sid: None for sid in sids}
    outs = {}
    for e in engines:
        items = [StepItem(sid, ShardWork(work_id, e._sessions[sid].position, tuple(blocks[sid]), hidden[sid],
                                         all_logits), is_decode=len(blocks[sid]) == 1) for sid in sids]
        outs = dict(zip(sids, e.step_many(items)))
        hidden = {sid: None if isinstance(o, BaseException) else o.tensor for sid, o in outs.items()}
    return outs


def test_sessions_share_one_forward_with_their_own_bits(chain):
    engines, refs = chain
    blocks = [{"a": TOKENS[30:31], "b": TOKENS[31:32], "c": TOKENS[32:33]},  # three decodes
              {"a": TOKENS[40:42], "b": TOKENS[42:43], "c": TOKENS[43:44]},  # a 2-row block with two decodes
              {"b": TOKENS[50:51], "a": TOKENS[51:52]}]
    for step, batch in enumerate(blocks, start=2):
        forwards = [e.metrics().forwards for e in engines]
        outs = _step_all(engines, batch, step)
        assert [e.metrics().forwards - f for e, f in zip(engines, forwards)] == [1, 1]
        for sid, out in outs.items():
            want = ref_block(refs[sid], batch[sid])
            assert out.tensor.tobytes() == want.tobytes(), sid
            assert out.next_position == out.position + len(batch[sid])
    for sid, ref in refs.items():
        assert b"".join(d for e in engines for d in e.layer_digests(sid, ref.executor.offset)) == b"".join(
            ref.executor.layer_digests())


def test_blocks_that_do_not_fit_the_tile_together_run_alone(chain):
    engines, refs = chain
    head = engines[0]
    before = head.metrics()
    outs = _step_all(engines, {"a": TOKENS[60:63], "b": TOKENS[63:65], "c": TOKENS[65:71]}, 2, all_logits=False)
    m = head.metrics()
    # a (3 rows) leaves no room for b (2); c has 6 rows: two chunks of its own
    assert m.steps - before.steps == 3 and m.forwards - before.forwards == 1 + 1 + 2
    for sid, block in {"a": TOKENS[60:63], "b": TOKENS[63:65], "c": TOKENS[65:71]}.items():
        assert outs[sid].tensor.tobytes() == ref_block(refs[sid], block, all_logits=False).tobytes(), sid


def test_one_item_refused_or_cancelled_leaves_the_others(chain):
    engines, refs = chain
    head = engines[0]
    items = [
        StepItem("a", ShardWork(5, 3, (TOKENS[70],), None), True),
        StepItem("b", ShardWork(6, 99, (TOKENS[71],), None), True),  # wrong position
        StepItem("c", ShardWork(7, 1, (TOKENS[72],), None), True, lambda: True),  # cancelled before it ran
        StepItem("nobody", ShardWork(8, 0, (TOKENS[73],), None), True),
        StepItem("a", ShardWork(9, 4, (TOKENS[74],), None), True),  # a's next block: after a's first
    ]
    outs = head.step_many(items)
    assert isinstance(outs[1], InvariantViolation) and isinstance(outs[2], WorkCancelled)
    assert isinstance(outs[3], SessionNotFound)
    assert (outs[0].position, outs[0].next_position, outs[4].position, outs[4].next_position) == (3, 4, 4, 5)
    tail = engines[1]
    for out, token in ((outs[0], TOKENS[70]), (outs[4], TOKENS[74])):
        logits = tail.decode("a", ShardWork(out.work_id, out.position, (), out.tensor, True)).tensor
        assert logits.tobytes() == ref_block(refs["a"], [token]).tobytes()
    # b and c were refused before computing: both still step, bitwise
    outs = _step_all(engines, {"b": TOKENS[75:76], "c": TOKENS[76:77]}, 10)
    for sid, token in (("b", TOKENS[75]), ("c", TOKENS[76])):
        assert outs[sid].tensor.tobytes() == ref_block(refs[sid], [token]).tobytes()


def test_a_failed_forward_breaks_its_sessions_only(chain, monkeypatch):
    engines, _ = chain
    head = engines[0]

    def boom(*args, **kwargs):
        raise RuntimeError("simulated MLX failure")

    monkeypatch.setattr(executor_module, "forward_rows", boom)
    outs = head.step_many([StepItem(s, ShardWork(3, p, (1,), None), True) for s, p in (("a", 3), ("b", 7))])
    assert all(isinstance(o, RuntimeError) for o in outs)
    monkeypatch.undo()
    for sid in ("a", "b"):
        with pytest.raises(InvariantViolation, match="broken .*RuntimeError"):
            head.decode(sid, ShardWork(4, 3, (1,), None))
    assert head.decode("c", ShardWork(4, 1, (1,), None)).next_position == 2


async def test_blocks_queued_while_the_engine_computes_go_together(chain):
    engines, refs = chain
    head = engines[0]
    thread = Scheduler(lambda: None, max_rows=1, name="test-engine")
    batcher = BatchQueue(thread, head.step_many)
    gate = threading.Event()
    busy = thread.submit(gate.wait)  # the engine is computing something else
    try:
        forwards = head.metrics().forwards
        steps = [asyncio.ensure_future(batcher.run(StepItem(sid, ShardWork(2, p, (TOKENS[i],), None), True)))
                 for i, (sid, p) in enumerate((("a", 3), ("b", 7), ("c", 1)))]
        await asyncio.sleep(0.05)
        assert not any(s.done() for s in steps)
        gate.set()
        await busy
        outs = await asyncio.gather(*steps)
        assert head.metrics().forwards - forwards == 1
        tail = engines[1]
        for i, (sid, out) in enumerate(zip("abc", outs)):
            logits = tail.decode(sid, ShardWork(2, out.position, (), out.tensor, True)).tensor
            assert logits.tobytes() == ref_block(refs[sid], [TOKENS[i]]).tobytes()
        with pytest.raises(InvariantViolation):  # one block's error reaches its own caller
            await batcher.run(StepItem("a", ShardWork(3, 0, (1,), None), True))
    finally:
        gate.set()
        thread.close()
    with pytest.raises(Exception, match="shutting down"):
        await batcher.run(StepItem("a", ShardWork(4, 4, (1,), None), True))


async def test_blocks_queued_in_one_loop_turn_go_together_and_a_lone_block_never_waits(chain):
    engines, refs = chain
    head = engines[0]
    thread = Scheduler(lambda: None, max_rows=1, name="test-engine")
    batcher = BatchQueue(thread, head.step_many)
    positions = {"a": 3, "b": 7, "c": 1}

    def item(sid: str, step: int) -> StepItem:
        positions[sid] += 1
        return StepItem(sid, ShardWork(step, positions[sid] - 1, (TOKENS[step],), None), True)

    try:
        forwards = head.metrics().forwards
        outs = await asyncio.gather(*(batcher.run(item(sid, 2)) for sid in "abc"))  # queued in one turn: one call
        assert head.metrics().forwards - forwards == 1 and batcher.calls == 1
        tail = engines[1]
        for sid, out in zip("abc", outs):
            logits = tail.decode(sid, ShardWork(2, out.position, (), out.tensor, True)).tensor
            assert logits.tobytes() == ref_block(refs[sid], [TOKENS[2]]).tobytes()
        # a and c stopped: b's next block goes at once, alone (no wait for the last call's companions)
        out = await asyncio.wait_for(batcher.run(item("b", 3)), 60)
        assert head.metrics().forwards - forwards == 2 and out.next_position == positions["b"]
    finally:
        thread.close()


def test_a_session_s_later_block_never_overtakes_its_earlier_one(chain):
    engines, refs = chain
    head = engines[0]
    items = [StepItem("c", ShardWork(2, 1, tuple(TOKENS[60:62]), None), False),  # 2 of the tile's 4 rows
             StepItem("a", ShardWork(4, 3, tuple(TOKENS[64:67]), None), False),  # no room: alone, after
             StepItem("a", ShardWork(5, 6, (TOKENS[67],), None), True)]  # would fit, but must follow a's block
    outs = head.step_many(items)
    assert [(o.position, o.next_position) for o in outs[1:]] == [(3, 6), (6, 7)]
    tail = engines[1]
    for out, block in zip(outs[1:], (TOKENS[64:67], TOKENS[67:68])):
        logits = tail.prefill("a", ShardWork(out.work_id, out.position, (), out.tensor, True)).tensor
        assert logits.tobytes() == ref_block(refs["a"], block).tobytes()
