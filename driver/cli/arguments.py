"""Argument types shared by gpu-dra's subcommands."""

from __future__ import annotations

import argparse


def positive_seconds(text: str) -> float:
    """A timeout in seconds: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value
