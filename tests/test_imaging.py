"""graphkiln.imaging: torch-free image loading and preprocessing against transformers' PIL-backed
image processors (parity within 1e-5, in practice bit for bit), placeholder counts against the
processors' own rules, and every refusal as one line."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import time
import types
import zlib
from dataclasses import asdict, replace

import numpy as np
import pytest
from PIL import Image

from graphkiln import imaging as I
from graphkiln.imaging.spec import _adapter as spec_adapter
from graphkiln.errors import GraphkilnError

T = pytest.importorskip("transformers")
from transformers.image_utils import load_image as hf_load_image  # noqa: E402

BIG = 10**8  # a max_pixels that never refuses the test images


# ---------------------------------------------------------------------------------------------
# images

def _pattern(width: int, height: int, seed: int) -> np.ndarray:
    """Edges, gradients and noise: every filter tap matters."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    return np.stack([(xx * 7 + yy * 3) % 256, (xx * xx + 5 * yy) % 256, rng.integers(0, 256, (height, width))],
                    -1).astype(np.uint8)


def _image(width: int, height: int, mode: str, seed: int = 0) -> Image.Image:
    rgb = _pattern(width, height, seed)
    if mode == "RGBA":
        yy, xx = np.mgrid[0:height, 0:width]
        return Image.fromarray(np.dstack([rgb, ((xx + 3 * yy) * 5 % 256).astype(np.uint8)]))
    img = Image.fromarray(rgb)
    if mode == "P+transparency":
        img = img.convert("P")
        img.info["transparency"] = 0
        return img
    if mode == "I;16":
        return Image.fromarray(np.asarray(img.convert("L")).astype(np.uint16) * 200)
    return img.convert(mode)


IMAGES = {  # name: (width, height, mode)
    "rgb_37x501": (37, 501, "RGB"),
    "rgba_120x90": (120, 90, "RGBA"),
    "l_64x48": (64, 48, "L"),
    "p_80x61": (80, 61, "P"),
    "p_transparent_33x70": (33, 70, "P+transparency"),
    "la_50x50": (50, 50, "LA"),
    "cmyk_45x31": (45, 31, "CMYK"),
    "bilevel_29x40": (29, 40, "1"),
    "i16_40x29": (40, 29, "I;16"),
    "wide_1000x20": (1000, 20, "RGB"),
    "tall_20x700": (20, 700, "RGB"),
    "tiny_3x3": (3, 3, "RGB"),
    "square_224": (224, 224, "RGB"),
}


@pytest.fixture(scope="module")
def images() -> list[Image.Image]:
    return [_image(w, h, m, seed=i) for i, (w, h, m) in enumerate(IMAGES.values())]


# ---------------------------------------------------------------------------------------------
# parity with transformers' PIL processors

