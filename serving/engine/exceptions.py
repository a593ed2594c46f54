"""The errors callers of the engine catch. `QueueFullError` is the scheduler's (core raises
it at `max_waiting`); it is named here too so that entry points never import the scheduler."""

from serving.core.scheduler import QueueFullError

__all__ = ["EngineDeadError", "QueueFullError", "RequestFailedError"]


class EngineDeadError(RuntimeError):
    """The engine loop stopped after a failed step; nothing more will run."""


class RequestFailedError(RuntimeError):
    """The engine failed this one request; it goes on serving the others."""
