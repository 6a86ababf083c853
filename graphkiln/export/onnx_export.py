"""Trace one graph spec (the decoder) of a loaded model into an ONNX file.

The graph contract is documented in ``graphkiln.models.decoder``; this module adds the
names, symbolic shapes and roles that the manifest records for it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

import torch
from torch.export import Dim

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import GraphSpec, TensorSpec
from graphkiln.models.decoder import DecoderForExport

# The IR version each opset first appeared with; pinned because newer onnx writes IR
# versions that deployed onnxruntime builds (e.g. onnxruntime-gpu 1.31: IR <= 13) refuse.
IR_FOR_OPSET = {18: 8, 19: 9, 20: 9, 21: 10, 22: 10, 23: 11}
SUPPORTED_OPSETS = tuple(IR_FOR_OPSET)
NP_DTYPE = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def decoder_io(num_layers: int, kv_heads: int, head_dim: int, vocab: int, dtype: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
    ins = [
        TensorSpec("input_ids", "int64", ("batch", "seq"), "input_ids"),
        TensorSpec("position_ids", "int64", ("batch", "seq"), "position_ids"),
        TensorSpec("logits_index", "int64", ("batch", "n_logits"), "logits_index"),
    ]
    outs = [TensorSpec("logits", "float32", ("batch", "n_logits", vocab), "logits")]
    for i in range(num_layers):
        for kv in ("key", "value"):
            ins.append(TensorSpec(f"past_{kv}.{i}", dtype, ("batch", kv_heads, "cache_len", head_dim), f"past_{kv}", i))
            outs.append(TensorSpec(f"new_{kv}.{i}", dtype, ("batch", kv_heads, "seq", head_dim), f"new_{kv}", i))
    return ins, outs


def export_decoder(model: DecoderForExport, out_dir: Path, opset: int, file_name: str = "decoder.onnx") -> GraphSpec:
    if opset not in IR_FOR_OPSET:
        raise GraphkilnError(f"--opset {opset} is not supported: choose one of {', '.join(map(str, SUPPORTED_OPSETS))}")
    cfg = model.cfg
    dtype = model.lm_head.weight.dtype
    ins, outs = decoder_io(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, NP_DTYPE[dtype])

    # Example sizes avoid 0 and 1 so torch.export does not specialise the dynamic axes.
    b, s, c, n = 2, 3, 5, 2
    past = tuple(torch.zeros(b, cfg.num_kv_heads, c, cfg.head_dim, dtype=dtype) for _ in range(2 * cfg.num_layers))
    args = (
        torch.zeros(b, s, dtype=torch.long),
        torch.arange(s).expand(b, s).contiguous(),
        torch.zeros(b, n, dtype=torch.long),
        *past,
    )
    batch, seq, cache, n_logits = Dim("batch"), Dim("seq"), Dim("cache_len"), Dim("n_logits")
    dynamic = (
        {0: batch, 1: seq},
        {0: batch, 1: seq},
        {0: batch, 1: n_logits},
        tuple({0: batch, 2: cache} for _ in past),
    )
    # The exporter logs a warning per torchvision op it cannot register; irrelevant here.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    log = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(log), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                model,
                args,
                dynamo=True,
                input_names=[t.name for t in ins],
                output_names=[t.name for t in outs],
                dynamic_shapes=dynamic,
                opset_version=opset,
                external_data=True,
                optimize=True,
            )
    except Exception as exc:
        raise GraphkilnError(
            f"ONNX export failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}): "
            "report this with the checkpoint's config.json"
        ) from exc
    program.model.ir_version = IR_FOR_OPSET[opset]
    program.model.producer_name = "graphkiln"
    program.save(str(out_dir / file_name), external_data=True)
    del program
    return GraphSpec("decoder", file_name, tuple(ins), tuple(outs), opset)
