"""The exception types the checkpoint tools raise: bad input to a conversion, and checkpoints that
cannot be used."""

from __future__ import annotations

__all__ = ["ConversionError", "CheckpointError"]


class ConversionError(ValueError):
    """Input the converter cannot use: the message says what is wrong, where, and how to fix it.

    The CLI turns it (and the format's / adapters' own errors) into a one-line message and a non-zero
    exit code instead of a traceback.
    """


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt, or does not match what was asked of it.

    Defined here rather than in :mod:`megamoe.checkpoint.format` (which re-exports it) so that the modules
    format.py builds on can raise it too.
    """
