"""A checkpoint's ``preprocessor_config.json`` read as transformers reads it: the class it names
(or the model type implies), that class's defaults for what it leaves out, and a one-line
``ValueError`` for anything graphkiln does not reproduce."""

from __future__ import annotations

from typing import Any

from graphkiln.imaging.spec import RESAMPLE, RESAMPLE_NAMES, ImagePreprocessing
from graphkiln.untrusted import show_json


OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_STANDARD = (0.5, 0.5, 0.5)

# the class attributes of transformers 5.24's *ImageProcessorPil classes (and BaseImageProcessor's
# rescale_factor 1/255): what a key left out of, or null in, preprocessor_config.json means
_CLIP_DEFAULTS = dict(resample=3, image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD, size={"shortest_edge": 224},
                      default_to_square=False, crop_size={"height": 224, "width": 224}, do_resize=True,
                      do_center_crop=True, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                      do_convert_rgb=True, do_pad=None)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "CLIPImageProcessor": _CLIP_DEFAULTS,
    "LlavaImageProcessor": dict(_CLIP_DEFAULTS, do_pad=False),
    "SiglipImageProcessor": dict(resample=3, image_mean=IMAGENET_STANDARD, image_std=IMAGENET_STANDARD,
                                 size={"height": 224, "width": 224}, default_to_square=False, do_resize=True,
                                 do_rescale=True, rescale_factor=1 / 255, do_normalize=True, do_convert_rgb=True,
                                 do_center_crop=None, crop_size=None, do_pad=None),
    "Gemma3ImageProcessor": dict(resample=2, image_mean=IMAGENET_STANDARD, image_std=IMAGENET_STANDARD,
                                 size={"height": 224, "width": 224}, default_to_square=True, do_convert_rgb=True,
                                 do_resize=True, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                                 do_center_crop=None, crop_size=None, do_pad=None, do_pan_and_scan=None),
    "Qwen2VLImageProcessor": dict(resample=3, size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
                                  default_to_square=False, do_resize=True, do_rescale=True, rescale_factor=1 / 255,
                                  do_normalize=True, image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD,
                                  do_convert_rgb=True, patch_size=14, temporal_patch_size=2, merge_size=2,
                                  do_center_crop=None, crop_size=None, do_pad=None),
}
_KIND_OF = {"CLIPImageProcessor": "clip", "LlavaImageProcessor": "clip", "SiglipImageProcessor": "siglip",
            "Gemma3ImageProcessor": "gemma3", "Qwen2VLImageProcessor": "qwen2_vl"}
# what transformers' AutoImageProcessor picks from the model config's model_type when the
# preprocessor config names no class (IMAGE_PROCESSOR_MAPPING_NAMES in 5.24)
_BY_MODEL_TYPE = {"clip": "CLIPImageProcessor", "llava": "LlavaImageProcessor", "siglip": "SiglipImageProcessor",
                  "paligemma": "SiglipImageProcessor", "gemma3": "Gemma3ImageProcessor",
                  "qwen2_vl": "Qwen2VLImageProcessor", "qwen2_5_vl": "Qwen2VLImageProcessor"}
# the processor classes of those models, for a config that has processor_class and nothing else
_BY_PROCESSOR_CLASS = {"CLIPProcessor": "CLIPImageProcessor", "LlavaProcessor": "LlavaImageProcessor",
                       "SiglipProcessor": "SiglipImageProcessor", "PaliGemmaProcessor": "SiglipImageProcessor",
                       "Gemma3Processor": "Gemma3ImageProcessor", "Qwen2VLProcessor": "Qwen2VLImageProcessor",
                       "Qwen2_5_VLProcessor": "Qwen2VLImageProcessor"}
# keys that name things or only matter elsewhere (the processor, the torchvision backend); checked
# for their JSON type, otherwise ignored
_INFO_KEYS = {"image_processor_type": str, "feature_extractor_type": str, "processor_class": str,
              "image_seq_length": int, "disable_grouping": bool}
# keys ImagesKwargs has that must hold their neutral value here
_NEUTRAL = {"data_format": ("channels_first",), "input_data_format": (), "device": (), "return_tensors": (),
            "pad_size": ()}
_QWEN_KEYS = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size")
_PAS_KEYS = ("pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops", "pan_and_scan_min_ratio_to_activate")
_VALID_SIZE_KEYS = ({"height", "width"}, {"shortest_edge"}, {"shortest_edge", "longest_edge"}, {"longest_edge"},
                    {"max_height", "max_width"}, {"min_pixels", "max_pixels"})

_WHERE = "preprocessor_config.json"


