"""Trace a vision-language model's vision graph spec (``models.vision`` contract) into ONNX.

Plain ONNX ops only (transformers' tower with eager attention, the projector), so the one
graph serves every target; it is recorded as target "portable". Written like the decoder
(``external_data.save_model``: weights checked finite, IR version pinned).
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
from graphkiln.models.vision import VisionConfig


def vision_io(vcfg: VisionConfig, hidden: int, dtype: str) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    h, w = vcfg.image_size
    return ((TensorSpec("pixel_values", "float32", ("images", 3, h, w), "pixel_values"),),
            (TensorSpec("image_embeddings", dtype, ("image_rows", hidden), "image_embeddings"),))


def export_vision(module: torch.nn.Module, vcfg: VisionConfig, hidden: int, dtype: str, out_dir: Path, opset: int,
                  file_name: str = "vision.onnx") -> GraphSpec:
    from graphkiln.export.external_data import save_model
    from graphkiln.export.onnx_export import IR_FOR_OPSET

    if hasattr(module, "graph_io"):  # a graph with its own inputs (models.vision)
        ins, outs, args, dynamic = module.graph_io(hidden, dtype)
    else:
        ins, outs = vision_io(vcfg, hidden, dtype)
        h, w = vcfg.image_size
        args = (torch.rand(2, 3, h, w),)  # 2 images: not 0 or 1, so the images axis stays dynamic
        dynamic = ({0: Dim("images")},)
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    log = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(log), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(module, args, dynamo=True, input_names=[t.name for t in ins],
                                        output_names=[t.name for t in outs], dynamic_shapes=dynamic,
                                        opset_version=opset, external_data=True, optimize=True)
    except Exception as exc:
        raise GraphkilnError(f"ONNX export of the vision graph failed ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:200]}): report this with the checkpoint's config.json") from exc
    program.model.ir_version = IR_FOR_OPSET[opset]
    program.model.producer_name = "graphkiln"
    save_model(program.model, out_dir / file_name)
    return GraphSpec("vision", file_name, ins, outs, opset)
