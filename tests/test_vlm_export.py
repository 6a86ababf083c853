"""Vision-language export: the vision graph spec beside the decoder, and the decoder's seam.

The graphs are run here with onnxruntime directly (the Engine's image path is tested in
test_vlm_runtime.py): the vision graph against transformers' ``get_image_features`` on the
same pixel values, and the decoder with the image rows scattered in against transformers'
whole model, for CLIP (CLS dropped, penultimate layer) and SigLIP (two feature layers) towers.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest

from cli_contract import assert_nothing_written, assert_one_error, run_cli
from conftest import VLM_SPECS
from reference import ATOL

VLM_CASES = tuple(VLM_SPECS)


@pytest.fixture(scope="module", params=VLM_CASES)
def vlm(request, tiny):
    return tiny(request.param, "onnxruntime")


@pytest.fixture(scope="module")
def vlm_reference(vlm):
    import torch
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(str(vlm.checkpoint), dtype=torch.float32).eval()


def _pixels(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 32, 32)).astype(np.float32)


def _session(vlm, file: str) -> ort.InferenceSession:
    return ort.InferenceSession(str(vlm.artifact / file), providers=["CPUExecutionProvider"])


def test_manifest_describes_the_vision_graph(vlm):
    m = vlm.manifest
    assert [(g.name, g.file) for g in m.graphs] == [("decoder", "decoder.onnx"), ("vision", "vision.onnx")]
    vision = m.graph("vision")
    assert [(t.name, t.role, t.shape) for t in vision.inputs] == [("pixel_values", "pixel_values", ("images", 3, 32, 32))]
    assert [(t.role, t.shape) for t in vision.outputs] == [("image_embeddings", ("image_rows", 64))]
    seam = {t.role: t.shape for t in m.graph("decoder").inputs if t.role.startswith("vision_")}
    assert seam == {"vision_embeddings": ("vision_rows", 64), "vision_scatter_indices": ("vision_rows",)}
    spec = VLM_SPECS[vlm.spec.name]
    assert m.vision.image_token_id == spec.config["image_token_index"]
    # 16 patches; CLIP's CLS dropped by the "default" strategy, SigLIP has none
    assert m.vision.placeholder.num_tokens((32, 32)) == 16
    assert m.vision.preprocessing.output_size == (32, 32)


def test_vision_graph_matches_transformers(vlm, vlm_reference):
    import torch

    px = _pixels(3, seed=1)
    ours = _session(vlm, "vision.onnx").run(None, {"pixel_values": px})[0]
    with torch.no_grad():
        ref = torch.cat(list(vlm_reference.model.get_image_features(pixel_values=torch.from_numpy(px)).pooler_output))
    assert ours.shape == (48, 64)
    assert np.abs(ours - ref.numpy()).max() <= ATOL


def _decoder_feeds(vlm, ids: np.ndarray, rows: np.ndarray, indices: np.ndarray) -> dict:
    b, s = ids.shape
    feeds = {"input_ids": ids, "position_ids": np.tile(np.arange(s), (b, 1)).astype(np.int64),
             "logits_index": np.tile(np.arange(s), (b, 1)).astype(np.int64),
             "vision_embeddings": rows, "vision_scatter_indices": indices.astype(np.int64)}
    for t in vlm.manifest.graph("decoder").inputs:
        if t.role == "seq_lens":
            feeds[t.name] = np.full(b, s, np.int64)
        elif t.role == "total_sequence_length":
            feeds[t.name] = np.array(s, np.int32)
        elif t.layer is not None:
            feeds[t.name] = np.zeros((b, t.shape[1], s, t.shape[3]), np.float32)
    return feeds


def test_decoder_seam_matches_transformers(vlm, vlm_reference):
    """Two images in one prompt: the image rows land at the placeholders, the logits are the
    reference's at every position; and zero rows with no placeholders is the text-only model."""
    import torch

    tok = vlm.manifest.vision.image_token_id
    px = _pixels(2, seed=2)
    rows = _session(vlm, "vision.onnx").run(None, {"pixel_values": px})[0]
    ids = np.array([[5, 6] + [tok] * 16 + [7, 8, 9] + [tok] * 16 + [10]], np.int64)
    decoder = _session(vlm, "decoder.onnx")
    logits = decoder.run(["logits"], _decoder_feeds(vlm, ids, rows, np.nonzero(ids[0] == tok)[0]))[0]
    with torch.no_grad():
        ref = vlm_reference(input_ids=torch.from_numpy(ids), pixel_values=torch.from_numpy(px)).logits.numpy()
    assert np.abs(logits - ref).max() <= ATOL
    text = np.array([[5, 6, 7, 8, 9, 11, 12]], np.int64)
    logits = decoder.run(["logits"], _decoder_feeds(vlm, text, rows[:0], np.zeros(0, np.int64)))[0]
    with torch.no_grad():
        ref = vlm_reference(input_ids=torch.from_numpy(text)).logits.numpy()
    assert np.abs(logits - ref).max() <= ATOL


