"""The options that te_lab's API, its command line and its magics share, checked in one
place so each means the same everywhere: ``steps`` (``"auto"`` or at least 1), ``warmup``
(0 or more), ``budget_s`` (seconds, above 0) and ``backend`` (``"auto"`` or a backend's name).

Each check raises ``ValueError`` naming the caller and the option; :func:`argument_type`
turns one into an argparse type (the CLI's and the magics' parsers report it as a usage
error naming the option).
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

from te_lab.kernels.registry import BACKENDS

BACKEND_CHOICES = ("auto",) + BACKENDS


def check_steps(value, caller: str):
    """``"auto"`` (as many as the profile's interval needs) or a positive integer."""
    if value == "auto":
        return value
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{caller}: steps must be a positive integer or 'auto', got {value!r}")
    return value


def check_budget(value, caller: str) -> float:
    """Seconds a profile may spend on timed steps with ``steps="auto"``: a number above 0."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or value == float("inf"):
        raise ValueError(f"{caller}: budget_s must be a positive number of seconds, got {value!r}")
    return float(value)


def check_warmup(value, caller: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{caller}: warmup must be a non-negative integer, got {value!r}")
    return value


def check_backend(value, caller: str) -> Optional[str]:
    """The backend forced on every fused op, or ``None`` for ``"auto"`` (and ``None``)."""
    if value is None or value == "auto":
        return None
    if value not in BACKENDS:
        raise ValueError(f"{caller}: backend must be one of {', '.join(BACKEND_CHOICES)}, got {value!r}")
    return value


KEEP_CHOICES = ("faster", "all")


def check_keep(value, caller: str) -> str:
    """Which verified swaps ``fuse`` keeps running fused: ``"faster"`` (a twin steps aside
    at sizes where the original measured faster) or ``"all"``."""
    if value not in KEEP_CHOICES:
        raise ValueError(f"{caller}: keep must be one of {', '.join(map(repr, KEEP_CHOICES))}, got {value!r}")
    return value


def argument_type(check: Callable) -> Callable[[str], int]:
    """An argparse ``type`` for a numeric option checked by ``check``: the parser's
    message then reads ``argument --steps: steps must be a positive integer or 'auto',
    got '0'``."""
    def parse(text: str) -> int:
        try:
            number = int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                number = text
        try:
            return check(number, "")
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error).removeprefix(": ")) from None
    parse.__name__ = check.__name__.removeprefix("check_")  # argparse names the type in its messages
    return parse
