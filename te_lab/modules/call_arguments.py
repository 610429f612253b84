"""Reading a call's arguments by name, whatever order the caller passed them in."""

from __future__ import annotations

import inspect
from typing import Any, Callable


def forward_signature(fn: Callable) -> inspect.Signature:
    # inspect follows functools.wraps, so decorated forwards (Hugging Face's
    # deprecate_kwarg) show their real parameters.
    return inspect.signature(fn)


def named_arguments(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Every argument of the call by parameter name; ``**kwargs`` entries are merged in.

    Raises ``TypeError`` when the call does not fit the signature (as calling would).
    """
    bound = signature.bind(*args, **kwargs)
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                named[name] = value
        else:
            named[name] = value
    return named


def accepts(signature: inspect.Signature, name: str) -> bool:
    """Whether a call may pass ``name`` as a keyword."""
    parameter = signature.parameters.get(name)
    if parameter is not None:
        return parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
