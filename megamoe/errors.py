"""The error a user fixes: library modules raise it for bad input (a flag, a path, a layout) and the command
line (:mod:`megamoe.cli`) prints it as one ``error:`` line with exit code 1. It lives here, below every other
module, so that no library module imports the launcher."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(ValueError):
    """Bad input a script's user fixes (a flag, a path, a layout): the message says what and how."""