def test_seam_skips_rows_outside_the_step(vlm, vlm_reference):
    """A prompt prefilled in two pieces with every image row passed to both: each lands once,
    at its position in the piece that holds it (indices are this step's flat rows)."""
    import torch

    tok = vlm.manifest.vision.image_token_id
    px = _pixels(1, seed=3)
    rows = _session(vlm, "vision.onnx").run(None, {"pixel_values": px})[0]
    ids = np.array([[5, 6, 7] + [tok] * 16 + [8, 9]], np.int64)
    where = np.nonzero(ids[0] == tok)[0]
    split = 10  # the image straddles the two pieces
    decoder = _session(vlm, "decoder.onnx")
    inputs = [t for t in vlm.manifest.graph("decoder").inputs if t.layer is not None]
    cache = {t.name: np.zeros((1, t.shape[1], ids.shape[1], t.shape[3]), np.float32) for t in inputs}
    pieces = []
    for start, stop in ((0, split), (split, ids.shape[1])):
        s = stop - start
        feeds = _decoder_feeds(vlm, ids[:, start:stop], rows, where - start)
        feeds["position_ids"] = np.arange(start, stop)[None].astype(np.int64)
        for t in vlm.manifest.graph("decoder").inputs:
            if t.role == "total_sequence_length":
                feeds[t.name] = np.array(stop, np.int32)
            elif t.role == "seq_lens":
                feeds[t.name] = np.array([s], np.int64)
        feeds.update(cache)
        names = [o.name for o in decoder.get_outputs()]
        outs = dict(zip(names, decoder.run(names, feeds)))
        for name in cache:  # in-place graphs return the whole cache; row graphs the new rows
            present = name.replace("past_", "present_")
            if present in outs:
                cache[name] = outs[present]
            else:
                cache[name][:, :, start:stop] = outs[name.replace("past_", "new_")]
        pieces.append(outs["logits"])
    with torch.no_grad():
        ref = vlm_reference(input_ids=torch.from_numpy(ids), pixel_values=torch.from_numpy(px)).logits.numpy()
    assert np.abs(np.concatenate(pieces, axis=1) - ref).max() <= ATOL


# ----------------------------------------------------------------------------------------------
# refusals, before anything is written


def _broken_copy(tmp_path, vlm, edit_config=None, edit_pre=None, drop_pre=False):
    ck = tmp_path / "ck"
    shutil.copytree(vlm.checkpoint, ck)
    if edit_config:
        d = json.loads((ck / "config.json").read_text())
        edit_config(d)
        (ck / "config.json").write_text(json.dumps(d))
    if drop_pre:
        (ck / "preprocessor_config.json").unlink()
    if edit_pre:
        d = json.loads((ck / "preprocessor_config.json").read_text())
        edit_pre(d)
        (ck / "preprocessor_config.json").write_text(json.dumps(d))
    return ck