def processor_class_name(d: dict, model_type: str | None = None) -> str:
    """The transformers image processor class ``d`` selects, without backend suffix (as
    AutoImageProcessor resolves it: image_processor_type, else feature_extractor_type with
    FeatureExtractor -> ImageProcessor, else the model config's ``model_type``; graphkiln also takes
    processor_class). ValueError when none of them names one."""
    for key in ("image_processor_type", "feature_extractor_type"):
        name = d.get(key)
        if name is not None:
            if type(name) is not str:
                raise ValueError(f"{_WHERE}: {key} must be a string (got {show_json(name)})")
            name = name.replace("FeatureExtractor", "ImageProcessor")
            for suffix in ("Fast", "Pil"):
                name = name.removesuffix(suffix)
            return name
    if model_type is not None:
        if model_type in _BY_MODEL_TYPE:
            return _BY_MODEL_TYPE[model_type]
        raise ValueError(f"{_WHERE} names no image_processor_type and graphkiln has no image processor for model "
                         f"type {show_json(model_type)}: add image_processor_type to {_WHERE}")
    pc = d.get("processor_class")
    if type(pc) is str and pc in _BY_PROCESSOR_CLASS:
        return _BY_PROCESSOR_CLASS[pc]
    raise ValueError(f"{_WHERE} names no image processor (no image_processor_type, feature_extractor_type or known "
                     f"processor_class): add \"image_processor_type\", e.g. \"CLIPImageProcessor\"")


def preprocessing_from_config(d: dict, model_type: str | None = None) -> ImagePreprocessing:
    """Parse a checkpoint's ``preprocessor_config.json`` (as a dict) into an ``ImagePreprocessing``,
    with the defaults of the transformers 5.24 class it names (``model_type``, the model config's,
    is the fallback transformers uses when it names none). A key left out takes the class default;
    a null one is None, as transformers 5.24 reads it (false for a flag, so Gemma3's released
    ``"do_convert_rgb": null`` means no RGB conversion; refused where a value is needed). Strict:
    a wrong JSON type, an unknown key, an unknown processor or an option graphkiln does not
    reproduce (pan-and-scan, a size form the processor would not take, ...) is a one-line
    ValueError saying what to change.
    """
    if not isinstance(d, dict):
        raise ValueError(f"{_WHERE} must hold a JSON object (got {type(d).__name__})")
    if "auto_map" in d:
        raise ValueError(f"{_WHERE} has auto_map: its image processor is Python code of the checkpoint's own, which "
                         "graphkiln does not run; use a checkpoint with a transformers image processor")
    cls = processor_class_name(d, model_type)
    if cls not in _DEFAULTS:
        raise ValueError(f"{_WHERE}: image processor {show_json(cls)} is not supported (graphkiln reproduces "
                         f"{', '.join(_DEFAULTS)}): use a checkpoint with one of these")
    kind = _KIND_OF[cls]
    defaults = _DEFAULTS[cls]
    known = set(defaults) | set(_INFO_KEYS) | set(_NEUTRAL) | {"do_center_crop", "crop_size", "do_pad"}
    if kind == "qwen2_vl":
        known |= set(_QWEN_KEYS)
    if kind == "gemma3":
        known |= set(_PAS_KEYS) | {"do_pan_and_scan"}
    for key in d:
        if key not in known:
            raise ValueError(f"{_WHERE}: {show_json(key)} is not an option of {cls} that graphkiln reproduces: "
                             f"remove it if it has no effect, or use a checkpoint without it")

    for key, typ in _INFO_KEYS.items():
        if d.get(key) is not None and type(d[key]) is not typ:
            raise ValueError(f"{_WHERE}: {key} must be a {typ.__name__} (got {show_json(d[key])})")
    for key, allowed in _NEUTRAL.items():
        if d.get(key) is not None and d[key] not in allowed:
            raise ValueError(f"{_WHERE}: {key} {show_json(d[key])} is not supported (graphkiln takes "
                             f"{' or '.join(map(show_json, allowed + (None,)))}): remove it")

    def get(key: str) -> Any:
        # a key left out takes the class default; a null one stays None, as in transformers (its
        # ImageProcessingMixin.__init__ sets the instance attribute to None first): None is false
        # for a flag and refused where a value is needed
        return d[key] if key in d else defaults.get(key)

    flags = {}
    for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb", "do_center_crop", "do_pad",
                "default_to_square", "do_pan_and_scan"):
        value = get(key)
        if value is not None and type(value) is not bool:
            raise ValueError(f"{_WHERE}: {key} must be true, false or null (got {show_json(value)})")
        flags[key] = bool(value)

    def needed(key: str, flag: str) -> Any:
        value = get(key)
        if value is None and flags[flag]:
            raise ValueError(f"{_WHERE}: {key} is null but {flag} is true (transformers would fail too): set {key} "
                             "or remove it for the default")
        return defaults[key] if value is None else value

    if flags["do_pan_and_scan"]:
        raise ValueError(f"{_WHERE}: do_pan_and_scan is true: graphkiln does not implement Gemma3's pan-and-scan "
                         "crops; set it to false (or null) to export this model")
    for key in _PAS_KEYS:
        if d.get(key) is not None and type(d[key]) not in (int, float):
            raise ValueError(f"{_WHERE}: {key} must be a number or null (got {show_json(d[key])})")

    resample = needed("resample", "do_resize")
    if type(resample) is not int or resample not in RESAMPLE_NAMES:
        raise ValueError(f"{_WHERE}: resample must be one of Pillow's filters 0-5 "
                         f"({', '.join(f'{v}={k}' for k, v in sorted(RESAMPLE.items(), key=lambda kv: kv[1]))}) "
                         f"(got {show_json(resample)})")
    rescale_factor = needed("rescale_factor", "do_rescale")
    if type(rescale_factor) not in (int, float):
        raise ValueError(f"{_WHERE}: rescale_factor must be a number (got {show_json(rescale_factor)})")
    mean = _triple(needed("image_mean", "do_normalize"), "image_mean")
    std = _triple(needed("image_std", "do_normalize"), "image_std")

    fields: dict[str, Any] = dict(
        kind=kind, resample=RESAMPLE_NAMES[resample], do_resize=flags["do_resize"], do_rescale=flags["do_rescale"],
        rescale_factor=float(rescale_factor), do_normalize=flags["do_normalize"], image_mean=mean, image_std=std,
        do_convert_rgb=flags["do_convert_rgb"])

    if kind == "qwen2_vl":
        # Qwen2VLImageProcessor.__init__: a null size is the class default, and top-level
        # min_pixels / max_pixels override the size dict's edges
        size = _size_dict(defaults["size"] if d.get("size") is None else d["size"], "size", flags["default_to_square"])
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if d.get(key) is not None:
                size[edge] = _int(d[key], key)
                size.pop(key, None)
        if set(size) != {"shortest_edge", "longest_edge"}:
            raise ValueError(f"{_WHERE}: {cls} needs size {{\"shortest_edge\": min_pixels, \"longest_edge\": "
                             f"max_pixels}} (or min_pixels and max_pixels), got size keys {sorted(size)}")
        fields.update(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"],
                      **{k: _int(get(k), k) for k in ("patch_size", "temporal_patch_size", "merge_size")})
        if not flags["do_resize"]:
            raise ValueError(f"{_WHERE}: do_resize is {show_json(d.get('do_resize'))}: {cls} needs its smart resize for "
                             "the patch grid; set it to true")
    else:
        if flags["do_resize"]:
            size = _size_dict(needed("size", "do_resize"), "size", flags["default_to_square"])
            if set(size) == {"height", "width"}:
                fields["size"] = (size["height"], size["width"])
            elif set(size) == {"shortest_edge"} and kind != "gemma3":
                fields["shortest_edge"] = size["shortest_edge"]
            else:
                raise ValueError(f"{_WHERE}: size with keys {sorted(size)} is not supported for {cls} (graphkiln "
                                 "takes {\"height\", \"width\"}" + (" or {\"shortest_edge\"}" if kind != "gemma3" else "")
                                 + ")")
        # Gemma3ImageProcessor never center-crops (its _preprocess has no crop step)
        if flags["do_center_crop"] and kind != "gemma3":
            crop = _size_dict(needed("crop_size", "do_center_crop"), "crop_size", True)
            if set(crop) != {"height", "width"}:
                raise ValueError(f"{_WHERE}: crop_size must have height and width (got keys {sorted(crop)})")
            fields.update(do_center_crop=True, crop_size=(crop["height"], crop["width"]))
        if cls == "LlavaImageProcessor":
            fields["pad_to_square"] = flags["do_pad"]
        elif flags["do_pad"] and d.get("pad_size") is not None:  # (pad_size is refused above anyway)
            raise ValueError(f"{_WHERE}: do_pad with pad_size is not supported: remove them")
        # otherwise do_pad pads a batch to its largest image, and every image comes out the same size
    try:
        return ImagePreprocessing(**fields).validated(what="")
    except ValueError as exc:
        raise ValueError(f"{_WHERE} ({cls}): {exc}: fix {_WHERE} or use a checkpoint graphkiln supports") from None


