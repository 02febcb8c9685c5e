"""``torch.compile`` without dynamo's guards, its inputs checked at the boundary
instead, and how far a compiled graph's result strays from the eager one's.

Dynamo checks a compiled graph's assumptions about its inputs (shapes,
dtypes, strides, the identity of captured tensors) before every call: over
the hundreds of weight tensors of a decode graph that cost 0.75 ms a call,
and over the five tensors of a layer's decode attention about 0.25 ms (with
inductor's size asserts). The CPU's compiled decode paths skip them, and
``UnguardedGraph`` checks in their place what the graph was compiled for,
tensor by tensor: dtype, device, rank, row-major strides and every size (a
range where the size is dynamic). A graph traced on contiguous inputs and
handed a strided view reads the wrong elements without a word (a split
view of the fused q/k tensor once gave every request but the first another
request's queries), so a call that does not match raises
``GraphInputError`` rather than run.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

# Per input (by position), per dimension: the (min, max) it may take; every
# dimension not named is static, fixed at the first call's size.
DynamicDims = Mapping[int, Mapping[int, tuple[int, int]]]


class GraphInputError(RuntimeError):
    """A call of a compiled graph with inputs unlike those it was compiled for."""


@dataclass(frozen=True)
class TensorSpec:
    """What one input of a graph was compiled for (contiguous, row-major)."""

    dtype: torch.dtype
    device: torch.device
    sizes: tuple[tuple[int, int], ...]  # (min, max) per dimension; equal where static

    def mismatch(self, tensor: torch.Tensor) -> str | None:
        """Why ``tensor`` is not an input this spec describes, or None."""
        if tensor.dtype != self.dtype or tensor.device != self.device:
            return f"{tensor.dtype} on {tensor.device}, compiled for {self.dtype} on {self.device}"
        shape = tensor.shape
        if len(shape) != len(self.sizes) or not all(
            low <= size <= high for size, (low, high) in zip(shape, self.sizes, strict=True)
        ):
            return f"shape {tuple(shape)}, compiled for {self.sizes}"
        if not tensor.is_contiguous():
            return f"strides {tensor.stride()} of shape {tuple(shape)}: not contiguous"
        return None


class UnguardedGraph:
    """``function`` compiled whole at its first call (a graph break fails the
    compile rather than slowing it silently), run without dynamo's guards; every
    call, the first included, takes contiguous tensors only and checks them
    against what the first call compiled (``TensorSpec``)."""

    def __init__(
        self,
        function: Callable[..., Any],
        bound_to: object | None = None,
        dynamic: DynamicDims | None = None,
    ) -> None:
        """``function`` (a method of ``bound_to``, if given) takes tensors only;
        ``dynamic`` names the sizes that may change from call to call."""
        self._compiled = _compile_unguarded(function, bound_to)
        self._dynamic = dynamic or {}
        self.specs: tuple[TensorSpec, ...] | None = None

    def __call__(self, *tensors: torch.Tensor) -> Any:
        """The compiled function of ``tensors``; GraphInputError if they are not what
        it was compiled for."""
        if self.specs is None:
            self.specs = self._first_call_specs(tensors)
        elif len(tensors) != len(self.specs):
            raise GraphInputError(f"{len(tensors)} inputs, compiled for {len(self.specs)}")
        for index, (tensor, spec) in enumerate(zip(tensors, self.specs, strict=True)):
            reason = spec.mismatch(tensor)
            if reason is not None:
                raise GraphInputError(f"input {index}: {reason}")
        return self._compiled(*tensors)

    def _first_call_specs(self, tensors: tuple[torch.Tensor, ...]) -> tuple[TensorSpec, ...]:
        specs = []
        for index, tensor in enumerate(tensors):
            ranges = self._dynamic.get(index, {})
            for dim, (low, high) in ranges.items():
                torch._dynamo.mark_dynamic(tensor, dim, min=low, max=high)
            sizes = tuple(ranges.get(dim, (size, size)) for dim, size in enumerate(tensor.shape))
            specs.append(TensorSpec(tensor.dtype, tensor.device, sizes))
        return tuple(specs)


def _compile_unguarded(function: Callable[..., Any], bound_to: object | None = None) -> Any:
    """``function`` (a method of ``bound_to``, if given) compiled whole, its shapes
    static but for those marked dynamic at the first call, run without guards: its
    callers must check their inputs (``UnguardedGraph`` does)."""
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
