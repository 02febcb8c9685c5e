"""``torch.compile`` without dynamo's guards, for callers that check their inputs,
and how far a compiled graph's result strays from the eager one's.

Dynamo checks a compiled graph's assumptions about its inputs (shapes,
dtypes, the identity of captured tensors) before every call: over the
hundreds of weight tensors of a decode graph that cost 0.75 ms a call, and
over the five tensors of a layer's decode attention about 0.25 ms (with
inductor's size asserts). The CPU's compiled decode paths call their graphs
only with inputs of the shapes they were traced for (their own ``fits``),
so they skip both.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch


def compile_unguarded(function: Callable[..., Any], bound_to: object | None = None) -> Any:
    """``function`` (a method of ``bound_to``, if given) compiled whole (a graph
    break fails the compile rather than slowing it silently), its shapes static
    but for those marked dynamic at the first call, run without guards."""
    own = _with_own_code(function)
    target = own if bound_to is None else types.MethodType(own, bound_to)
    return torch.compile(
        target,
        fullgraph=True,
        dynamic=False,
        options={
            "guard_filter_fn": torch.compiler.skip_all_guards_unsafe,
            # Checks of every input's sizes and strides at each call.
            "size_asserts": False,
        },
    )


def _with_own_code(function: Callable[..., Any]) -> types.FunctionType:
    """A copy of ``function`` with a code object of its own. Dynamo keeps its graphs
    per code object and, with the guards skipped, would run the first compile's
    graph (its weights, its shapes) for every later caller."""
    assert isinstance(function, types.FunctionType)
    return types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )


def max_relative_error(compiled: torch.Tensor, eager: torch.Tensor) -> float:
    """The largest difference between the two, relative to the largest eager value
    (NaN where either holds one: a bound check ``error <= bound`` then fails)."""
    return float((compiled - eager).abs().max() / eager.abs().max().clamp_min(1e-30))