@pytest.mark.parametrize("how, needles", [
    (dict(drop_pre=True), ["has no preprocessor_config.json", "processor.save_pretrained"]),
    (dict(edit_pre=lambda d: d.update(crop_size={"height": 48, "width": 48}, size={"shortest_edge": 48})),
     ["makes 48x48 images but the vision tower takes 32x32"]),
    (dict(edit_pre=lambda d: d.update(image_processor_type="FancyImageProcessor")), ["FancyImageProcessor", "not supported"]),
    (dict(edit_config=lambda d: d.update(image_token_index=5000)), ["image token id 5000 is outside the text vocabulary"]),
    (dict(edit_config=lambda d: d["vision_config"].update(model_type="dinov2")), ["'dinov2' is not supported"]),
    (dict(edit_config=lambda d: d["text_config"].update(model_type="gpt2")), ["'gpt2' is not supported"]),
    (dict(edit_config=lambda d: d.update(vision_feature_layer=9)), ["vision_feature_layer"]),
    (dict(edit_config=lambda d: d.update(vision_feature_select_strategy="cls")), ["vision_feature_select_strategy"]),
])
def test_export_refuses_a_broken_vlm_checkpoint(tiny, tmp_path, capsys, how, needles):
    vlm = tiny("llava_clip", "onnxruntime")
    ck = _broken_copy(tmp_path, vlm, **how)
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "art"
    code, _, err = run_cli(capsys, "export", ck, "-o", out)
    assert_one_error(code, err, *needles, alone=True)
    assert_nothing_written(out)


def test_export_refuses_vision_weights_that_do_not_match(tiny, tmp_path, capsys):
    """A vision tensor missing from the checkpoint is named; the decoder's own check does not
    count vision tensors as unread."""
    from safetensors.numpy import load_file, save_file

    vlm = tiny("llava_clip", "onnxruntime")
    ck = _broken_copy(tmp_path, vlm)
    shard = next(ck.glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = next(n for n in tensors if "vision_tower" in n and n.endswith("fc1.weight"))
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (tmp_path / "out").mkdir()
    code, _, err = run_cli(capsys, "export", ck, "-o", tmp_path / "out" / "art")
    assert_one_error(code, err, "missing weight", "fc1.weight", alone=True)
    assert_nothing_written(tmp_path / "out" / "art")


def test_tensorrt_decoder_graph_carries_the_seam(tiny, capsys):
    """--target onnxruntime,tensorrt: the tensorrt decoder (seam included) passes TensorRT's static
    check, and onnxruntime runs it with image rows at parity with transformers; the vision graph
    (plain ONNX) is shared by both targets."""
    import torch
    from transformers import LlavaForConditionalGeneration

    vlm = tiny("llava_clip", "onnxruntime,tensorrt")
    m = vlm.manifest
    assert [(g.name, g.target) for g in m.graphs] == [("decoder", "onnxruntime"), ("decoder", "tensorrt"),
                                                      ("vision", "portable")]
    code, out, err = run_cli(capsys, "check", vlm.artifact, "--backend", "tensorrt")
    assert code == 0 and "0 error(s)" in out, out + err
    trt = m.graph("decoder", "tensorrt")
    tok = m.vision.image_token_id
    px = _pixels(1, seed=4)
    rows = _session(vlm, "vision.onnx").run(None, {"pixel_values": px})[0]
    ids = np.array([[5] + [tok] * 16 + [6, 7]], np.int64)
    feeds = _decoder_feeds(vlm, ids, rows, np.nonzero(ids[0] == tok)[0])
    feeds = {t.name: feeds.get(t.name, feeds.get(t.role)) if t.layer is None else feeds[t.name]
             for t in trt.inputs}
    logits = _session(vlm, trt.file).run(["logits"], feeds)[0]
    ref_model = LlavaForConditionalGeneration.from_pretrained(str(vlm.checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(input_ids=torch.from_numpy(ids), pixel_values=torch.from_numpy(px)).logits.numpy()
    assert np.abs(logits - ref).max() <= ATOL
