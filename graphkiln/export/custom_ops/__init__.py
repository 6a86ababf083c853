"""graphkiln's custom ops: one definition each, every target derived from it.

Each op module (``moe``, ``short_conv``) holds, in one place:
  * ``SPEC`` — name, domain, version, inputs, outputs, attributes and the TensorRT plugin
    identity (torch-free, so the runtime can list known ops without torch);
  * ``reference`` — the torch math, registered as the ``torch.library`` op the model code calls;
  * ``fake`` — output shapes for tracing;
  * ``onnx_function`` — the same math in standard ONNX ops, attached to exported models as a
    model-local function so onnxruntime runs the node with no extra library.

``registry`` derives the rest: the torch.library registration, the exporter's translation
table (one opaque node in the ``graphkiln`` domain carrying ``plugin_namespace`` and
``plugin_version`` so the TensorRT ONNX parser picks the plugin instead of inlining the
function), the ONNX schemas, and attaching the functions after export.
"""
