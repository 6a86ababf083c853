"""TensorRT plugins for graphkiln's custom ops (``graphkiln.ops``).

Each op becomes a ``tensorrt.plugin`` (Python-defined, "quickly deployable") plugin whose
Triton kernels are compiled ahead of time to PTX (``kernels/``), so an engine built with
them runs without Python. Everything but the few TensorRT calls imports and is tested
without TensorRT; ``tensorrt`` is imported lazily, only when plugins are registered for an
engine build, and never by code the CPU test suite imports at module level.

Layout: ``kernels/`` (the Triton kernels, ``aot`` compilation and launch plans), ``rules``
(every plugin decision as a plain function: identity and signatures from each op's SPEC,
output shapes/dtypes/aliasing, autotune combinations, tactics, launch parameters; tested on
CPU) and ``register`` (``register_plugins()``: hands the rules to ``tensorrt.plugin``; needs
TensorRT and a GPU, never run by the test suite).
"""
