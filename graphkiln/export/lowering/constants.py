"""Constant nodes a lowering pass adds: the one helper every pass shares.

Invariant: one Constant node per (value, dtype, shape) per pool, so a pass that asks for the
same axis or epsilon a hundred times adds it once; a value's shape is its own (a Python scalar
is a 0-d tensor, a list a 1-d one). A node is named as its output, so names stay unique. The pool appends each new node to the list it was given, so
the pass decides where its constants go (first in the graph, or inline before their readers).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import count

import numpy as np
from onnx import helper, numpy_helper


class Constants:
    """``consts(value, dtype) -> name``: the name of a Constant node holding ``value``.

    ``dtype`` is a numpy dtype or an ONNX ``TensorProto`` element type; ``fresh(tag)`` names a
    new node's output (and must never return a name already in the graph)."""

    def __init__(self, nodes: list, fresh: Callable[[str], str]) -> None:
        self.nodes = nodes
        self._fresh = fresh
        self._by_value: dict[tuple, str] = {}

    def __call__(self, value, dtype=np.int64, tag: str = "const") -> str:
        if isinstance(dtype, int):
            dtype = helper.tensor_dtype_to_np_dtype(dtype)
        arr = np.asarray(value, dtype=dtype)
        key = (arr.tobytes(), arr.dtype.str, arr.shape)
        if key not in self._by_value:
            name = self._fresh(tag)
            self.nodes.append(helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(arr, name)))
            self._by_value[key] = name
        return self._by_value[key]


def numbered(prefix: str) -> Callable[[str], str]:
    """``fresh`` for a pass whose constants are ``{prefix}.0``, ``{prefix}.1``, ...: names the
    pass's own prefix keeps apart from the graph's."""
    n = count()
    return lambda _tag: f"{prefix}.{next(n)}"
