"""Seeded sampling on the packaged SmolLM2-135M is token-identical across prompt chunkings, burst
widths {1, K, 32}, prompt-lookup and draft-model speculation (window wrapping meanwhile)."""

import pytest

from inference_engine.model.loader import load_model
from inference_engine.runtime.engine import Engine
from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server
from tests.exactness import chunkings

pytestmark = pytest.mark.real_model
SINK, WINDOW, N, K = 4, 32, 16, 4
SAMPLED = dict(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1, seed=20261201)


@pytest.fixture(scope="module")
def spec_engine(real_model, real_model_path):
    e = Engine(real_model, exact=True, max_tile=16, plain_block=64, max_rollback=8,
               draft=load_model(real_model_path.parent / "q4"))
    yield e
    e.close()


async def _run(stub, prompt, sizes, width, mode=pb.DECODE_MODE_GREEDY) -> tuple[list[int], str]:
    sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=SINK, window_tokens=WINDOW))).session_id
    i = 0
    for n in sizes:
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=prompt[i : i + n]))
        i += n
    out: list[int] = []
    while len(out) < N:
        req = pb.GenerateRequest(session_id=sid, max_new_tokens=min(width, N - len(out)), ignore_eos=True, mode=mode,
                                 num_draft_tokens=K, **SAMPLED)
        out += [t async for m in stub.Generate(req) for t in m.tokens]
    digest = (await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))).state_digest
    await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    return out, digest


async def test_seeded_sampling_is_exact_on_the_real_model(real_model, spec_engine):
    tok = real_model.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Tell me a story about a lighthouse keeper."}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    async with running_server(spec_engine) as (stub, _):
        ref = await _run(stub, prompt, [len(prompt)], N)
        assert len(prompt) + N > SINK + WINDOW  # the window wraps
        runs = {}
        for (name, sizes), width in zip(chunkings(len(prompt), seeds=range(1)).items(), (1, K, 32, 1, K)):  # 5 chunkings
            runs[f"{name} w={width}"] = await _run(stub, prompt, sizes, width)
        for mode, label in ((pb.DECODE_MODE_SPECULATIVE_LOOKUP, "lookup"), (pb.DECODE_MODE_SPECULATIVE_DRAFT, "draft")):
            for width in (1, K, 32):
                runs[f"{label} w={width}"] = await _run(stub, prompt, [7, len(prompt) - 7], width, mode)
        sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=SINK, window_tokens=WINDOW))).session_id
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=prompt))
        greedy_req = pb.GenerateRequest(session_id=sid, max_new_tokens=N, ignore_eos=True)
        greedy = [t async for m in stub.Generate(greedy_req) for t in m.tokens]
    assert len(runs) == 11 and {k: v for k, v in runs.items() if v != ref} == {}
    assert greedy != ref[0] and len(set(ref[0])) > 5  # the draws are real
