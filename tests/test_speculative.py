"""Speculative decoding: drafters, the decode step, and the session gates through the server."""

import grpc
import mlx.core as mx
import mlx.nn as nn
import pytest

from inference_engine.client import spec_gates as spec_gate
from inference_engine.decoding import step
from inference_engine.decoding.drafter import ModelDrafter, PromptLookupDrafter
from inference_engine.decoding.sampler import target_draws
from inference_engine.model.loader import LoadedModel
from inference_engine.runtime.engine import Engine, check_draft_compatible
from inference_engine.session.session import Session
from inference_engine.session.session_store import SessionStore
from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server
from tests.coordinator_helpers import append_alone
from tests.draft_models import dequantized_q4_draft
from tests.kernel_guard import assert_full_tile
from tests.tiny_models import random_model

PROMPT = [5, 17, 33, 2, 250, 9, 9, 120, 64, 3, 5, 17, 33, 2, 250, 9]
# From here the tiny model settles into a repeating continuation that prompt lookup copies
# (PROMPT gets no lookup draft accepted: random weights rarely copy).
GATE_PROMPT = [117] * 16


def noisy_copy(seed: int = 0, scale: float = 0.02) -> LoadedModel:
    """The tiny model `seed` with N(0, scale^2) added to every weight: a draft model that agrees sometimes."""
    m = random_model(seed=seed)
    mx.random.seed(99)
    m.model.update(nn.utils.tree_map(lambda p: p + scale * mx.random.normal(p.shape), m.model.parameters()))
    mx.eval(m.model.parameters())
    return m


@pytest.fixture(scope="module")
def engine(tiny):
    # The draft is a noisy copy of the target: most drafts rejected (rollback), some accepted.
    e = assert_full_tile(Engine(tiny, exact=True, max_tile=16, plain_block=64, max_rollback=8, draft=noisy_copy()))
    yield e
    e.close()


@pytest.fixture(scope="module")
def self_engine(tiny):
    # The draft model is the target itself: every greedy draft is the target's own choice.
    e = assert_full_tile(Engine(tiny, exact=True, max_tile=16, plain_block=64, max_rollback=8, draft=tiny))
    yield e
    e.close()


def _session(engine, tokens: list[int]) -> Session:
    s = Session(SessionStore.new_id(), engine.open_session(2, 8), 2, 8, (1,), "")
    append_alone(s.coordinator, tokens)
    return s


