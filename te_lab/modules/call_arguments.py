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


class ArgumentReader:
    """:func:`named_arguments` for one signature, called per call of a twin: where the
    signature takes its parameters by position or keyword (and maybe ``**kwargs``), a call
    that fits is read with a dict instead of ``Signature.bind`` (a tenth of its cost, which
    counts at one token per step); any other call, one that does not fit included (which
    then raises as ``bind`` does), through :func:`named_arguments`."""

    def __init__(self, signature: inspect.Signature):
        self.signature = signature
        parameters = signature.parameters.values()
        kinds = {parameter.kind for parameter in parameters}
        simple = kinds <= {inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY,
                           inspect.Parameter.VAR_KEYWORD}
        self._positional = tuple(p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD) \
            if simple else None
        self._named = frozenset(p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD)
        self._required = tuple(p.name for p in parameters if p.default is inspect.Parameter.empty
                               and p.kind is not inspect.Parameter.VAR_KEYWORD)
        self._takes_any = inspect.Parameter.VAR_KEYWORD in kinds

    def __call__(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        positional = self._positional
        if positional is None or len(args) > len(positional):
            return named_arguments(self.signature, args, kwargs)
        named = dict(zip(positional, args))
        for name, value in kwargs.items():
            if name in named or not (self._takes_any or name in self._named):
                return named_arguments(self.signature, args, kwargs)
            named[name] = value
        if not all(name in named for name in self._required):
            return named_arguments(self.signature, args, kwargs)
        return named
