"""The one exception type the converter raises for bad input (files, configs, layouts, options)."""

from __future__ import annotations

__all__ = ["ConversionError"]


class ConversionError(ValueError):
    """Input the converter cannot use: the message says what is wrong, where, and how to fix it.

    The CLI turns it (and the format's / adapters' own errors) into a one-line message and a non-zero
    exit code instead of a traceback.
    """