def test_prompt_lookup_proposals(engine):
    d = PromptLookupDrafter(max_ngram=3)

    def propose(context: list[int], k: int, drafter: PromptLookupDrafter = d) -> list[int]:
        return drafter.propose(_session(engine, context[:-1]), context[-1], k)

    assert propose([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert propose([1, 2, 3, 9, 2, 3], 2) == [9, 2]  # 2-gram match
    assert propose([7, 8, 9], 4) == []  # no match
    assert propose([4, 4, 4], 4) == [4]  # only what exists after the match
    assert propose([4, 5, 4], 4) == []  # 1-gram matches are not proposed by default
    assert propose([4, 5, 4], 2, PromptLookupDrafter(min_ngram=1)) == [5, 4]
    assert propose([1, 2, 1, 3, 1, 2], 2) == [1, 3]  # longest n-gram, most recent match


def test_model_drafter_follows_the_log_lazily(engine):
    d = ModelDrafter(lambda s: engine.make_draft_cache(2, 8), catch_up=64)

    def fresh(tokens: list[int], next_token: int, k: int) -> list[int]:
        return ModelDrafter(lambda s: engine.make_draft_cache(2, 8), catch_up=64).propose(_session(engine, tokens),
                                                                                          next_token, k)

    s = _session(engine, PROMPT[:10])
    a = d.propose(s, 7, 4)
    assert len(a) == 4 and s.draft.length == 10 and s.draft.drafted == [7, *a[:3]]
    # The step accepted 7 and a[0] only; the next proposal rolls back the rest and catches up.
    append_alone(s.coordinator, [7, a[0], 99])
    assert d.propose(s, 98, 3) == fresh(PROMPT[:10] + [7, a[0], 99], 98, 3)
    # Everything the cache holds is still the log: it re-derives logits for the last token.
    append_alone(s.coordinator, [98])
    assert d.propose(s, 5, 2) == fresh(PROMPT[:10] + [7, a[0], 99, 98], 5, 2)
    # A retracted step lowers the watermark: what followed it is recomputed.
    append_alone(s.coordinator, [5, 6])
    mark = s.draft.followed.valid
    s.coordinator.retract(3, None)
    assert s.draft.followed.valid == min(mark, len(s.history))
    assert d.propose(s, 11, 2) == fresh(list(s.history), 11, 2)
    # Far apart (beyond the rollback room): rebuilt from scratch.
    other = [int(t) % 256 for t in range(40, 80)]
    t = _session(engine, other[:10])
    d.propose(t, 1, 2)
    t.coordinator.restore(t.coordinator.checkpoint())
    append_alone(t.coordinator, other[10:])
    assert d.propose(t, 3, 2) == fresh(other, 3, 2)


def test_draft_vocab_mismatch_refused(tiny):
    with pytest.raises(ValueError, match="vocab size 300"):
        check_draft_compatible(tiny, random_model(seed=2, vocab_size=300))


def _gate_lines(report: spec_gate.GateReport) -> int:
    return sum(line.startswith("ok: gate") for line in report.lines)


@pytest.mark.parametrize("drafter", ["lookup", "draft", "self"])
async def test_session_gates_tiny(engine, self_engine, drafter):
    async with running_server(self_engine if drafter == "self" else engine) as (stub, runtime):
        report = await spec_gate.run_gates(stub, pb, lambda sid: runtime.store.get(sid).history, GATE_PROMPT, [drafter],
                                           [1, 4, 8], 24, 3, 8, ["greedy", "seeded"])
    assert report.failures == 0, "\n".join(report.lines)
    assert _gate_lines(report) == 2 * ((2 * 3 + 1) + 2 * (4 * 3 + 1))  # widths {2, 32}, {3, 4, 5, 32}, {7, 8, 9, 32}
    assert len(report.arms) == 2 * (4 + 6 + 6) and all(a.drafted > 0 for a in report.arms)
    kinds = {setting: {a.acceptance for a in report.arms if a.setting == setting} for setting in spec_gate.SAMPLINGS}
    if drafter == "self":  # greedy: every draft accepted; seeded: the draw departs from the argmax draft at times
        assert kinds == {"greedy": {"full"}, "seeded": {"partial"}}
    elif drafter == "draft":
        assert kinds == {"greedy": {"partial"}, "seeded": {"partial"}}
    else:
        assert {"partial", "full"} <= kinds["greedy"] | kinds["seeded"] and "partial" in kinds["seeded"]
    report.check_reached(("partial", "full"))
    assert report.failures == (drafter == "draft"), report.lines[-2:]  # the noisy draft never has a whole arm accepted


async def test_gates_fail_when_no_draft_is_accepted(engine):
    """Control: on PROMPT the tiny model never continues a lookup match, so "equals plain" ran only the reject
    path: every check but the acceptance one passes, and that one fails."""
    async with running_server(engine) as (stub, runtime):
        report = await spec_gate.run_gates(stub, pb, lambda sid: runtime.store.get(sid).history, PROMPT, ["lookup"], [4],
                                           24, 3, 8, ["greedy"])
    assert {a.acceptance for a in report.arms} == {"none"} and report.counts()[0] > 0
    assert [line for line in report.lines if line.startswith("FAIL")] == [
        f"FAIL: lookup: the target accepted 0 of {report.counts()[0]} drafts over all arms"]


def _accept_every_draft(logits, block, params, position, history):
    return iter(block[1:])


def _draws_one_position_early(logits, block, params, position, history):
    return target_draws(logits, block, params, position - 1, history)


@pytest.mark.parametrize("rule,drafter,setting", [(_accept_every_draft, "draft", "greedy"),
                                                  (_draws_one_position_early, "self", "seeded")])
async def test_gates_catch_a_wrong_acceptance_rule(engine, self_engine, monkeypatch, rule, drafter, setting):
    """Control: a step accepting drafts the target would not have chosen makes "speculative equals plain" fail."""

    async def gates() -> spec_gate.GateReport:
        async with running_server(self_engine if drafter == "self" else engine) as (stub, runtime):
            history_of = lambda sid: runtime.store.get(sid).history  # noqa: E731
            return await spec_gate.run_gates(stub, pb, history_of, GATE_PROMPT, [drafter], [4], 24, 3, 8, [setting])

    right = await gates()
    with monkeypatch.context() as m:
        m.setattr(step, "target_draws", rule)
        wrong = await gates()
    assert right.failures == 0, "\n".join(right.lines)
    failed = [line for line in wrong.lines if line.startswith("FAIL")]
    assert any("equals plain" in line for line in failed), "\n".join(wrong.lines)
    assert wrong.counts()[1] > right.counts()[1]  # the wrong rule accepted drafts the right one refused


async def test_speculative_counts_and_eos(engine):
    async with running_server(engine) as (stub, _):
        sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT * 3))
        greedy = []
        async for m in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=30, ignore_eos=True)):
            greedy += list(m.tokens)
        eos = greedy[12]
        sid = (await stub.CreateSession(pb.CreateSessionRequest(eos_token_ids=[eos]))).session_id
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT * 3))
        got, last = [], None
        req = pb.GenerateRequest(session_id=sid, max_new_tokens=30, mode=pb.DECODE_MODE_SPECULATIVE_LOOKUP, num_draft_tokens=8)
        async for m in stub.Generate(req):
            got += list(m.tokens)
            last = m
        assert got == greedy[: greedy.index(eos) + 1] and last.stop_reason == pb.STOP_REASON_EOS
        assert last.drafted_tokens > 0 and last.drafted_tokens >= last.accepted_tokens


