"""Errors a sync can end with, so callers can tell a refused version from a broken transfer.

Knows nothing about which backend raised them; every backend raises these same types.
"""

from __future__ import annotations

__all__ = [
    "CheckpointEngineError",
    "ChecksumError",
    "PeerError",
    "StaleVersionError",
    "SyncTimeoutError",
]


class CheckpointEngineError(RuntimeError):
    """Base class of every error raised by the checkpoint engine."""


class StaleVersionError(CheckpointEngineError):
    """A receiver was offered a weight version older than the one it already holds."""

    def __init__(self, offered: int, held: int) -> None:
        super().__init__(
            f"refusing weight version {offered}: this replica already holds version {held}"
        )
        self.offered = offered
        self.held = held


class ChecksumError(CheckpointEngineError):
    """A bucket arrived with different bytes than were sent."""

    def __init__(self, bucket: int, expected: int, got: int) -> None:
        super().__init__(
            f"checksum mismatch in bucket {bucket}: sent {expected:#x}, received {got:#x}"
        )
        self.bucket = bucket


class PeerError(CheckpointEngineError):
    """The other side went away, broke the protocol, or aborted the sync."""


class SyncTimeoutError(CheckpointEngineError, TimeoutError):
    """A wait ran past its timeout. Also a builtin `TimeoutError`."""
