"""Hugging Face checkpoints stored pre-quantized (GPTQ, AWQ, compressed-tensors ``pack-quantized``)
converted into an ordinary float checkpoint plus the blocks they store (``models.prequantized``).

``convert_quantized_checkpoint(src, dest)`` (called by ``export.checkpoint.prepared_checkpoint``)
writes into ``dest`` only every file of ``src`` that is not a weight file (tokenizer, generation
config, chat template...) and ``config.json`` without its ``quantization_config``, and returns the
checkpoint's tensors (``models.derived``, registered for ``dest``): the float tensors as they are,
read in place from ``src``'s shards, and for each quantized Linear its *dequantized* float32
``<module>.weight`` ``[out, in]`` in place of its integer tensors (biases kept), made from the
module's blocks each time it is read, with those blocks (exact integer codes, scales and zero
points) as ``StoredBlocks``. Every module's blocks are made once during the conversion (one at a
time: that checks the stored values) and dropped. No weight is written and none is held: the
export then writes the very integers the checkpoint stored into ``MatMulNBits``, while
transformers (the reference) and the tracer read the floats, a tensor at a time.

The layouts are read as the libraries that write them lay them out; each format's module
(``gptq``, ``awq``, ``compressed_tensors``) describes its own.

Refused with one line naming the cause (and, for layouts MatMulNBits cannot hold, pointing at
``--quant int4`` on the float checkpoint): bits other than 4 and 8 (AWQ: 4), group sizes that are
not one of MatMulNBits' block sizes (16..256; ``-1`` / per-channel is one block of all K),
act-order, per-module layout overrides, activation or KV-cache quantization, a module listed as
not converted that stores packed tensors. The checkpoint is untrusted input: missing or misshapen
tensors, wrong dtypes, out-of-range ``g_idx``, non-finite scales are one ``GraphkilnError`` line
naming the tensor. Only safetensors are read (never a pickle), and nothing is written outside
``dest``.

FP8 (``fp8``: ``quant_method: fp8`` block-scaled e4m3, compressed-tensors ``float-quantized``,
ModelOpt FP8) and NVFP4 (``nvfp4``: ModelOpt, also read from ``hf_quant_config.json``) store float
values, not integer blocks: their layouts choose integer blocks on conversion (``Layout.request``:
the export's ``--quant`` width, int8 by default), exact where a block's values allow (NVFP4 into
int8 always), else the nearest (``Layout.summary`` reports the error), and keep the stored values
themselves as the float weight (``Layout.weight``).

Modules: ``convert`` (the entry point: plan, check every header and block, write the small
files), ``shards`` (the source's safetensors read one tensor at a time, with plain reads), ``layout`` (what every
format shares: the ``Layout`` base, the readers of quantization_config values, unpacking int32
words), ``patterns`` (module-name patterns quantization_config gives), ``gptq``, ``awq``,
``compressed_tensors``, ``fp8``, ``nvfp4`` (one format each).
"""

from graphkiln.models.hf_quantized.convert import convert_quantized_checkpoint, layout_for

__all__ = ["convert_quantized_checkpoint", "layout_for"]
