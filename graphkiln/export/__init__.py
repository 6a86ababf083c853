"""Export: Hugging Face checkpoint -> graph specs -> ONNX -> artifact directory.

Needs the ``export`` extra (torch, transformers, safetensors, onnx, onnxscript).
Entry point: ``graphkiln.export.pipeline.export_model``.
"""
