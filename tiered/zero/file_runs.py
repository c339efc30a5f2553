"""Where each element of a parameter comes from in the files: `Run`s of flat file tensors, and
the shapes transformers' merges build from them (symbolic stacks and concatenations), for
[Note: file tensors by transformers' conversions] in tiered/zero/conversions.py."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tiered.errors import WeightsError

MAX_RUNS = 1 << 20
"""A conversion whose layout needs more runs than this (a concatenation along the last
dimension of a large tensor) is refused rather than described element row by element row."""


@dataclass(frozen=True)
class Run:
    """Elements [param_start, param_start + length) of a flat parameter are elements
    [file_start, file_start + length) of the flat file tensor `key`."""

    key: str
    param_start: int
    file_start: int
    length: int


@dataclass(frozen=True)
class TensorSource:
    """Where one parameter (or buffer) of the model comes from in the files."""

    name: str
    """The model's name for it."""
    keys: tuple[str, ...]
    """The file tensors it is made of, in file order of the runs."""
    runs: tuple[Run, ...]
    """Sorted by `param_start`, covering [0, numel) exactly."""
    converted: str | None = None
    """The transformers operations that assembled it ("MergeModulelist(dim=0), Concatenate(dim=1)"),
    None when it is one file tensor under its own (or a renamed) name."""

    def runs_in(self, lo: int, hi: int) -> Iterator[tuple[Run, int, int]]:
        """(run, start, stop) for the part of each run inside parameter elements [lo, hi)."""
        starts = [r.param_start for r in self.runs]
        i = max(0, bisect.bisect_right(starts, lo) - 1)
        while i < len(self.runs) and self.runs[i].param_start < hi:
            r = self.runs[i]
            a, b = max(lo, r.param_start), min(hi, r.param_start + r.length)
            if a < b:
                yield r, a, b
            i += 1


def single(name: str, key: str, numel: int) -> TensorSource:
    """A parameter that is one file tensor, element for element."""
    return TensorSource(name, (key,), (Run(key, 0, 0, numel),))


class Node:
    shape: tuple[int, ...]

    def boxes(self) -> Iterator[tuple[str, list[int], list[int]]]:
        """(file key, start, extent) per leaf, in this node's coordinates."""
        raise NotImplementedError


class Leaf(Node):
    def __init__(self, key: str, shape: tuple[int, ...]) -> None:
        self.key, self.shape = key, shape

    def boxes(self) -> Iterator[tuple[str, list[int], list[int]]]:
        yield self.key, [0] * len(self.shape), list(self.shape)


def no_file(key: str) -> str:
    return ""


class Stack(Node):
    def __init__(self, dim: int, parts: list[Node], what: str, at: Callable[[str], str] = no_file) -> None:
        first = parts[0].shape
        for p in parts[1:]:
            if p.shape != first:
                a, b = next(parts[0].boxes())[0], next(p.boxes())[0]
                raise WeightsError(
                    f"{what}: experts of unequal shapes, {a}{at(a)} is {first} but {b}{at(b)} is {p.shape}; transformers "
                    "stacks them into one tensor, so every expert must have the same shape"
                )
        self.dim = dim % (len(first) + 1)
        self.parts = parts
        self.shape = (*first[: self.dim], len(parts), *first[self.dim :])

    def boxes(self) -> Iterator[tuple[str, list[int], list[int]]]:
        for i, part in enumerate(self.parts):
            for key, start, ext in part.boxes():
                yield (
                    key,
                    [*start[: self.dim], i, *start[self.dim :]],
                    [*ext[: self.dim], 1, *ext[self.dim :]],
                )


class Cat(Node):
    def __init__(self, dim: int, parts: list[Node], what: str, at: Callable[[str], str] = no_file) -> None:
        first = parts[0].shape
        self.dim = dim % len(first)
        for p in parts[1:]:
            if len(p.shape) != len(first) or any(
                a != b for k, (a, b) in enumerate(zip(p.shape, first, strict=True)) if k != self.dim
            ):
                a, b = next(parts[0].boxes())[0], next(p.boxes())[0]
                raise WeightsError(
                    f"{what}: {a}{at(a)} ({first}) and {b}{at(b)} ({p.shape}) cannot be concatenated along dimension "
                    f"{self.dim}, as transformers does for this family; do the weights belong to this config.json?"
                )
        self.parts = parts
        self.shape = (*first[: self.dim], sum(p.shape[self.dim] for p in parts), *first[self.dim + 1 :])

    def boxes(self) -> Iterator[tuple[str, list[int], list[int]]]:
        off = 0
        for part in self.parts:
            for key, start, ext in part.boxes():
                moved = list(start)
                moved[self.dim] += off
                yield key, moved, ext
            off += part.shape[self.dim]


def runs_of(node: Node, what: str) -> tuple[Run, ...]:
    """The flat runs of every leaf of `node` (row-major in both the file tensor and the result)."""
    shape = node.shape
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    out: list[Run] = []
    for key, start, ext in node.boxes():
        j = len(shape) - 1  # the outermost dimension from which on the box is whole
        while j > 0 and start[j] == 0 and ext[j] == shape[j]:
            j -= 1
        length = ext[j] * strides[j]
        if length == 0:
            continue
        outer = [range(start[i], start[i] + ext[i]) for i in range(j)]
        n_runs = math.prod(len(r) for r in outer)
        if len(out) + n_runs > MAX_RUNS:
            raise WeightsError(
                f"{what}: transformers assembles it from its files in pieces of {length} elements, too many "
                f"to stream ({n_runs} for {key}); loading this family's weights is not supported"
            )
        file_off = 0
        for idx in _product(outer):
            p = sum(i * s for i, s in zip(idx, strides, strict=False)) + start[j] * strides[j]
            out.append(Run(key, p, file_off, length))
            file_off += length
    out.sort(key=lambda r: r.param_start)
    return tuple(out)


def _product(ranges: list[range]) -> Iterator[tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (i, *rest)
