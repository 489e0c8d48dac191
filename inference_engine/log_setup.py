"""Process logging: `--log-level` and `--log-format text|json` (one JSON object per line).

Configured once in `__main__` for every command. JSON lines carry the standard fields
plus any structured fields a call passes as `extra` (the per-RPC line's `rpc` fields).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, message, the `extra` fields, exc (if any)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def add_logging_flags(parser: argparse.ArgumentParser) -> None:
    """Register --log-level and --log-format."""
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LEVELS, help="least severe level logged")
    parser.add_argument("--log-format", default="text", choices=("text", "json"),
                        help="text lines, or one JSON object per line")


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Send the process's logs to stderr at `level` in `fmt` (replaces earlier handlers)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
