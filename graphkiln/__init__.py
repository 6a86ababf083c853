"""graphkiln: turn Hugging Face checkpoints into self-contained ONNX deployments.

Running an artifact needs only onnxruntime, numpy and tokenizers (``graphkiln.runtime``);
exporting one needs the ``export`` extra (torch, transformers, onnx, onnxscript).
"""

__version__ = "0.1.0"
