"""Hugging Face checkpoints stored pre-quantized (GPTQ, AWQ, compressed-tensors ``pack-quantized``)
converted into an ordinary float checkpoint plus the blocks they store (``models.prequantized``).

``convert_quantized_checkpoint(src, dest)`` (called by ``export.checkpoint.prepared_checkpoint``)
writes into ``dest``: every file of ``src`` that is not a weight file (tokenizer, generation
config, chat template...), ``config.json`` without its ``quantization_config``, the float tensors
as they are, and for each quantized Linear its *dequantized* float32 ``<module>.weight`` ``[out,
in]`` in place of its integer tensors (biases kept), plus the sidecar holding those weights' exact
integer codes, scales and zero points. The export then writes the very integers the checkpoint
stored into ``MatMulNBits``, while transformers (the reference) and the tracer read the floats.

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

Modules: ``convert`` (the entry point: plan, check every header, write), ``shards`` (the source's
safetensors read one tensor at a time; the converted shards written), ``layout`` (what every
format shares: the ``Layout`` base, the readers of quantization_config values, unpacking int32
words), ``patterns`` (module-name patterns quantization_config gives), ``gptq``, ``awq``,
``compressed_tensors``, ``fp8``, ``nvfp4`` (one format each).
"""

from graphkiln.models.hf_quantized.convert import convert_quantized_checkpoint, layout_for

__all__ = ["convert_quantized_checkpoint", "layout_for"]
