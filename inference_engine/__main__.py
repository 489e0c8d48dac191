"""Command line: `python -m inference_engine serve [flags]` (and `prepare-model`, `shard-worker`, `models`),
plus the client commands `chat` and `generate`, which need only grpc and protobuf."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from inference_engine.blas import FORCE_ENV, reexec_with_openblas, selected_kernel
from inference_engine.launch import module_command
from inference_engine.process_exit import exit_now
from inference_engine.version import add_version_flag

CLIENT_COMMANDS = ("chat", "generate")
SERVER_COMMANDS = ("serve", "shard-worker", "prepare-model", "models")


def list_models() -> str:
    """`models`: the packaged names, what each is, how to install it, and the families a path may hold."""
    from inference_engine.model.families import supported_types
    from inference_engine.model.packaged import PACKAGED_MODELS

    width = max(len(m.name) for m in PACKAGED_MODELS)
    lines = [f"{m.name:<{width}}  {m.description}  [{m.install}]" for m in PACKAGED_MODELS]
    lines.append(f"or --model PATH: an mlx-lm folder or a .gguf file of model_type {', '.join(supported_types())}")
    return "\n".join(lines)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, except a flag that has none (None: off until given; False: a switch)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _server_parsers(sub: argparse._SubParsersAction) -> bool:
    """Register serve, shard-worker and prepare-model; False when the server's packages are missing."""
    try:
        from inference_engine.config import add_server_flags
        from inference_engine.log_setup import add_logging_flags
        from inference_engine.shard.worker.config import add_worker_flags
    except ImportError as exc:  # a client-only install: say what is missing when a server command is asked for
        for name in SERVER_COMMANDS:
            add_version_flag(sub.add_parser(name, help=f"(needs the server install: {exc.name} is missing)"))
        return False
    defaults = DefaultsHelpFormatter  # every flag's help ends with its default
    commands = {
        "serve": sub.add_parser("serve", help="serve RuntimeService over gRPC", formatter_class=defaults),
        "shard-worker": sub.add_parser("shard-worker", help="serve one layer range over ShardRuntime (gRPC)",
                                       formatter_class=defaults),
        "prepare-model": sub.add_parser("prepare-model", help="convert the packaged model once (fp32 and q4) and exit"),
    }
    add_server_flags(commands["serve"])
    add_worker_flags(commands["shard-worker"])
    for command in commands.values():
        add_logging_flags(command)
        add_version_flag(command)
    add_version_flag(sub.add_parser("models", help="list the packaged model names --model takes"))
    return True


def build_parser() -> tuple[argparse.ArgumentParser, bool]:
    """The launcher's parser with every command; whether the server's packages are installed."""
    parser = argparse.ArgumentParser(prog="python -m inference_engine")
    add_version_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    try:
        has_server = _server_parsers(sub)
    except ValueError as exc:  # a malformed INFERENCE_ENGINE_ADDRESS
        parser.error(str(exc))
    from inference_engine.client.cli import add_client_commands

    add_client_commands(sub)
    return parser, has_server


def _exact_kernels_built() -> bool:
    """The exact kernels build here (quant_kernel.py): every product is theirs, no preload needed (Linux)."""
    if not sys.platform.startswith("linux"):
        return True  # nothing to re-exec for
    from inference_engine.quant_kernel import exact_kernels_built

    return exact_kernels_built()


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the chosen command; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["models"]:  # data only: no MLX, no BLAS re-exec
        print(list_models())
        return 0
    if argv and argv[0] in CLIENT_COMMANDS:  # the client: no MLX, no BLAS re-exec
        from inference_engine.client.cli import main as client_main

        return client_main(argv)
    parser, has_server = build_parser()
    args = parser.parse_args(argv)
    if not has_server:
        parser.error(f"`{args.command}` needs the server install: pip install 'inference_engine[server]'")
    try:
        selected_kernel()  # an unknown INFERENCE_ENGINE_KERNEL is a usage error either way
        if os.environ.get(FORCE_ENV) == "1" or not _exact_kernels_built():  # else no product needs OpenBLAS
            command, env = module_command(*argv)  # this copy of the package, never the current folder's
            reexec_with_openblas(command[1:], env)
    except ValueError as exc:  # an unknown INFERENCE_ENGINE_KERNEL
        parser.error(str(exc))
    from inference_engine.log_setup import configure_logging

    configure_logging(args.log_level, args.log_format)
    if args.command == "prepare-model":
        from inference_engine.config import default_cache_dir
        from inference_engine.model.packaged import ensure_packaged_model

        for quantized in (False, True):
            print(ensure_packaged_model(default_cache_dir(), quantized=quantized))
        return 0
    if args.command == "shard-worker":
        from inference_engine.shard.worker.process import run_worker

        exit_now(run_worker(args, parser))  # like serve: skip C++ static destructors (MLX#3126)
    from inference_engine.config import config_from_args
    from inference_engine.server.server import serve

    try:
        cfg = config_from_args(args)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    try:
        asyncio.run(serve(cfg))
    except (ValueError, FileNotFoundError, OSError) as exc:
        logging.getLogger("inference_engine").error("cannot serve: %s", exc)
        exit_now(2)
    exit_now(0)
    return 0  # pragma: no cover - exit_now does not return


def cli() -> int:
    """Console-script entry point (`inference-engine ...`)."""
    return main()


if __name__ == "__main__":
    sys.exit(main())