def _int(value: Any, name: str) -> int:
    if type(value) is not int:
        raise ValueError(f"{_WHERE}: {name} must be an integer (got {show_json(value)})")
    return value


def _triple(value: Any, name: str) -> tuple[float, float, float]:
    if type(value) in (int, float):  # one value for every channel, as transformers' normalize takes it
        value = [value] * 3
    if not isinstance(value, (list, tuple)) or len(value) != 3 or any(type(v) not in (int, float) for v in value):
        raise ValueError(f"{_WHERE}: {name} must be a number or a list of 3 numbers, one per RGB channel "
                         f"(got {show_json(value)})")
    return tuple(float(v) for v in value)


def _size_dict(value: Any, name: str, default_to_square: bool) -> dict[str, int]:
    """transformers' get_size_dict: an int is (n, n) or a shortest edge, a 2-list (height, width)."""
    if type(value) is int:
        size = {"height": value, "width": value} if default_to_square else {"shortest_edge": value}
    elif isinstance(value, (list, tuple)) and len(value) == 2:
        size = {"height": value[0], "width": value[1]}
    elif isinstance(value, dict):
        size = dict(value)
    else:
        raise ValueError(f"{_WHERE}: {name} must be an integer, [height, width] or a dict (got {show_json(value)})")
    if set(size) not in _VALID_SIZE_KEYS:
        raise ValueError(f"{_WHERE}: {name} keys {sorted(size)} are not a size transformers takes")
    for key, v in size.items():
        if type(v) is not int:
            raise ValueError(f"{_WHERE}: {name}.{key} must be an integer (got {show_json(v)})")
    return size