async def test_draft_mode_without_draft_model_is_failed_precondition(tiny):
    plain = Engine(tiny, exact=True, max_tile=16, plain_block=64, max_rollback=8)
    async with running_server(plain) as (stub, _):
        sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=4, mode=pb.DECODE_MODE_SPECULATIVE_DRAFT)):
                pass
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--draft-model" in err.value.details()
        for bad in (dict(num_draft_tokens=9), dict(mode=7)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=4, **bad)):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.real_model
@pytest.mark.parametrize("drafter,sampling", [("lookup", "greedy"), ("lookup", "seeded"), ("draft", "greedy")])
async def test_session_gates_real_model(real_model, real_model_path, drafter, sampling):
    """The gate battery on the packaged model (K=4, window wraps) on a prompt it copies, prompt lookup and the q4
    draft model's weights in fp32 (tests/draft_models.py: the q4 model itself drafts on the real model in
    test_sampling_real_model.py and test_constrained.py; the target as its own draft model: test_session_gates_tiny;
    every combination: the script)."""
    draft = dequantized_q4_draft(real_model_path)
    engine = assert_full_tile(Engine(real_model, exact=True, max_tile=16, plain_block=64, max_rollback=8, draft=draft))
    tok = real_model.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": spec_gate.PROMPT_TEXT}], add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    async with running_server(engine) as (stub, runtime):
        report = await spec_gate.run_gates(stub, pb, lambda sid: runtime.store.get(sid).history, prompt, [drafter], [4],
                                           16, 4, 32, [sampling])
    engine.close()
    assert report.failures == 0, "\n".join(report.lines)
    assert len(report.arms) == 6 and all(a.drafted > 0 for a in report.arms)
    drafted, accepted = report.counts()
    kinds = {a.acceptance for a in report.arms}
    if sampling == "greedy":  # the model copies the list: lookup 50/53 drafts accepted, the q4 draft 55/55
        # (as q4 and dequantized alike)
        assert accepted >= 0.85 * drafted and "full" in kinds, report.arms
    else:  # the draws leave the list at times (lookup: 38/49 accepted): drafts rejected there
        assert 0.5 * drafted <= accepted < drafted and "partial" in kinds, report.arms
