"""Errors of the engine's model loading that callers catch by type (the CLI names them in one line)."""

from __future__ import annotations


class WeightError(ValueError):
    """Weights that do not fit the model: missing, unexpected or wrongly shaped."""
