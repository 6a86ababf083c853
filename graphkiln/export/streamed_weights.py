"""Graph initializers whose bytes come from the checkpoint when they are written (the streamed export).

The traced graph holds real weights for one layer of each kind only (``export.layer_stamping``); the
embedding and head are placeholders and the other layers are never loaded. Every weight the graph
declares is a ``StreamedWeight``: an ``onnx_ir`` lazy tensor that reads its decoder parameter through
``models.weights.CheckpointWeights`` (the checkpoint's tensors, folds, dtype) and applies the
exporter's transform (the transposed ``<name>.T`` layout of a Linear weight, or a reshape), each time
it is asked, keeping nothing. Writers visit them in layer order, so ``CheckpointWeights.layer`` holds
one layer at a time.

A pass that quantizes a weight reads its parameter's rows (``rows``) instead of the transposed tensor:
the ``[N, K]`` parameter is what block quantization wants, and rows of the embedding or head table are
read from the file a band at a time (``CheckpointWeights.read_rows``), never the whole table in fp32.
"""

from __future__ import annotations

import numpy as np

# Rows of a large table (the embedding, the head) read per band when it is written or quantized.
BAND_BYTES = 64 << 20


def _numpy(t) -> np.ndarray:
    """A torch tensor's memory as numpy, without a copy (bfloat16 through ml_dtypes)."""
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _ir_dtype(torch_dtype):
    import onnx_ir as ir
    import torch

    return {torch.float32: ir.DataType.FLOAT, torch.float16: ir.DataType.FLOAT16,
            torch.bfloat16: ir.DataType.BFLOAT16}[torch_dtype]


def _streamed_weight_class():
    import onnx_ir as ir

    class StreamedWeight(ir.LazyTensor):
        """A decoder parameter as the graph stores it (``transform``: None, "T" or ("reshape", shape)),
        read from the checkpoint each time it is evaluated (not cached)."""

        def __init__(self, weights, param: str, transform, shape: tuple[int, ...], name: str) -> None:
            self.weights, self.param, self.transform = weights, param, transform
            super().__init__(self._make, dtype=_ir_dtype(weights.dtype), shape=ir.Shape(shape), name=name, cache=False)

        @property
        def param_shape(self) -> tuple[int, ...]:
            """The decoder parameter's shape (a module's folded parameter, mamba2's A, has the
            graph tensor's)."""
            shape = self.weights.shapes.get(self.weights._own(self.param))
            if shape is not None:
                return shape
            return tuple(self.shape)[::-1] if self.transform == "T" else tuple(self.shape)

        def _param(self) -> np.ndarray:
            layer = _layer_index(self.param)
            if layer is not None and layer in range(self.weights.cfg.num_layers):
                module = self.weights.layer(layer)
                local = self.param.split(".", 3)[3]  # model.layers.<i>.<local>
                return _numpy(module.get_parameter(local))
            return self._whole()

        def _whole(self) -> np.ndarray:
            shape = self.param_shape
            if len(shape) != 2:
                return _numpy(self.weights.read(self.param))
            out = None
            for start, band in self.rows():
                if out is None:
                    out = np.empty(shape, dtype=band.dtype)
                out[start:start + band.shape[0]] = band
            return out

        def rows(self, band_bytes: int = BAND_BYTES):
            """(first row, rows) bands of the ``[N, K]`` parameter, in order (2-D parameters only)."""
            n, k = self.param_shape
            itemsize = self.weights.dtype.itemsize
            step = max(1, band_bytes // max(1, k * itemsize))
            layer = _layer_index(self.param)
            if layer is not None:  # a layer's weights are in memory with their layer: slice them
                whole = self._param()
                for start in range(0, n, step):
                    yield start, whole[start:start + step]
                return
            self.weights.release()  # a table comes after the layers: let the last one go first
            for start in range(0, n, step):
                yield start, _numpy(self.weights.read_rows(self.param, start, min(n, start + step)))

        def pieces(self, band_bytes: int = BAND_BYTES):
            """The tensor as the graph stores it, as consecutive bands of its rows (numpy arrays, maybe
            strided): what a writer writes one after the other. A layer's weight is one piece (its
            layer is in memory); a table is read a band at a time, and a transposed table (an untied
            head) from its stored bytes, converted a band at a time."""
            if _layer_index(self.param) is not None or self.transform not in (None, "T") or len(self.param_shape) != 2:
                yield self._make().numpy()
                return
            shape = self.param_shape
            if self.transform is None:
                for _, band in self.rows(band_bytes):
                    yield band
                return
            self.weights.release()
            stored = self.weights.read_stored(self.param)  # [N, K] in the checkpoint's dtype
            n, k = shape
            step = max(1, band_bytes // max(1, n * self.weights.dtype.itemsize))
            for start in range(0, k, step):
                yield _numpy(stored[:, start:start + step].to(self.weights.dtype).T.contiguous())

        def _make(self):
            arr = self._param()
            if self.transform == "T":
                arr = arr.T
            elif self.transform is not None:
                arr = arr.reshape(self.transform[1])
            return ir.Tensor(arr, name=self.name)

    return StreamedWeight


_CLASS = None


def streamed_weight(weights, param: str, transform, shape, name: str):
    """A ``StreamedWeight`` for ``param`` (see the module docstring)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _streamed_weight_class()
    return _CLASS(weights, param, transform, tuple(shape), name)


def is_streamed(tensor) -> bool:
    return _CLASS is not None and isinstance(tensor, _CLASS)


def _layer_index(param: str) -> int | None:
    parts = param.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None