CONFIGS = {
    # defaults of each class
    "clip_default": {"image_processor_type": "CLIPImageProcessor"},
    "siglip_default": {"image_processor_type": "SiglipImageProcessor"},
    "gemma3_default": {"image_processor_type": "Gemma3ImageProcessor"},
    "qwen2_vl_default": {"image_processor_type": "Qwen2VLImageProcessor"},
    "llava_default": {"image_processor_type": "LlavaImageProcessor"},
    # llava-1.5-7b-hf's own config
    "llava15_clip336": {"crop_size": {"height": 336, "width": 336}, "do_center_crop": True, "do_convert_rgb": True,
                        "do_normalize": True, "do_rescale": True, "do_resize": True,
                        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_processor_type": "CLIPImageProcessor",
                        "image_std": [0.26862954, 0.26130258, 0.27577711], "processor_class": "LlavaProcessor",
                        "resample": 3, "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 336}},
    # legacy: feature extractor name, int sizes
    "clip_legacy_ints": {"feature_extractor_type": "CLIPFeatureExtractor", "size": 160, "crop_size": 128,
                         "resample": 2},
    # crop larger than the resize: zero padding inside the crop
    "clip_crop_pads": {"image_processor_type": "CLIPImageProcessorFast", "size": {"shortest_edge": 100},
                       "crop_size": {"height": 130, "width": 120}, "image_mean": [0.1, 0.2, 0.3],
                       "image_std": [0.9, 0.5, 0.25], "resample": 1},
    "clip_no_resize": {"image_processor_type": "CLIPImageProcessor", "do_resize": False,
                       "crop_size": {"height": 40, "width": 52}},
    "clip_exact_size": {"image_processor_type": "CLIPImageProcessor", "size": {"height": 96, "width": 64},
                        "do_center_crop": False, "resample": 0},
    "llava_pad_square": {"image_processor_type": "LlavaImageProcessor", "do_pad": True,
                         "size": {"shortest_edge": 112}, "crop_size": {"height": 112, "width": 112}},
    "siglip_so400m": {"image_processor_type": "SiglipImageProcessor", "size": {"height": 384, "width": 384},
                      "resample": 3, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                      "rescale_factor": 0.00392156862745098, "processor_class": "SiglipProcessor"},
    "siglip_odd": {"image_processor_type": "SiglipImageProcessorPil", "size": [70, 90], "resample": 5,
                   "rescale_factor": 0.0078125, "image_mean": 0.25, "image_std": 2.0},
    "siglip_no_rescale": {"image_processor_type": "SiglipImageProcessor", "do_rescale": False,
                          "image_mean": [120.0, 110.0, 100.0], "image_std": [60.0, 61.0, 62.0]},
    "siglip_no_normalize": {"image_processor_type": "SiglipImageProcessor", "do_normalize": False, "resample": 4},
    "siglip_raw": {"image_processor_type": "SiglipImageProcessor", "do_normalize": False, "do_rescale": False},
    "gemma3_4b": {"do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True,
                  "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor",
                  "image_seq_length": 256, "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None,
                  "pan_and_scan_min_crop_size": None, "pan_and_scan_min_ratio_to_activate": None,
                  "processor_class": "Gemma3Processor", "resample": 2, "rescale_factor": 0.00392156862745098,
                  "size": {"height": 448, "width": 448}},
    # null is None in transformers: no resize, no RGB conversion, bilinear
    "clip_nulls": {"image_processor_type": "CLIPImageProcessor", "do_resize": None, "resample": None,
                   "do_convert_rgb": None, "size": None, "crop_size": {"height": 40, "width": 30}},
    "siglip_nulls": {"image_processor_type": "SiglipImageProcessor", "do_pad": None, "do_normalize": None,
                     "image_mean": None, "image_std": None},
    "gemma3_square_int": {"image_processor_type": "Gemma3ImageProcessor", "size": 150, "do_pan_and_scan": False,
                          "image_mean": [0.2, 0.4, 0.6]},
    # Qwen2-VL-7B-Instruct's style: top-level min/max pixels
    "qwen2_vl_7b": {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                    "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                    "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor",
                    "processor_class": "Qwen2VLProcessor"},
    # small max_pixels: the downscale branch; min_pixels large: the upscale branch
    "qwen2_5_vl_small": {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
                         "size": {"shortest_edge": 20000, "longest_edge": 60000}, "resample": 2},
    "qwen_null_size": {"image_processor_type": "Qwen2VLImageProcessor", "size": None, "max_pixels": 70000},
    "qwen_patch16_merge1": {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 1024, "max_pixels": 40000,
                            "patch_size": 16, "merge_size": 1, "temporal_patch_size": 1,
                            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
    "qwen_t3_merge3": {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 500, "max_pixels": 30000,
                       "patch_size": 10, "merge_size": 3, "temporal_patch_size": 3},
}


def _hf(d: dict):
    name = I.processor_class_name(d)
    return getattr(T, name + "Pil").from_dict(d)


def _hf_pixels(d: dict, images) -> tuple[np.ndarray, np.ndarray | None]:
    out = _hf(d)(images=images, return_tensors="np")
    grid = out.get("image_grid_thw")
    return np.asarray(out["pixel_values"]), None if grid is None else np.asarray(grid)


def _assert_same(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.dtype == np.float32
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref.astype(np.float32), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parity_with_transformers(name, images):
    d = CONFIGS[name]
    spec = I.preprocessing_from_config(d)
    rgb = [I.load_image(im, BIG) for im in images]
    # without do_convert_rgb transformers takes RGB images only (an RGBA one fails, a P one gives
    # palette indices): give it what load_image gives the runtime
    ref, grid = _hf_pixels(d, images if spec.do_convert_rgb else rgb)
    got = I.preprocess(rgb, spec)
    _assert_same(got.pixel_values, ref)
    if spec.kind == "qwen2_vl":
        assert got.grids == tuple(map(tuple, grid.tolist()))
        np.testing.assert_array_equal(got.image_grid_thw, grid)
        assert got.rows == tuple(int(g.prod()) for g in grid)
        # counted without the pixels, as the processor's get_number_of_image_patches does
        hf = _hf(d)
        for im, g in zip(images, got.grids):
            size, planned = I.plan(spec, *im.size)
            assert planned == g
            assert hf.get_number_of_image_patches(im.size[1], im.size[0]) == g[1] * g[2]
    else:
        assert got.grids is None and got.rows == (1,) * len(images)
        assert all(s == spec.output_size for s in got.image_sizes)
        assert all(I.plan(spec, *im.size) == (spec.output_size, None) for im in images)


def test_single_images_match_the_batch(images):
    spec = I.preprocessing_from_config(CONFIGS["qwen2_5_vl_small"])
    rgb = [I.load_image(im, BIG) for im in images[:3]]
    batch = I.preprocess(rgb, spec)
    singles = np.concatenate([I.preprocess([im], spec).pixel_values for im in rgb])
    np.testing.assert_array_equal(batch.pixel_values, singles)


def test_empty_batch_has_zero_rows():
    clip = I.preprocess([], I.preprocessing_from_config(CONFIGS["llava15_clip336"]))
    assert clip.pixel_values.shape == (0, 3, 336, 336) and clip.pixel_values.dtype == np.float32
    qwen = I.preprocess([], I.preprocessing_from_config(CONFIGS["qwen2_vl_7b"]))
    assert qwen.pixel_values.shape == (0, 3 * 2 * 14 * 14) and qwen.grids == () and qwen.image_grid_thw.shape == (0, 3)


def test_no_convert_rgb_takes_rgb_only(images):
    d = {"image_processor_type": "SiglipImageProcessor", "do_convert_rgb": False}
    spec = I.preprocessing_from_config(d)
    assert spec.do_convert_rgb is False
    rgb = [im for im in images if im.mode == "RGB"]
    _assert_same(I.preprocess(rgb, spec).pixel_values, _hf_pixels(d, rgb)[0])
    with pytest.raises(I.ImageError, match="does not convert to RGB"):
        I.preprocess([images[2]], spec)  # an L image: transformers would make a 1-channel tensor


def test_transformers_own_to_dict_round_trips():
    """What a transformers processor saves (save_pretrained's dict) parses to the same spec."""
    for name in ("CLIPImageProcessor", "LlavaImageProcessor", "SiglipImageProcessor", "Gemma3ImageProcessor",
                 "Qwen2VLImageProcessor"):
        for kwargs in ({}, {"resample": 2, "image_mean": [0.1, 0.2, 0.3]}):
            saved = json.loads(getattr(T, name + "Pil")(**kwargs).to_json_string())
            assert I.preprocessing_from_config(saved) == I.preprocessing_from_config(
                dict(kwargs, image_processor_type=name)), (name, kwargs)


# ---------------------------------------------------------------------------------------------
# sources: path, bytes, PIL, array

def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_paths_and_bytes_load_as_transformers_loads_a_file(tmp_path, images):
    """A path goes through transformers.image_utils.load_image (EXIF orientation, convert("RGB"),
    first frame): the processor given the same path gives the same pixel values."""
    rotated = _image(40, 24, "RGB", seed=9)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise
    jpeg = tmp_path / "rotated.jpg"
    rotated.save(jpeg, exif=exif, quality=90)
    rgba = tmp_path / "alpha.png"
    images[1].save(rgba)  # RGBA: a file's alpha is dropped, as load_image does
    gif = tmp_path / "anim.gif"
    frames = [Image.new("RGB", (30, 20), c) for c in ((200, 10, 10), (10, 200, 10))]
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=50, loop=0)
    paths = [jpeg, rgba, gif]
    for p in paths:
        ours = I.load_image(p, BIG)
        ref = hf_load_image(str(p))
        assert ours.mode == "RGB" and ours.size == ref.size
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))
        same = I.load_image(p.read_bytes(), BIG)
        np.testing.assert_array_equal(np.asarray(same), np.asarray(ours))
    assert I.load_image(jpeg, BIG).size == (24, 40)  # rotated by its EXIF orientation
    assert np.asarray(I.load_image(gif, BIG))[0, 0].tolist() == [200, 10, 10]  # first frame
    d = CONFIGS["qwen2_5_vl_small"]
    ref, _ = _hf_pixels(d, [str(p) for p in paths])
    got = I.preprocess([I.load_image(str(p), BIG) for p in paths], I.preprocessing_from_config(d))
    _assert_same(got.pixel_values, ref)


