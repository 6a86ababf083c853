"""The export faces of graphkiln's custom ops (defined in ``graphkiln.ops``).

``registry`` derives them from each op's one definition: the torch.library registration,
the exporter's translation table (one opaque node in the ``graphkiln`` domain carrying
``plugin_namespace`` and ``plugin_version`` so the TensorRT ONNX parser picks the plugin
instead of inlining the function), the ONNX schemas, and attaching the functions after export.
"""
