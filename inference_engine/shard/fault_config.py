"""TEST FIXTURE: which faults `FaultInjectingEngine` injects (parsed from `--inject-faults`).

Free of MLX imports so the launcher can parse it before re-executing with OpenBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

MALFORMED_KINDS = ("rows", "width", "nan", "position")


@dataclass(frozen=True)
class FaultConfig:
    """Which faults to inject (all off by default)."""

    delay_s: float = 0.0  # sleep before every prefill/decode (on the engine thread)
    memory_budget_bytes: int = 0  # KV bytes the engine may hold; an open beyond it -> RESOURCE_EXHAUSTED (0 = off)
    malformed: str = ""  # corrupt every OK output: "rows" (drop a row), "width", "nan", "position" ("" = off)
    crash_after: int = 0  # after this many prefill/decode/trim calls the engine is dead (0 = off)

    @classmethod
    def parse(cls, spec: str) -> "FaultConfig":
        """Parse `delay=0.2,memory_budget=100000,malformed=rows,crash_after=5`.

        Raises:
            ValueError: unknown key or bad value.
        """
        keys = {"delay": ("delay_s", float), "memory_budget": ("memory_budget_bytes", int),
                "malformed": ("malformed", str), "crash_after": ("crash_after", int)}
        values: dict[str, object] = {}
        for item in filter(None, spec.split(",")):
            key, _, raw = item.partition("=")
            if key not in keys:
                raise ValueError(f"unknown fault {key!r}; known: {', '.join(keys)}")
            name, kind = keys[key]
            values[name] = kind(raw)
        cfg = cls(**values)
        if cfg.malformed and cfg.malformed not in MALFORMED_KINDS:
            raise ValueError(f"malformed={cfg.malformed!r}; known: {', '.join(MALFORMED_KINDS)}")
        return cfg
