"""Seeded sampling on the packaged SmolLM2-135M is token-identical across prompt chunkings (at the tile of 16
and the full block of 64), burst widths {2, K, 32}, prompt-lookup and draft-model speculation (window wrapping
meanwhile), with drafts proposed and accepted; another seed gives another stream (the comparison can fail)."""

import pytest

from inference_engine.client.spec_gates import PROMPT_TEXT
from inference_engine.model.loader import load_model
from inference_engine.runtime.engine import Engine
from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server
from tests.exactness import chunkings
from tests.kernel_guard import assert_full_tile

pytestmark = pytest.mark.real_model
SINK, WINDOW, N, K = 4, 32, 16, 4
SAMPLED = dict(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1, seed=1234)  # copies the list for a while


def _engine(real_model, max_tile: int, draft=None) -> Engine:
    engine = Engine(real_model, exact=True, max_tile=max_tile, plain_block=64, max_rollback=8, draft=draft)
    return assert_full_tile(engine)  # at the tile of 16 and the full block of 64 alike


@pytest.fixture(scope="module")
def spec_engine(real_model, real_model_path):
    e = _engine(real_model, 16, draft=load_model(real_model_path.parent / "q4"))
    yield e
    e.close()


@pytest.fixture(scope="module")
def full_block_engine(real_model):
    e = _engine(real_model, 64)
    yield e
    e.close()


async def _run(stub, prompt, sizes, width, mode=pb.DECODE_MODE_GREEDY, **sampling) -> tuple[list[int], str, int, int]:
    """N tokens in bursts of `width` after the prompt appended in chunks `sizes`: stream, digest, drafted, accepted."""
    sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=SINK, window_tokens=WINDOW))).session_id
    i = 0
    for n in sizes:
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=prompt[i : i + n]))
        i += n
    out: list[int] = []
    drafted = accepted = 0
    while len(out) < N:
        req = pb.GenerateRequest(session_id=sid, max_new_tokens=min(width, N - len(out)), ignore_eos=True, mode=mode,
                                 num_draft_tokens=K, **(sampling or SAMPLED))
        async for m in stub.Generate(req):
            out += m.tokens
            drafted, accepted = drafted + m.drafted_tokens, accepted + m.accepted_tokens
    digest = (await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))).state_digest
    await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    return out, digest, drafted, accepted


async def test_seeded_sampling_is_exact_on_the_real_model(real_model, spec_engine, full_block_engine):
    tok = real_model.tokenizer
    messages = [{"role": "user", "content": PROMPT_TEXT}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)  # a list the model copies: lookup drafts get accepted
    named = chunkings(len(prompt), seeds=range(1))  # 5 chunkings
    runs, counts = {}, {}
    async with running_server(spec_engine) as (stub, _):
        ref = (await _run(stub, prompt, [len(prompt)], N))[:2]
        assert len(prompt) + N > SINK + WINDOW  # the window wraps
        for (name, sizes), width in zip(named.items(), (1, K, 32, 1, K)):
            runs[f"{name} w={width}"] = (await _run(stub, prompt, sizes, width))[:2]
        for mode, label in ((pb.DECODE_MODE_SPECULATIVE_LOOKUP, "lookup"), (pb.DECODE_MODE_SPECULATIVE_DRAFT, "draft")):
            for width in (2, K, 32):  # a one-token burst never drafts
                out, digest, drafted, accepted = await _run(stub, prompt, [7, len(prompt) - 7], width, mode)
                runs[f"{label} w={width}"], counts[f"{label} w={width}"] = (out, digest), (drafted, accepted)
        greedy = (await _run(stub, prompt, [len(prompt)], N, temperature=0.0))[0]
        other_seed = (await _run(stub, prompt, [len(prompt)], N, **{**SAMPLED, "seed": SAMPLED["seed"] + 1}))[0]
    async with running_server(full_block_engine) as (stub, _):
        for name, width in (("1xN", K), ("4 uneven", 32), ("random0", 1)):  # the chunkings with blocks over 16 rows
            runs[f"block 64 {name} w={width}"] = (await _run(stub, prompt, named[name], width))[:2]
    assert len(runs) == 14 and {k: v for k, v in runs.items() if v != ref} == {}
    assert all(d > 0 for d, _ in counts.values()), counts  # every speculative run drafted
    for label in ("lookup", "draft"):  # and each drafter had drafts accepted and rejected
        assert 0 < sum(a for k, (_, a) in counts.items() if k.startswith(label)) < sum(
            d for k, (d, _) in counts.items() if k.startswith(label)), counts
    assert greedy != ref[0] and len(set(ref[0])) > 5  # the draws are real
    assert other_seed != ref[0]  # control: the equalities above can see a different draw
