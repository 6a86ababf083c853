"""LoRA adapters at run time: read PEFT adapter directories and keep them in fixed slots.

An artifact exported with ``--lora-rank R --max-loras N`` takes, per targeted projection of each
layer, an A stack ``[N+1, in, R]`` and a B stack ``[N+1, R, out]`` as graph inputs, plus
``lora_rows`` / ``lora_slots`` naming the rows that use an adapter and their slots: such a row's
projection is ``base(x) + (x @ A[slot]) @ B[slot]``. Slot 0 is all zeros ("no adapter"); slots 1..N hold
loaded adapters. B is pre-scaled (lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA) and an
adapter of rank r < R fills the first r columns of A / rows of B, the rest zero, so padding adds
exactly nothing.

One job per module:

* ``targets``: the vocabulary the others share: the projections (``MODULES``), where PEFT finds
  them (``LLAMA_MODULE_PATHS``), one projection the artifact takes stacks for (``LoraTarget``),
  and the rule for what an adapter may be called (``check_adapter_name``: the pool, ``serve
  --lora`` and the load route apply the same one).
* ``adapter_dir``: the user-named directory and its files, opened under ``graphkiln.untrusted``'s
  rules (non-blocking, regular files only, bounded); every refusal is one line naming the adapter.
* ``peft_config``: ``adapter_config.json``: a plain LoRA graphkiln can apply exactly, and its
  per-module rank and scale.
* ``safetensors_index``: ``adapter_model.safetensors`` read with json + numpy (an 8-byte header
  length, a JSON header, raw little-endian bytes): the header bounded by what the artifact's
  slots can hold before it is parsed, every entry checked against the file, tensors read as
  float32. Not ``safetensors.numpy``: numpy has no bfloat16, which is how many adapters are
  stored, and the runtime keeps to numpy + onnxruntime.
* ``peft_reader``: ``read_peft_adapter``: the directory validated completely against the
  artifact's targets and turned into per-target (A, B) float32 pairs before anything is written
  anywhere. Pickled adapters are never opened.
* ``pool``: ``AdapterPool``: owns the stacks the engine binds as graph inputs (their size checked
  against available memory first), the slot table (which adapter is in which slot, how many
  queued or running requests hold it, when it was last used) and LRU replacement.

Torch-free by design (``graphkiln.runtime`` must run with numpy + onnxruntime only). The names
below are the package's API.
"""

from graphkiln.runtime.lora.peft_reader import read_peft_adapter
from graphkiln.runtime.lora.pool import AdapterPool
from graphkiln.runtime.lora.targets import LLAMA_MODULE_PATHS, MODULES, LoraTarget, check_adapter_name

__all__ = ["AdapterPool", "LLAMA_MODULE_PATHS", "LoraTarget", "MODULES", "check_adapter_name", "read_peft_adapter"]
