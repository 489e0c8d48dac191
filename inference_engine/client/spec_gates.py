"""Speculative-session exactness gates, run against a RuntimeService through its stub.

For each sampling setting (greedy; seeded sampling), each drafter (draft model, prompt
lookup, or the target itself as its own draft model) and K, over a window small enough to
wrap during generation ("plain" below is non-speculative decoding with the same sampling
parameters: greedy, or the same seeded draws):
- gate1: for burst widths w in {K-1, K, K+1, 32} (at least 2: a one-token burst never
  drafts), the stream reassembled from Generate calls of max_new_tokens=w equals one-shot
  speculative generation;
- gate2: every such stream equals plain, and the state digest (next-token logits,
  cached K/V, tokens, position) after every burst equals plain's at that position;
- gate3: 16 speculative tokens, then demote to plain: the whole stream equals plain;
- invariants after every arm: cache rows == committed tokens (position == history
  length, cached tokens == min(history, sink + window)); the emitted stream is a prefix
  of the committed history.
"Speculative equals plain" proves nothing when nothing was drafted (plain compared with
itself) or nothing accepted (only the reject path ran), so every speculative arm reports
its drafted and accepted counts and fails when it drafted nothing, and each drafter fails
unless some arm accepted a draft. `GateReport.check_reached` asks for partial and full
acceptance somewhere in a run.
`scripts/spec_session_gate.py` runs them on the packaged model; the tests on both models.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Sequence

HistoryOf = Callable[[str], Sequence[int]]  # a session's committed tokens, by id

# DecodeMode values of the proto. "self" is SPECULATIVE_DRAFT on a server whose draft model
# is the target itself: every greedy draft is the target's own choice (the accept-all path).
MODES = {"draft": 1, "lookup": 2, "self": 1}
# GenerateRequest sampling fields of each setting the gates run under.
SAMPLINGS = {
    "greedy": {},
    "seeded": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.02, "repetition_penalty": 1.1, "seed": 1234},
}
# SmolLM2-135M copies this list (greedy: "The list is: red, green, blue, red, green, blue, ..."),
# so prompt lookup has drafts to propose and the target accepts them.
PROMPT_TEXT = "Copy this list exactly: red, green, blue, red, green, blue, red, green, blue"
ACCEPTANCE_KINDS = ("none", "partial", "full")


@dataclass(frozen=True)
class ArmCounts:
    """Draft counts of one speculative arm (summed over its Generate calls)."""

    label: str  # the arm, e.g. "greedy lookup K=4 w=3"
    drafter: str  # key of MODES
    setting: str  # key of SAMPLINGS
    drafted: int  # draft tokens proposed and verified
    accepted: int  # of those, accepted by the target

    @property
    def acceptance(self) -> str:
        """One of ACCEPTANCE_KINDS: no draft accepted (or none drafted), some, or every one."""
        if self.accepted == 0:
            return "none"
        return "full" if self.accepted == self.drafted else "partial"


@dataclass
class GateReport:
    """Outcome lines of a gate run and the draft counts of its speculative arms."""

    lines: list[str] = field(default_factory=list)
    failures: int = 0
    arms: list[ArmCounts] = field(default_factory=list)

    def check(self, ok: bool, what: str) -> None:
        self.lines.append(("ok: " if ok else "FAIL: ") + what)
        self.failures += 0 if ok else 1
        print(self.lines[-1], flush=True)

    def counts(self, drafter: str | None = None, setting: str | None = None) -> tuple[int, int]:
        """(drafted, accepted) summed over the arms of `drafter` under `setting` (None: all)."""
        arms = [a for a in self.arms if drafter in (None, a.drafter) and setting in (None, a.setting)]
        return sum(a.drafted for a in arms), sum(a.accepted for a in arms)

    def check_accepted(self, drafters: Sequence[str]) -> None:
        """Fail each drafter none of whose arms had a draft accepted."""
        for name in drafters:
            drafted, accepted = self.counts(name)
            self.check(accepted > 0, f"{name}: the target accepted {accepted} of {drafted} drafts over all arms")

    def check_reached(self, kinds: Sequence[str] = ("partial", "full")) -> None:
        """Fail unless some arm reached each acceptance kind ("partial", "full")."""
        for kind in kinds:
            where = [a.label for a in self.arms if a.acceptance == kind]
            first = f" (first: {where[0]})" if where else ""
            self.check(bool(where), f"{kind} acceptance reached in {len(where)} arms{first}")


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
                    window: int, samplings: Sequence[str] = ("greedy",),
                    report: GateReport | None = None) -> GateReport:
    """Run every gate over an open stub for each sampling setting, then require an accepted draft per drafter.

    Args:
        history_of: reads a session's committed tokens by id.
        drafters: keys of MODES ("self" only where the server's draft model is the target).
        report: a report to add to (a run over several servers); a new one when None.
    Returns:
        The report: one line per check, the failures and every speculative arm's counts.
    """
    report = report if report is not None else GateReport()
    for setting in samplings:
        await _gates(stub, pb, history_of, prompt, drafters, ks, n, sink, window, report, setting)
    report.check_accepted(drafters)
    return report


async def _gates(stub, pb, history_of, prompt, drafters, ks, n, sink, window, report, setting) -> None:
    sampling = SAMPLINGS[setting]
    arm = functools.partial(_arm, stub, pb, history_of, prompt, n, sink=sink, window=window, report=report, sampling=sampling)
    plain, plain_digests, _ = await arm([(1, 0, 1)], label=f"{setting} plain w=1")
    report.check(len(prompt) + n > sink + window, f"window wraps during generation ({len(prompt)} + {n} > {sink} + {window})")
    if sampling:
        greedy, _, _ = await _arm(stub, pb, history_of, prompt, n, [(n, 0, 1)], sink, window, report, "greedy reference", {})
        report.check(plain != greedy, f"{setting}: seeded sampling departs from greedy (a real draw)")

    async def spec_arm(plan: list[tuple[int, int, int]], label: str, drafter: str) -> tuple[list[int], dict[int, str]]:
        stream, digests, (d, a) = await arm(plan, label=label)
        report.arms.append(ArmCounts(label, drafter, setting, d, a))
        report.check(d > 0, f"{label}: drafted {d}, accepted {a}")
        return stream, digests

    for name in drafters:
        mode = MODES[name]
        for k in ks:
            tag = f"{setting} {name} K={k}"
            one_shot, _ = await spec_arm([(n, mode, k)], f"{tag} one-shot", name)
            report.check(one_shot == plain, f"{tag} one-shot equals plain")
            for w in sorted({max(2, k - 1), max(2, k), k + 1, 32}):
                stream, digests = await spec_arm([(w, mode, k)], f"{tag} w={w}", name)
                report.check(stream == one_shot, f"gate1 {tag} w={w}: bursts reassemble to one-shot")
                report.check(stream == plain, f"gate2 {tag} w={w}: stream equals plain")
                same = all(plain_digests[p] == dg for p, dg in digests.items())
                report.check(same, f"gate2 {tag} w={w}: state digest equals plain's at all {len(digests)} burst ends")
            stream, digests = await spec_arm([(16, mode, k), (n, 0, k)], f"{tag} demote", name)
            report.check(stream == plain and all(plain_digests[p] == dg for p, dg in digests.items()),
                         f"gate3 {tag}: 16 speculative then plain equals plain")
