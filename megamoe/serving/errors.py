"""The engine's refusal of a request it has no room to queue (the HTTP server answers 429)."""

from __future__ import annotations

__all__ = ["QueueFullError"]


class QueueFullError(RuntimeError):
    """``Engine.add_request`` beyond ``EngineConfig.max_waiting`` queued requests: retry later."""
