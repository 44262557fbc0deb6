"""The errors autopar raises on bad input.

Each carries a one-line message that names the cause and the fix; callers
(the CLI, tests) can rely on ``str(err)`` being that line.
"""

from __future__ import annotations


class AutoparError(Exception):
    """Base of every error autopar raises on purpose."""


class CaptureError(AutoparError):
    """The model could not be captured into a joint graph."""


class ClusterError(AutoparError):
    """A cluster, device, preset or mesh description is invalid."""


class PlanError(AutoparError):
    """No plan satisfies the request (e.g. nothing fits the memory limit)."""


class PlanFormatError(AutoparError):
    """A plan file is malformed or was written by a newer autopar."""


class LaunchError(AutoparError):
    """A rank of a launched job failed, died or ran past its time limit.

    ``signal``: the signal that killed a rank (a native crash: 6 SIGABRT, 11
    SIGSEGV), None when a rank raised, exited or timed out.
    """

    def __init__(self, message: str, signal: int | None = None) -> None:
        super().__init__(message)
        self.signal = signal


class RuntimeMismatchError(AutoparError):
    """A plan does not fit the job that runs it (world size, model, batch)."""


class CheckpointError(AutoparError):
    """A checkpoint cannot be saved or loaded (missing, of another model, another optimizer)."""
