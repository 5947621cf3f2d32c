"""Helpers for tests and benchmarks: launching real SGLang servers."""

from __future__ import annotations

from sgl_ragged.testing.server import ServerError, ServerProcess, free_port

__all__ = ["ServerError", "ServerProcess", "free_port"]
