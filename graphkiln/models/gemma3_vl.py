"""Gemma3ForConditionalGeneration: a SigLIP tower and Gemma3's pooled projector in front of the
Gemma3 text decoder (``models.gemma3``, no second implementation).

Text: ``text_config`` (model_type gemma3_text) goes through ``gemma3.parse_text_config`` with the
vision seam on and ``image_lookahead`` on, so an image's tokens see the whole image as
transformers' OR(causal, same-image) mask does (sliding layers AND their window). Tied
embeddings follow the top-level ``tie_word_embeddings`` (the flag PreTrainedModel reads for the
composite model). Checkpoint names are the text family's under ``model.language_model.``
(transformers 5 in memory) or ``language_model.model.`` (hub checkpoints and what
transformers 5.24 saves; ``lm_head`` likewise).

Vision (``models.vision`` contract): transformers' own SiglipVisionModel built from
``vision_config`` (eager attention, so it traces to plain ONNX ops) and its
Gemma3MultiModalProjector: the last hidden state as a (image_size / patch_size)^2 grid,
average-pooled to ``mm_tokens_per_image`` tokens, RMSNorm'd (1 + w) and projected to the text
hidden size, as Gemma3Model.get_image_features does. Tower tensors sit under
``[model.]vision_tower.[vision_model.]``, the projector's under ``[model.]multi_modal_projector.``.

Prompt: the user writes ``<start_of_image>`` (``boi_token_index``, the artifact's image token)
where each image goes; Gemma3Processor replaces it with ``"\\n\\n" <start_of_image>
<image_soft_token> x mm_tokens_per_image <end_of_image> "\\n\\n"``. The placeholder rule records
that (``imaging.PlaceholderRule``: row token ``image_token_index``, prefix and suffix ids, the
newline ids read from the checkpoint's tokenizer.json by ``_complete``).

Refused rather than approximated: pan-and-scan (preprocessing), a ``mm_tokens_per_image`` that
is not a square or does not pool the patch grid evenly, a processor ``image_seq_length`` other
than ``mm_tokens_per_image``, a tower other than SigLIP's, token ids that collide or fall outside
the vocabulary, a tokenizer whose image tokens disagree with config.json.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from graphkiln.errors import GraphkilnError
from graphkiln.imaging import PlaceholderRule
from graphkiln.models import gemma3
from graphkiln.models.config import DecoderConfig, config_error
from graphkiln.models.registry import ModelFamily, register
from graphkiln.models.sources import Source
from graphkiln.models.vision import VisionConfig, VisionFamily, square_image_config, sub_config, text_source_in_vlm

ARCH = "Gemma3ForConditionalGeneration"
TOWER = "siglip_vision_model"
_TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
# Gemma3Config's defaults (transformers 5.24) for keys a config.json may leave out
DEFAULT_TOKENS = {"boi_token_index": 255_999, "eoi_token_index": 256_000, "image_token_index": 262_144}
DEFAULT_MM_TOKENS = 256
# SiglipVisionConfig's defaults
DEFAULT_IMAGE_SIZE, DEFAULT_PATCH_SIZE = 224, 16
# the text Gemma3Processor puts around each image's tokens (its full_image_sequence)
NEWLINES = "\n\n"
TOKEN_TEXT = {"boi_token_index": "<start_of_image>", "eoi_token_index": "<end_of_image>",
              "image_token_index": "<image_soft_token>"}


def _int(d: dict, key: str, default: int, where: str = "", minimum: int = 1) -> int:
    value = d.get(key, default)
    if type(value) is not int or value < minimum:
        raise config_error(f"{where}{key}", value, "a positive integer" if minimum == 1 else f"an integer >= {minimum}")
    return value


def _parse_text(raw: dict) -> DecoderConfig:
    text = dict(sub_config(raw, "text_config"))
    model_type = text.get("model_type", "gemma3_text")
    if model_type != "gemma3_text":
        raise GraphkilnError(f"config.json: text_config.model_type {model_type!r} is not supported for {ARCH}: "
                             "graphkiln exports its gemma3_text language model only")
    tie = raw.get("tie_word_embeddings", True)
    if not isinstance(tie, bool):
        raise config_error("tie_word_embeddings", tie, "true or false")
    text.update(architectures=[gemma3.ARCH], tie_word_embeddings=tie)
    return dataclasses.replace(gemma3.parse_text_config(text), vision_seam=True, image_lookahead=True)


def _source(name: str, cfg: DecoderConfig) -> Source:
    return text_source_in_vlm(gemma3._source(name, cfg))


def _token_ids(raw: dict, vocab: int) -> dict[str, int]:
    ids = {key: _int(raw, key, default, minimum=0) for key, default in DEFAULT_TOKENS.items()}
    for key, value in ids.items():
        if value >= vocab:
            raise GraphkilnError(f"config.json: {key} {value} is outside the text vocabulary [0, {vocab}): fix "
                                 f"{key} or text_config.vocab_size")
    if len(set(ids.values())) != len(ids):
        raise GraphkilnError(f"config.json: boi_token_index, eoi_token_index and image_token_index must differ (got "
                             f"{', '.join(map(str, ids.values()))}): fix config.json")
    return ids


def _parse_vision(raw: dict, preprocessor: dict) -> VisionConfig:
    vision = sub_config(raw, "vision_config")
    model_type = vision.get("model_type", TOWER)
    if model_type != TOWER:
        raise GraphkilnError(f"config.json: vision_config.model_type {model_type!r} is not supported for {ARCH}: "
                             f"graphkiln exports its {TOWER} tower only")
    size = _int(vision, "image_size", DEFAULT_IMAGE_SIZE, "vision_config.")
    patch = _int(vision, "patch_size", DEFAULT_PATCH_SIZE, "vision_config.")
    tokens = _int(raw, "mm_tokens_per_image", DEFAULT_MM_TOKENS)
    side, grid = math.isqrt(tokens), size // patch
    # Gemma3MultiModalProjector pools the grid with kernel grid // side: it must give side x side tokens
    if side * side != tokens or grid < side or grid // (grid // side) != side:
        raise GraphkilnError(f"config.json: mm_tokens_per_image {tokens} does not pool the tower's {grid}x{grid} patch "
                             "grid into a square of that many tokens (it must be a square number n*n with n dividing "
                             f"image_size // patch_size = {grid}): fix mm_tokens_per_image")
    text = sub_config(raw, "text_config")
    ids = _token_ids(raw, _int(text, "vocab_size", 262_208, "text_config."))
    seq = preprocessor.get("image_seq_length") if isinstance(preprocessor, dict) else None
    if seq is not None and seq != tokens:
        raise GraphkilnError(f"preprocessor_config.json: image_seq_length {seq!r} differs from config.json's "
                             f"mm_tokens_per_image {tokens}: the processor and the model must agree; fix one of them")
    rule = PlaceholderRule("fixed", tokens_per_image=tokens, row_token_id=ids["image_token_index"],
                           prefix_ids=(ids["boi_token_index"],), suffix_ids=(ids["eoi_token_index"],))
    return square_image_config(ids["boi_token_index"], size, rule, preprocessor, "gemma3", raw)


def _complete(src: Path, vcfg: VisionConfig) -> VisionConfig:
    """The rule's prefix and suffix with the ids of the processor's "\\n\\n", from tokenizer.json;
    the tokenizer's image tokens, where it names them, must be config.json's."""
    from tokenizers import Tokenizer

    path = src / "tokenizer.json"
    if not path.is_file():
        raise GraphkilnError(f"{src} has no tokenizer.json: {ARCH}'s processor wraps each image in \"\\n\\n\" text whose "
                             "token ids come from it; save the tokenizer with the model (processor.save_pretrained)")
    try:
        tok = Tokenizer.from_file(str(path))
        newlines = tok.encode(NEWLINES, add_special_tokens=False).ids
    except Exception as exc:
        raise GraphkilnError(f"tokenizer.json cannot be read ({' '.join(str(exc).split())[:160]}): fix or re-save "
                             "the tokenizer") from None
    if not newlines:
        raise GraphkilnError("tokenizer.json encodes \"\\n\\n\" to no token, but Gemma3's processor puts it around each "
                             "image: use the checkpoint's own tokenizer")
    rule = vcfg.placeholder
    expected = {"boi_token_index": rule.prefix_ids[-1], "eoi_token_index": rule.suffix_ids[0],
                "image_token_index": rule.row_token_id}
    for key, tid in expected.items():
        got = tok.token_to_id(TOKEN_TEXT[key])
        if got is not None and got != tid:
            raise GraphkilnError(f"tokenizer.json has {TOKEN_TEXT[key]} as id {got} but config.json's {key} is {tid}: "
                                 "the tokenizer and the model disagree; fix one of them")
    rule = dataclasses.replace(rule, prefix_ids=(*newlines, *rule.prefix_ids), suffix_ids=(*rule.suffix_ids, *newlines))
    try:
        rule = rule.validated()
    except ValueError as exc:
        raise GraphkilnError(f"{exc}: tokenizer.json encodes \"\\n\\n\" to too many tokens") from None
    return dataclasses.replace(vcfg, placeholder=rule)


def _reads(name: str) -> bool:
    return name.startswith(_TOWER_PREFIXES + _PROJECTOR_PREFIXES)


def _modules(vcfg: VisionConfig, device: str):
    import torch
    from transformers import Gemma3Config, SiglipVisionModel
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

    raw = {k: v for k, v in vcfg.raw.items() if k not in ("architectures", "transformers_version", "auto_map")}
    cfg = Gemma3Config(**raw)
    cfg.vision_config._attn_implementation = "eager"  # plain MatMul/Softmax in the graph
    with torch.device(device):
        return SiglipVisionModel(cfg.vision_config), Gemma3MultiModalProjector(cfg)


def _check(src: Path, vcfg: VisionConfig) -> None:
    from graphkiln.models.llava_vision import match_tensors
    from graphkiln.models.weights import tensor_headers

    tower, projector = _modules(vcfg, "meta")
    headers = tensor_headers(src)
    match_tensors(tower, headers, _TOWER_PREFIXES, "vision tower")
    match_tensors(projector, headers, _PROJECTOR_PREFIXES, "projector")


def _build(src: Path, vcfg: VisionConfig, dtype: str):
    """The vision graph's torch module with the checkpoint's weights (see the module docstring)."""
    from torch import nn

    from graphkiln.models.llava_vision import load_tensors
    from graphkiln.models.weights import tensor_headers

    class Gemma3VisionForExport(nn.Module):
        def __init__(self, tower: nn.Module, projector: nn.Module) -> None:
            super().__init__()
            self.tower, self.projector = tower, projector

        def forward(self, pixel_values):
            dtype = self.projector.mm_input_projection_weight.dtype
            x = self.projector(self.tower(pixel_values=pixel_values.to(dtype)).last_hidden_state)
            return x.reshape(-1, x.shape[-1])

    # on the CPU, not the meta device: the tower's non-persistent buffers (position ids) are not in
    # the checkpoint
    tower, projector = _modules(vcfg, "cpu")
    headers = tensor_headers(src)
    load_tensors(tower, src, headers, _TOWER_PREFIXES, dtype, "vision tower")
    load_tensors(projector, src, headers, _PROJECTOR_PREFIXES, dtype, "projector")
    return Gemma3VisionForExport(tower, projector).eval()


# cfg.raw is the text config (what the rope init functions and _source read), not the VLM's
FAMILY = register(ModelFamily(ARCH, _parse_text, _source,
                              vision=VisionFamily(_parse_vision, _reads, _check, _build, complete=_complete)))
