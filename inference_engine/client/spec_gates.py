"""Speculative-session exactness gates, run against a RuntimeService through its stub.

For each sampling setting (greedy; seeded sampling), each drafter (draft model, prompt
lookup) and K, over a window small enough to wrap during generation ("plain" below is
non-speculative decoding with the same sampling parameters: greedy, or the same seeded draws):
- gate1: for burst widths w in {1, K-1, K, K+1, 32}, the stream reassembled from
  Generate calls of max_new_tokens=w equals one-shot speculative generation;
- gate2: every such stream equals plain, and the state digest (next-token logits,
  cached K/V, tokens, position) after every burst equals plain's at that position;
- gate3: 16 speculative tokens, then demote to plain: the whole stream equals plain;
- invariants after every arm: cache rows == committed tokens (position == history
  length, cached tokens == min(history, sink + window)); the emitted stream is a prefix
  of the committed history.
`scripts/spec_session_gate.py` runs them on the packaged model; the tests on both models.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Sequence

HistoryOf = Callable[[str], Sequence[int]]  # a session's committed tokens, by id

MODES = {"draft": 1, "lookup": 2}  # DecodeMode values of the proto
# GenerateRequest sampling fields of each setting the gates run under.
SAMPLINGS = {
    "greedy": {},
    "seeded": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.02, "repetition_penalty": 1.1, "seed": 1234},
}
PROMPT_TEXT = (
    "Copy this list exactly, twice: alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu. "
    "Then continue counting: one two three four five six seven eight nine ten."
)


@dataclass
class GateReport:
    """Outcome lines of a gate run."""

    lines: list[str] = field(default_factory=list)
    failures: int = 0

    def check(self, ok: bool, what: str) -> None:
        self.lines.append(("ok: " if ok else "FAIL: ") + what)
        self.failures += 0 if ok else 1
        print(self.lines[-1], flush=True)


async def _new_session(stub, pb, prompt: list[int], sink: int, window: int) -> str:
    sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=sink, window_tokens=window))).session_id
    await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=prompt))
    return sid


async def _burst(stub, pb, sid: str, n: int, mode: int, k: int, sampling: dict) -> tuple[list[int], object]:
    tokens, last = [], None
    req = pb.GenerateRequest(session_id=sid, max_new_tokens=n, ignore_eos=True, mode=mode, num_draft_tokens=k, **sampling)
    async for msg in stub.Generate(req):
        tokens += list(msg.tokens)
        last = msg
    return tokens, last


async def _arm(stub, pb, history_of, prompt, n, plan, sink, window, report, label, sampling) -> tuple[list[int], dict[int, str], tuple[int, int]]:
    """Generate n tokens in bursts `plan` = [(width, mode, k)...] repeated; returns stream, digests by position, counts."""
    sid = await _new_session(stub, pb, prompt, sink, window)
    stream: list[int] = []
    digests: dict[int, str] = {}
    drafted = accepted = 0
    i = 0
    while len(stream) < n:
        width, mode, k = plan[min(i, len(plan) - 1)]
        got, last = await _burst(stub, pb, sid, min(width, n - len(stream)), mode, k, sampling)
        stream += got
        drafted, accepted = drafted + last.drafted_tokens, accepted + last.accepted_tokens
        info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        digests[info.history_length] = info.state_digest
        i += 1
    history = list(history_of(sid))
    report.check(
        info.next_global_position == info.history_length == len(prompt) + len(stream)
        and info.cached_tokens == min(info.history_length, sink + window),
        f"{label}: cache rows == committed tokens ({info.next_global_position} positions, {info.cached_tokens} cached)",
    )
    report.check(history[len(prompt) :][: len(stream)] == stream, f"{label}: emitted stream is a prefix of the committed history")
    await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    return stream, digests, (drafted, accepted)


async def run_gates(stub, pb, history_of, prompt: list[int], drafters: list[str], ks: list[int], n: int, sink: int,
                    window: int, samplings: list[str] = ("greedy",)) -> GateReport:
    """Run every gate over an open stub for each sampling setting; `history_of(session_id)` reads a session's committed tokens."""
    report = GateReport()
    for setting in samplings:
        await _gates(stub, pb, history_of, prompt, drafters, ks, n, sink, window, report, setting, SAMPLINGS[setting])
    return report


async def _gates(stub, pb, history_of, prompt, drafters, ks, n, sink, window, report, setting, sampling) -> None:
    arm = functools.partial(_arm, stub, pb, history_of, prompt, n, sink=sink, window=window, report=report, sampling=sampling)
    plain, plain_digests, _ = await arm([(1, 0, 1)], label=f"{setting} plain w=1")
    report.check(len(prompt) + n > sink + window, f"window wraps during generation ({len(prompt)} + {n} > {sink} + {window})")
    if sampling:
        greedy, _, _ = await _arm(stub, pb, history_of, prompt, n, [(n, 0, 1)], sink, window, report, "greedy reference", {})
        report.check(plain != greedy, f"{setting}: seeded sampling departs from greedy (a real draw)")
    for name in drafters:
        mode = MODES[name]
        for k in ks:
            tag = f"{setting} {name} K={k}"
            one_shot, _, (d, a) = await arm([(n, mode, k)], label=f"{tag} one-shot")
            report.check(one_shot == plain, f"{tag} one-shot equals plain (accepted {a}/{d} drafts)")
            for w in sorted({max(1, k - 1), k, k + 1, 1, 32}):
                stream, digests, (d, a) = await arm([(w, mode, k)], label=f"{tag} w={w}")
                report.check(stream == one_shot, f"gate1 {tag} w={w}: bursts reassemble to one-shot ({a}/{d} accepted)")
                report.check(stream == plain, f"gate2 {tag} w={w}: stream equals plain")
                same = all(plain_digests[p] == dg for p, dg in digests.items())
                report.check(same, f"gate2 {tag} w={w}: state digest equals plain's at all {len(digests)} burst ends")
            stream, digests, _ = await arm([(16, mode, k), (n, 0, k)], label=f"{tag} demote")
            report.check(stream == plain and all(plain_digests[p] == dg for p, dg in digests.items()),
                         f"gate3 {tag}: 16 speculative then plain equals plain")
