"""`python -m inference_engine chat` and `generate`: a terminal client of a running server.

Imports only grpc, protobuf and the generated stubs, so a client-only install (no MLX)
runs it. The server address is --target, else $INFERENCE_ENGINE_ADDRESS, else
127.0.0.1:50051; TLS, mTLS and the bearer token as client/connection.py reads them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, TextIO

import grpc

from inference_engine.client.client import GenerateSettings, RuntimeClient, ServerUnavailable
from inference_engine.client.connect_errors import explain
from inference_engine.client.connection import add_connection_flags, client_security
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.version import add_version_flag

MODES = {"plain": pb.DECODE_MODE_GREEDY, "lookup": pb.DECODE_MODE_SPECULATIVE_LOOKUP,
         "draft": pb.DECODE_MODE_SPECULATIVE_DRAFT}
# Codes of a turn the server refused or could not finish: chat reports them and reads the next line
# (anything else, an unreachable server, refused credentials, ends it).
REFUSALS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                      grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
                      grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED})
CHAT_HELP = "/help lists the commands, /quit (or Ctrl-D) leaves"
CHAT_COMMANDS = {  # what /help prints; anything else typed is a user turn
    "/help": "list these commands",
    "/reset": "start a new conversation (a new session)",
    "/quit, /exit, Ctrl-D": "leave",
    "Ctrl-C": "stop the reply being written (at the prompt: leave)",
}


def unsigned(bits: int) -> Callable[[str], int]:
    """An argparse type: an integer that fits the request's unsigned field of `bits` bits."""
    top = (1 << bits) - 1

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not 0 <= value <= top:
            raise argparse.ArgumentTypeError(f"{value} is out of range; allowed 0..{top}")
        return value

    return parse


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    """Flags shared by chat and generate: where the server is and how to generate."""
    add_connection_flags(parser)
    parser.add_argument("--system", default=None, help="system message opening the conversation")
    parser.add_argument("--max-new-tokens", type=unsigned(32), default=0, help="tokens per reply (0 = server default)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=unsigned(32), default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=0.0, help="0 = off")
    parser.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    parser.add_argument("--repetition-penalty", type=float, default=0.0, help="0 = off")
    parser.add_argument("--seed", type=unsigned(64), default=None, help="sampling seed (default: the server picks one)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--mode", choices=sorted(MODES), default="plain", help="speculative decoding mode")
    parser.add_argument("--stats", action="store_true",
                        help="print usage to stderr: tokens, the time to the first token as you waited for it (from "
                             "sending the turn, its append included), tok/s")
    add_version_flag(parser)


def add_client_commands(sub: argparse._SubParsersAction) -> dict[str, argparse.ArgumentParser]:
    """Register `chat` and `generate` on a subcommand parser; returns their parsers by name."""
    chat = sub.add_parser("chat", help="interactive multi-turn chat with a running server",
                          description="Chat with a running server in one session. Commands: "
                          + "; ".join(f"{k}: {v}" for k, v in CHAT_COMMANDS.items()) + ".")
    add_client_flags(chat)
    gen = sub.add_parser("generate", help="one-shot generation against a running server (for scripts)")
    gen.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as text, without the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--logprobs", type=unsigned(32), default=None, metavar="N",
                     help="with --json: each token's logprob and N alternatives (0..20)")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", type=Path, default=None, metavar="FILE",
                       help="the reply is JSON that this JSON schema file validates (constrained output)")
    shape.add_argument("--regex", default=None, help="the reply matches this regular expression (constrained output)")
    add_client_flags(gen)
    return {"chat": chat, "generate": gen}


def over_limits(args: argparse.Namespace, limits: pb.ModelLimits) -> str:
    """Why the flags ask for more than the server allows ("" when they do not): told before the first turn."""
    asked = (("--max-new-tokens", args.max_new_tokens, limits.max_new_tokens),
             ("--logprobs", getattr(args, "logprobs", None) or 0, limits.max_top_logprobs))
    return "; ".join(f"{flag} {value} is over the server's limit of {top}" for flag, value, top in asked
                     if top and value > top)


def settings_from_args(args: argparse.Namespace) -> GenerateSettings:
    """The Generate fields the flags ask for."""
    return GenerateSettings(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed, stop=tuple(args.stop),
        top_logprobs=getattr(args, "logprobs", None), ignore_eos=getattr(args, "ignore_eos", False),
        mode=MODES[args.mode], regex=getattr(args, "regex", None),
        json_schema=getattr(args, "json_schema", None),
    )


