"""Pieces of scripts/smoke_grpc_runtime.py: shared types and prompts (common), the scenarios."""
