"""The one exception type for anything wrong with a model file, directory or name."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model could not be found or read; the message says what is wrong and what to do about it."""