@dataclass
class ReplyClock:
    """What the user waited for, timed here: from sending the turn (its AppendTokens) to the
    reply's first token, and how much of that the append took. The server's own usage times
    the Generate call alone, which starts after the prompt is already in the cache."""

    start: float = field(default_factory=time.perf_counter)  # the turn was sent
    appended: float | None = None  # its AppendTokens returned
    first_token: float | None = None  # the first message carrying tokens arrived

    def mark_appended(self) -> None:
        self.appended = time.perf_counter()

    def watch(self, stream: Iterable[pb.GenerateResponse]) -> Iterator[pb.GenerateResponse]:
        """The stream's messages, noting when the first token arrives."""
        for msg in stream:
            if msg.tokens and self.first_token is None:
                self.first_token = time.perf_counter()
            yield msg


def _usage_line(last: pb.GenerateResponse, clock: ReplyClock) -> str:
    """The --stats line. Two first-token times, each saying what it measures: the one waited for here
    (from sending the turn, its append included) and the server's (from the Generate call's start)."""
    u = last.usage
    ms = lambda t: f"{(t - clock.start) * 1000:.0f} ms"  # noqa: E731 - since the turn was sent
    first = f"first token {ms(clock.first_token)} after sending the turn" if clock.first_token is not None else "no token"
    append = f" (prompt appended in {ms(clock.appended)})" if clock.appended is not None else ""
    server = f", {u.time_to_first_token_ms:.0f} ms of it in Generate" if clock.first_token is not None else ""
    return (f"[{u.generated_tokens} tokens, {pb.StopReason.Name(last.stop_reason).removeprefix('STOP_REASON_')}, "
            f"prompt {u.prompt_tokens}, {first}{append}{server}, {u.tokens_per_second:.1f} tok/s, seed {last.seed}]")


def complete(stream: Iterable[pb.GenerateResponse]) -> Iterator[pb.GenerateResponse]:
    """A Generate stream's messages up to its last one (the one with a stop reason): a server that
    drains may end the call with CANCELLED after that message, and the reply is complete all the same."""
    for msg in stream:
        yield msg
        if msg.stop_reason != pb.STOP_REASON_UNSPECIFIED:
            return  # the call's status is not waited for


def stream_reply(stream: Iterable[pb.GenerateResponse], out: TextIO) -> pb.GenerateResponse:
    """Print a Generate stream's text as it arrives; returns its last message."""
    last = pb.GenerateResponse()
    for msg in complete(stream):
        if msg.text:
            out.write(msg.text)
            out.flush()
        last = msg
    return last


def run_generate(args: argparse.Namespace, client: RuntimeClient, out: TextIO, err: TextIO) -> int:
    """One prompt, one reply, one session (closed afterwards)."""
    settings = settings_from_args(args)
    sid = client.create_session()
    try:
        clock = ReplyClock()
        if args.raw:
            appended = client.append_text(sid, args.prompt)
        else:
            turn = ([("system", args.system)] if args.system else []) + [("user", args.prompt)]
            appended = client.append_chat(sid, turn)
        clock.mark_appended()
        stream = clock.watch(client.generate(sid, settings))
        if not args.json:
            last = stream_reply(stream, out)
            out.write("\n")
        else:
            msgs = list(complete(stream))
            last = msgs[-1]
            result = {
                "text": "".join(m.text for m in msgs),
                "tokens": [t for m in msgs for t in m.tokens],
                "stop_reason": pb.StopReason.Name(last.stop_reason).removeprefix("STOP_REASON_"),
                "prompt_tokens": last.usage.prompt_tokens,  # the history the reply conditioned on, as in usage
                "prompt_token_ids": list(appended.tokens),  # what this command appended
                "history_length": last.history_length,
                "seed": last.seed,
                "usage": {f.name: getattr(last.usage, f.name) for f in last.usage.DESCRIPTOR.fields},
            }
            if settings.top_logprobs is not None:
                result["logprobs"] = [{"token": lp.token, "logprob": lp.logprob,
                                       "top": [{"token": a.token, "logprob": a.logprob} for a in lp.top]}
                                      for m in msgs for lp in m.logprobs]
            out.write(json.dumps(result, ensure_ascii=False) + "\n")
        if args.stats:
            err.write(_usage_line(last, clock) + "\n")
    finally:
        client.close_session(sid)
    return 0


def serving(info: pb.GetModelInfoResponse) -> str:
    """What the server computes with, short: "smollm2-135m (GGUF Q4_1/Q8_0), exact at block 64, exact-gemm kernel 3"."""
    kernels = info.kernels
    if kernels.startswith("exact-gemm"):  # "exact-gemm kernel 3 (details) on MLX's CPU stream"
        kernels = kernels.split(" (")[0]
    elif kernels.startswith("MLX ops, BLAS "):  # "MLX ops, BLAS openblas: PATH" (serving_path.py)
        blas = kernels.removeprefix("MLX ops, BLAS ")
        kernels = "MLX ops, " + ("OpenBLAS" if blas.startswith("openblas") else
                                 "reference BLAS" if blas.startswith("reference") else blas)
    mode = f"exact at block {info.block_size}" if info.exact else f"plain blocks of {info.block_size} (not exact)"
    return f"{info.model_name}, {mode}, {kernels}"


