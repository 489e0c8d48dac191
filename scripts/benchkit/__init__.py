"""Pieces of scripts/bench.py: plan and timing (core), contenders (engines), the report."""