def test_arrays_load_as_the_processors_convert_arrays(images):
    d = CONFIGS["clip_crop_pads"]
    spec = I.preprocessing_from_config(d)
    assert images[1].mode == "RGBA" and images[2].mode == "L"
    rgba = np.asarray(images[1])  # [90, 120, 4]
    rgb = np.asarray(images[0].convert("RGB"))  # [501, 37, 3]
    grey1 = np.asarray(images[2])[:, :, None]  # [48, 64, 1]
    arrays = [rgba, rgb, grey1]
    ref, _ = _hf_pixels(d, arrays)
    _assert_same(I.preprocess([I.load_image(a, BIG) for a in arrays], spec).pixel_values, ref)
    # [H, W] is grey, like [H, W, 1] and like the L image itself
    grey2 = I.load_image(np.asarray(images[2]), BIG)
    np.testing.assert_array_equal(np.asarray(grey2), np.asarray(I.load_image(grey1, BIG)))
    np.testing.assert_array_equal(np.asarray(grey2), np.asarray(images[2].convert("RGB")))


def test_a_lazily_opened_pil_image_is_decoded_in_full(tmp_path):
    data = _png(_image(64, 64, "RGB"))
    lazy = Image.open(io.BytesIO(data[: len(data) // 2]))
    with pytest.raises(I.ImageError, match="truncated or corrupt") as e:
        I.load_image(lazy, BIG)
    _one_line(e)


def test_content_hash():
    a = _image(17, 9, "RGB")
    h = I.content_hash(a)
    assert len(h) == 64 and h == I.content_hash(I.load_image(_png(a), BIG)) == I.content_hash(
        I.load_image(np.asarray(a), BIG))
    b = np.asarray(a).copy()
    b[4, 4, 1] ^= 1
    assert I.content_hash(Image.fromarray(b)) != h
    flat = np.asarray(a).reshape(-1)
    assert I.content_hash(Image.fromarray(flat.reshape(9, 17, 3))) != I.content_hash(
        Image.fromarray(flat.reshape(17, 9, 3)))  # same bytes, other shape
    rgba = _image(8, 8, "RGBA")
    assert I.content_hash(rgba) == I.content_hash(I.load_image(rgba, BIG))  # hashed as the RGB it becomes


# ---------------------------------------------------------------------------------------------
# placeholder counts

def _tokenizer(**special):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"[UNK]": 0, "<image>": 1, "hi": 2, "<start_of_image>": 3, "<end_of_image>": 4, "<image_soft_token>": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", **special)


@pytest.mark.parametrize("strategy,additional,crop", [("default", 1, 336), ("full", 1, 336), ("default", 0, 224),
                                                      ("full", 0, 100)])
def test_llava_placeholder_counts_match_the_processor(strategy, additional, crop):
    d = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": crop},
         "crop_size": {"height": crop, "width": crop}}
    proc = T.LlavaProcessor(image_processor=_hf(d), tokenizer=_tokenizer(additional_special_tokens=["<image>"]),
                            patch_size=14, vision_feature_select_strategy=strategy,
                            num_additional_image_tokens=additional, image_token="<image>")
    img = _image(50, 80, "RGB")
    out = proc(text=["<image> hi <image>"], images=[img, img], return_tensors="np")
    rule = I.PlaceholderRule("patch_grid", patch_size=14, num_additional_image_tokens=additional,
                             vision_feature_select_strategy=strategy).validated()
    spec = I.preprocessing_from_config(d)
    I.check_compatible(spec, rule)
    counts = I.preprocess([img, img], spec).num_tokens(rule)
    assert sum(counts) == int((out["input_ids"] == 1).sum())


def test_gemma3_placeholder_count_matches_the_processor():
    d = CONFIGS["gemma3_square_int"]
    tok = _tokenizer(extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                           "image_token": "<image_soft_token>"})
    proc = T.Gemma3Processor(image_processor=_hf(d), tokenizer=tok, image_seq_length=17)
    img = _image(31, 77, "RGBA")
    out = proc(text=["<start_of_image> hi"], images=[img], return_tensors="np")
    rule = I.PlaceholderRule("fixed", tokens_per_image=17)
    spec = I.preprocessing_from_config(d)
    I.check_compatible(spec, rule)
    assert I.preprocess([I.load_image(img, BIG)], spec).num_tokens(rule) == (int((out["input_ids"] == 5).sum()),)


def test_qwen_placeholder_counts_match_the_processor(images):
    d = CONFIGS["qwen2_5_vl_small"]
    hf = _hf(d)
    inputs = hf(images=images, return_tensors="np")
    # Qwen2VLProcessor.replace_image_token itself (building the processor needs torchvision's video processor)
    fake = types.SimpleNamespace(image_processor=hf, image_token="X")
    expected = tuple(len(T.Qwen2VLProcessor.replace_image_token(fake, inputs, i)) for i in range(len(images)))
    spec = I.preprocessing_from_config(d)
    rule = I.PlaceholderRule("merged_grid", merge_size=2)
    I.check_compatible(spec, rule)
    got = I.preprocess([I.load_image(im, BIG) for im in images], spec)
    assert got.num_tokens(rule) == expected
    assert tuple(rule.num_tokens(*I.plan(spec, *im.size)) for im in images) == expected


def test_placeholder_rule_refusals():
    qwen = I.preprocessing_from_config(CONFIGS["qwen2_vl_7b"])
    clip = I.preprocessing_from_config(CONFIGS["clip_default"])
    cases = [
        (lambda: I.PlaceholderRule("patch_grid").validated(), "patch_size is required"),
        (lambda: I.PlaceholderRule("fixed", tokens_per_image=4, patch_size=14).validated(), "patch_size must be null"),
        (lambda: I.PlaceholderRule("merged_grid", merge_size=2, vision_feature_select_strategy="default").validated(),
         "belong to a patch_grid rule"),
        (lambda: I.PlaceholderRule("fixed", tokens_per_image=0).validated(), "greater than 0"),
        (lambda: I.check_compatible(qwen, I.PlaceholderRule("fixed", tokens_per_image=3)), "needs a merged_grid"),
        (lambda: I.check_compatible(qwen, I.PlaceholderRule("merged_grid", merge_size=3)), "differs"),
        (lambda: I.check_compatible(clip, I.PlaceholderRule("merged_grid", merge_size=2)), "needs qwen2_vl"),
        (lambda: I.check_compatible(clip, I.PlaceholderRule("patch_grid", patch_size=500,
                                                            vision_feature_select_strategy="default")), "no token"),
        (lambda: I.PlaceholderRule("merged_grid", merge_size=2).num_tokens((28, 28)), "needs the image's grid"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match) as e:
            fn()
        _one_line(e)


# ---------------------------------------------------------------------------------------------
# preprocessor_config.json refusals and fallbacks

def test_class_name_fallbacks():
    assert I.processor_class_name({"image_processor_type": "Qwen2VLImageProcessorFast"}) == "Qwen2VLImageProcessor"
    assert I.processor_class_name({"feature_extractor_type": "CLIPFeatureExtractor"}) == "CLIPImageProcessor"
    assert I.processor_class_name({}, model_type="llava") == "LlavaImageProcessor"
    assert I.processor_class_name({}, model_type="qwen2_5_vl") == "Qwen2VLImageProcessor"
    assert I.processor_class_name({"processor_class": "Qwen2_5_VLProcessor"}) == "Qwen2VLImageProcessor"
    assert I.processor_class_name({"processor_class": "Gemma3Processor"}) == "Gemma3ImageProcessor"
    # image_processor_type wins over the model type, as in AutoImageProcessor
    assert I.processor_class_name({"image_processor_type": "SiglipImageProcessor"}, "llava") == "SiglipImageProcessor"
    spec = I.preprocessing_from_config({"min_pixels": 1000, "max_pixels": 9000}, model_type="qwen2_vl")
    assert (spec.kind, spec.min_pixels, spec.max_pixels) == ("qwen2_vl", 1000, 9000)


CLIP = {"image_processor_type": "CLIPImageProcessor"}
QWEN = {"image_processor_type": "Qwen2VLImageProcessor"}
BAD_CONFIGS = [
    ([], "must hold a JSON object"),
    ({}, "names no image processor"),
    ({"image_processor_type": "ViTImageProcessor"}, "is not supported"),
    ({"image_processor_type": 3}, "must be a string"),
    (dict(CLIP, auto_map={"AutoImageProcessor": "x.Y"}), "auto_map"),
    ({"image_processor_type": "Gemma3ImageProcessor", "do_pan_and_scan": True}, "pan-and-scan"),
    (dict(CLIP, crop_pct=0.9), "'crop_pct'|\"crop_pct\""),
    (dict(QWEN, do_pan_and_scan=False), "do_pan_and_scan"),  # not a Qwen option
    (dict(CLIP, do_resize="true"), "do_resize must be true, false or null"),
    (dict(CLIP, resample=7), "resample must be one of"),
    (dict(CLIP, resample="bicubic"), "resample must be one of"),
    (dict(CLIP, resample=True), "resample must be one of"),
    (dict(CLIP, rescale_factor="1/255"), "rescale_factor must be a number"),
    (dict(CLIP, rescale_factor=0), "rescale_factor"),
    (dict(CLIP, rescale_factor=2.0), "rescale_factor"),
    (dict(CLIP, image_mean=[0.5, 0.5]), "image_mean must be a number or a list of 3"),
    (dict(CLIP, image_mean=[0.5, True, 0.5]), "image_mean"),
    (dict(CLIP, image_std=[0.5, 0.0, 0.5]), "image_std"),
    (dict(CLIP, image_std=[0.5, float("nan"), 0.5]), "image_std"),
    (dict(CLIP, image_mean=[float("inf"), 0, 0]), "image_mean"),
    (dict(CLIP, size="224"), "size must be an integer"),
    (dict(CLIP, size={"shortest_edge": 224.0}), "must be an integer"),
    (dict(CLIP, size={"shortest_edge": True}), "must be an integer"),
    (dict(CLIP, size={"shortest_edge": 0}), "greater than 0"),
    (dict(CLIP, size={"shortest_edge": 10**6}), "less than or equal"),
    (dict(CLIP, size={"width": 224}), "are not a size transformers takes"),
    (dict(CLIP, size={"max_height": 300, "max_width": 300}), "is not supported"),
    (dict(CLIP, do_center_crop=False), "output size would vary"),
    (dict(CLIP, size=None), "size is null but do_resize is true"),
    (dict(CLIP, resample=None), "resample is null but do_resize is true"),
    (dict(CLIP, crop_size=None), "crop_size is null but do_center_crop is true"),
    (dict(CLIP, image_std=None), "image_std is null but do_normalize is true"),
    (dict(CLIP, rescale_factor=None), "rescale_factor is null but do_rescale is true"),
    (dict(QWEN, patch_size=None), "patch_size must be an integer"),
    (dict(QWEN, do_resize=None), "needs its smart resize"),
    (dict(CLIP, crop_size={"shortest_edge": 224}), "crop_size must have height and width"),
    (dict(CLIP, data_format="channels_last"), "data_format"),
    (dict(CLIP, pad_size={"height": 300, "width": 300}), "pad_size"),
    (dict(CLIP, image_seq_length="256"), "image_seq_length must be a int"),
    ({"image_processor_type": "SiglipImageProcessor", "size": 224}, "output size would vary"),  # an int is a shortest edge
    ({"image_processor_type": "SiglipImageProcessor", "do_resize": False}, "output size would vary"),
    ({"image_processor_type": "Gemma3ImageProcessor", "size": {"shortest_edge": 224}}, "is not supported"),
    ({"image_processor_type": "Gemma3ImageProcessor", "do_resize": False}, "gemma3 resizes to a fixed size"),
    ({"image_processor_type": "LlavaImageProcessor", "do_pad": True, "image_mean": [2.0, 0.5, 0.5]}, "must lie in"),
    (dict(QWEN, size={"height": 448, "width": 448}), "needs size"),
    (dict(QWEN, size={"min_pixels": 100, "max_pixels": 900}), "needs size"),
    (dict(QWEN, min_pixels=5000, max_pixels=4000), "must not exceed"),
    (dict(QWEN, max_pixels=3.5e6), "max_pixels must be an integer"),
    (dict(QWEN, patch_size=True), "patch_size must be an integer"),
    (dict(QWEN, merge_size=0), "greater than 0"),
    (dict(QWEN, do_resize=False), "needs its smart resize"),
]


@pytest.mark.parametrize("d,match", BAD_CONFIGS, ids=[str(i) for i in range(len(BAD_CONFIGS))])
def test_bad_configs_are_one_line_value_errors(d, match):
    with pytest.raises(ValueError, match=match) as e:
        I.preprocessing_from_config(d)
    _one_line(e)


def test_accepted_oddities():
    # do_pad without pad_size on CLIP/SigLIP pads nothing (every output has the same size); keys
    # for the torchvision backend or the call are ignored at their neutral values
    a = I.preprocessing_from_config(dict(CLIP, do_pad=True, disable_grouping=True, device=None,
                                         return_tensors=None, data_format="channels_first"))
    assert a == I.preprocessing_from_config(CLIP)
    # null is None as in transformers, not the class default (Gemma3's released config)
    assert not I.preprocessing_from_config(CONFIGS["gemma3_4b"]).do_convert_rgb
    nulls = I.preprocessing_from_config(CONFIGS["clip_nulls"])
    assert (nulls.do_resize, nulls.do_convert_rgb) == (False, False)
    g = I.preprocessing_from_config({"image_processor_type": "Gemma3ImageProcessor", "do_center_crop": True,
                                     "crop_size": {"height": 10, "width": 10}, "pan_and_scan_min_crop_size": 256})
    assert not g.do_center_crop  # Gemma3ImageProcessor has no crop step


# ---------------------------------------------------------------------------------------------
# the spec as untrusted manifest content

def test_spec_validates_from_json():
    for d in CONFIGS.values():
        spec = I.preprocessing_from_config(d)
        assert spec_adapter(I.ImagePreprocessing).validate_json(json.dumps(asdict(spec))) == spec
    good = asdict(I.preprocessing_from_config(CONFIGS["llava15_clip336"]))
    qgood = asdict(I.preprocessing_from_config(CONFIGS["qwen2_vl_7b"]))
    bad = [
        (dict(good, kind="vit"), "kind"),
        (dict(good, extra=1), "extra"),
        (dict(good, size=[0, 224], shortest_edge=None), "size"),
        (dict(good, crop_size=[336, 99999]), "crop_size"),
        (dict(good, resample="fancy"), "resample"),
        (dict(good, resample=3), "resample"),
        (dict(good, rescale_factor=True), "rescale_factor"),
        (dict(good, image_std=[0.5, -0.5, 0.5]), "image_std"),
        (dict(good, image_mean=[0.5, 0.5]), "image_mean"),
        (dict(good, do_center_crop=False), "crop_size must be set exactly"),
        (dict(good, size=[336, 336]), "exactly one of size"),
        (dict(good, patch_size=14), "patch_size must be null"),
        (dict(good, kind="siglip", pad_to_square=True), "pad_to_square"),
        (dict(qgood, patch_size=None), "patch_size is required"),
        (dict(qgood, min_pixels=10**9), "min_pixels"),
        (dict(qgood, do_center_crop=True, crop_size=[10, 10]), "crop_size must be null"),
        (dict(qgood, patch_size=1000, merge_size=8), "below one merge window"),
        (dict(good, crop_size=[16384, 16384]), "more than 33554432 pixels"),
    ]
    for d, match in bad:
        with pytest.raises(Exception, match=match):
            spec_adapter(I.ImagePreprocessing).validate_json(json.dumps(d))
        if "extra" in d:
            continue
        with pytest.raises(ValueError, match=match) as e:  # what export checks before writing a manifest
            I.ImagePreprocessing(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}).validated()
        _one_line(e)


# ---------------------------------------------------------------------------------------------
# image refusals

def _one_line(excinfo) -> None:
    text = str(excinfo.value)
    assert text and "\n" not in text, text


def _png_header_only(width: int, height: int, rows: int) -> bytes:
    """A 1-bit greyscale PNG declaring width x height whose pixel data holds only ``rows`` rows:
    decoding it would fail (truncated); only its header can be read."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    row = b"\0" * (1 + (width + 7) // 8)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(row * rows)) + chunk(b"IEND", b""))


def _valid_zero_png(width: int, height: int) -> bytes:
    """A complete 1-bit all-zero PNG of width x height (compresses to next to nothing)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    row = b"\0" * (1 + (width + 7) // 8)
    z = zlib.compressobj(9)
    data = b"".join(z.compress(row * 500) for _ in range(height // 500)) + z.compress(row * (height % 500)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", data) + chunk(b"IEND", b""))


def test_too_many_pixels_is_refused_before_decoding(tmp_path):
    # 8000 x 8000 (under Pillow's own limit): a complete file, refused from its header by max_pixels
    path = tmp_path / "big.png"
    path.write_bytes(_valid_zero_png(8000, 8000))
    t = time.perf_counter()
    with pytest.raises(I.ImageError, match=r"8000x8000 = 64000000 pixels, more than the limit of 1000000") as e:
        I.load_image(path, max_pixels=1_000_000)
    assert time.perf_counter() - t < 0.5
    _one_line(e)
    # the same size with pixel data that ends after 3 rows: had it been decoded, it would be "truncated"
    for source in (_png_header_only(8000, 8000, rows=3), Image.open(io.BytesIO(_png_header_only(8000, 8000, 3)))):
        with pytest.raises(I.ImageError, match="more than the limit"):
            I.load_image(source, max_pixels=1_000_000)
    # 20000 x 20000 is beyond Pillow's decompression-bomb guard as well: refused whatever max_pixels says
    bomb = _png_header_only(20000, 20000, rows=3)
    for limit in (1_000_000, 10**10):
        t = time.perf_counter()
        with pytest.raises(I.ImageError, match="20000x20000|too large to decode") as e:
            I.load_image(bomb, max_pixels=limit)
        assert time.perf_counter() - t < 0.5
        _one_line(e)
    # arrays and PIL images are held to the limit too
    with pytest.raises(I.ImageError, match="more than the limit of 100"):
        I.load_image(np.zeros((11, 10, 3), np.uint8), max_pixels=100)
    with pytest.raises(I.ImageError, match="more than the limit of 100"):
        I.load_image(Image.new("RGB", (10, 11)), max_pixels=100)
    assert I.load_image(np.zeros((10, 10, 3), np.uint8), max_pixels=100).size == (10, 10)


def test_bad_images_are_one_line_image_errors(tmp_path):
    good = _png(_image(64, 64, "RGB"))
    jpeg = io.BytesIO()
    _image(64, 64, "RGB").save(jpeg, format="JPEG")
    (tmp_path / "truncated.png").write_bytes(good[: len(good) // 2])
    (tmp_path / "truncated.jpg").write_bytes(jpeg.getvalue()[: len(jpeg.getvalue()) // 2])
    (tmp_path / "text.png").write_bytes(b"hello, this is not an image\n" * 10)
    (tmp_path / "empty.png").write_bytes(b"")
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    (tmp_path / "a.eps").write_bytes(eps)
    (tmp_path / "dir").mkdir()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    bad_crc = bytearray(good)
    bad_crc[good.index(b"IDAT") + 30] ^= 0xFF  # inside the compressed pixels
    cases = [
        (tmp_path / "missing.png", "does not exist"),
        (str(tmp_path / "missing.png"), "does not exist"),
        ("", "path is empty"),
        (tmp_path / "dir", "is a directory"),
        (fifo, "not a regular file"),
        (tmp_path / "empty.png", "is empty"),
        (tmp_path / "truncated.png", "truncated or corrupt"),
        (tmp_path / "truncated.jpg", "truncated or corrupt"),
        (bytes(bad_crc), "truncated or corrupt|not a valid image"),
        (tmp_path / "text.png", "not an image in a supported format"),
        (eps, "not an image in a supported format"),  # Pillow would run Ghostscript on it
        (b"", "image data is empty"),
        (np.zeros((10, 10, 3), np.float32), "must be uint8"),
        (np.zeros((10, 10, 3), bool), "must be uint8"),
        (np.zeros((3, 10, 12), np.uint8), "channels last"),
        (np.zeros((10, 12, 2), np.uint8), "channels last"),
        (np.zeros((1, 10, 12, 3), np.uint8), r"\[height, width\]"),
        (np.zeros((10,), np.uint8), r"\[height, width\]"),
        (np.zeros((0, 10, 3), np.uint8), "has no pixels"),
        (12345, "must be a file path, bytes, a PIL image or a numpy array"),
        ([1, 2, 3], "must be a file path"),
    ]
    for source, match in cases:
        with pytest.raises(I.ImageError, match=match) as e:
            I.load_image(source, BIG)
        _one_line(e)
        assert isinstance(e.value, GraphkilnError) and isinstance(e.value, ValueError)
    with pytest.raises(ValueError, match="max_pixels must be a positive int"):
        I.load_image(good, 0)


def test_preprocess_refusals(images):
    qwen = I.preprocessing_from_config(CONFIGS["qwen2_vl_default"])
    with pytest.raises(I.ImageError, match="aspect ratio above 200") as e:
        I.preprocess([Image.new("RGB", (1005, 5))], qwen)
    _one_line(e)
    clip = I.preprocessing_from_config(CONFIGS["llava15_clip336"])
    with pytest.raises(I.ImageError, match="would be resized to") as e:
        I.preprocess([Image.new("RGB", (1, 100_000))], clip)  # 336 x 33,600,000 before the crop
    _one_line(e)
    with pytest.raises(I.ImageError, match="not a PIL image") as e:
        I.preprocess([np.zeros((4, 4, 3), np.uint8)], clip)
    _one_line(e)


def test_no_torch_transformers_or_onnx_imported():
    code = ("import sys, graphkiln.imaging; "
            "bad = [m for m in ('torch', 'transformers', 'onnx', 'onnxruntime') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_speed_is_reasonable():
    """Vectorized: a 1000x800 photo through Qwen2-VL's default preprocessing well under a second."""
    spec = I.preprocessing_from_config(CONFIGS["qwen2_vl_default"])
    img = _image(1000, 800, "RGB")
    I.preprocess([img], spec)
    t = time.perf_counter()
    out = I.preprocess([img], spec)
    assert time.perf_counter() - t < 1.0
    assert out.pixel_values.shape[1] == 1176
    assert replace(spec, max_pixels=spec.max_pixels) == spec  # frozen, comparable, hashable
    assert hash(spec) == hash(I.preprocessing_from_config(CONFIGS["qwen2_vl_default"]))