def run_chat(args: argparse.Namespace, client: RuntimeClient, info: pb.GetModelInfoResponse, out: TextIO,
             err: TextIO, read: Callable[[str], str]) -> int:
    """The interactive loop: one session, each line a user turn, replies streamed."""
    settings = settings_from_args(args)
    sampling = "greedy" if settings.temperature == 0 else f"temperature {settings.temperature:g}"
    err.write(f"connected to {client.target}: {serving(info)}; {sampling}; {CHAT_HELP}\n")
    sid, opened = client.create_session(), False
    try:
        while True:
            try:
                line = read("> ")
            except EOFError:
                out.write("\n")
                return 0
            text = line.strip()
            if not text:
                continue
            if text in ("/quit", "/exit"):
                return 0
            if text == "/help":
                err.write("".join(f"  {k:<22} {v}\n" for k, v in CHAT_COMMANDS.items()))
                continue
            if text.startswith("/") and " " not in text and text not in ("/reset",):
                err.write(f"[unknown command {text}; /help lists the commands]\n")
                continue
            if text == "/reset":
                client.close_session(sid)
                sid, opened = client.create_session(), False
                err.write("[new conversation]\n")
                continue
            turn = ([("system", args.system)] if args.system and not opened else []) + [("user", text)]
            clock = ReplyClock()
            try:
                try:
                    client.append_chat(sid, turn)
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.NOT_FOUND:
                        raise
                    err.write("[the session expired on the server; starting a new conversation]\n")
                    sid = client.create_session()
                    client.append_chat(sid, ([("system", args.system)] if args.system else []) + [("user", text)])
            except grpc.RpcError as exc:  # a refused append changed nothing: the conversation goes on
                if exc.code() not in REFUSALS:
                    raise
                err.write(f"[not sent: {exc.code().name}: {exc.details()}]\n")
                continue
            opened = True
            clock.mark_appended()
            stream = client.generate(sid, settings)
            try:
                last = stream_reply(clock.watch(stream), out)
            except KeyboardInterrupt:
                stream.cancel()
                out.write("\n")
                err.write("[stopped]\n")
                continue
            except grpc.RpcError as exc:  # the line stays in the conversation, with the reply's part already sent
                if exc.code() not in REFUSALS:
                    raise
                out.write("\n")
                err.write(f"[the reply failed: {exc.code().name}: {exc.details()}]\n")
                continue
            out.write("\n")
            if args.stats:
                err.write(_usage_line(last, clock) + "\n")
    except KeyboardInterrupt:
        out.write("\n")
        return 0
    finally:
        client.close_session(sid)


def main(argv: list[str], out: TextIO = sys.stdout, err: TextIO = sys.stderr,
         read: Callable[[str], str] = input) -> int:
    """Run `chat` or `generate` (argv starts with the command); returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m inference_engine")
    add_version_flag(parser)
    commands = add_client_commands(parser.add_subparsers(dest="command", required=True))
    args, unknown = parser.parse_known_args(argv)
    command = commands[args.command]  # its usage line, not the launcher's, goes with a usage error
    if unknown:
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    if getattr(args, "logprobs", None) is not None and not args.json:
        command.error("--logprobs N needs --json: plain text output has no place for them")
    if getattr(args, "json_schema", None) is not None:  # read once parsed (parsing itself touches no file)
        try:
            args.json_schema = args.json_schema.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            command.error(f"argument --json-schema: cannot read {args.json_schema}: "
                          f"{getattr(exc, 'strerror', None) or exc}")
    try:
        security = client_security(args)
        client = RuntimeClient(args.target, args.connect_timeout, security)
    except (ValueError, OSError) as exc:
        command.error(str(exc))
    try:
        info = client.connect()
        over = over_limits(args, info.limits)
        if not getattr(args, "raw", False) and not info.has_chat_template:  # a base model: nothing to chat with
            over = (f"{info.model_name} has no chat template (a base model): send plain text with "
                    "`generate --raw --prompt TEXT`")
        if over:
            err.write(f"{command.prog}: error: {over}\n")
            return 2
        if args.command == "generate":
            return run_generate(args, client, out, err)
        return run_chat(args, client, info, out, err, read)
    except ServerUnavailable as exc:
        err.write(f"error: {exc}\n")
        return 1
    except grpc.RpcError as exc:
        err.write(f"error: {explain(client.target, exc, security)}\n")
        return 1
    finally:
        client.close()
