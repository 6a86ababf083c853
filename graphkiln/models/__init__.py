"""Model families: HF config -> DecoderConfig -> export-friendly torch modules -> weights.

Families register themselves in ``registry``; look one up with ``registry.family_for``.
Importing this package does not import torch; ``decoder`` and ``weights`` do.
"""
