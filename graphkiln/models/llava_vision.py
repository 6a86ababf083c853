"""The torch module of LLaVA's vision graph (see ``models.llava``): transformers' own tower and
LLaVA's projector, with the checkpoint's weights, whose forward is the ``models.vision`` contract.

Below ``models.llava``: what config.json says (the tower's transformers class, the hidden states
the projector reads) the family parses and passes in; nothing here imports the family."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from graphkiln.errors import GraphkilnError
from graphkiln.models.vision import VisionConfig
from graphkiln.models.weights import read_tensors, tensor_headers


class LlavaVisionForExport(nn.Module):
    def __init__(self, tower: nn.Module, projector: nn.Module, layers: tuple[int, ...], drop_first: bool) -> None:
        super().__init__()
        self.tower, self.projector = tower, projector
        self.layers, self.drop_first = layers, drop_first

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        dtype = self.projector.linear_1.weight.dtype
        hidden = self.tower(pixel_values.to(dtype), output_hidden_states=True).hidden_states
        picked = [hidden[k][:, 1:] if self.drop_first else hidden[k] for k in self.layers]
        x = self.projector(torch.cat(picked, dim=-1) if len(picked) > 1 else picked[0])
        return x.reshape(-1, x.shape[-1])


def _prefix(names: list[str], prefixes: tuple[str, ...], what: str) -> str:
    """The checkpoint layout's prefix for a module (transformers 5 saves, then earlier ones)."""
    for p in prefixes:
        if any(n.startswith(p) for n in names):
            return p
    raise GraphkilnError(f"checkpoint has no {what} weights (no tensor under {' or '.join(prefixes)}): the safetensors "
                         "files do not match config.json")


def match_tensors(module: nn.Module, headers: dict[str, dict], prefixes: tuple[str, ...], what: str) -> dict[str, str]:
    """module state key -> checkpoint tensor name: every key found, nothing else under the
    prefix, the shapes config.json implies, float types; from the shard headers alone."""
    names = list(headers)
    prefix = _prefix(names, prefixes, what)
    wanted = {n[len(prefix):]: n for n in names if n.startswith(prefix)}
    expected = module.state_dict()
    nested = "vision_model."  # earlier transformers nested the tower's modules one level deeper
    if wanted and all(k.startswith(nested) for k in wanted) and not any(k.startswith(nested) for k in expected):
        wanted = {k[len(nested):]: n for k, n in wanted.items()}
    missing, unexpected = sorted(set(expected) - set(wanted)), sorted(set(wanted) - set(expected))
    if missing:
        raise GraphkilnError(f"checkpoint is missing weight '{prefix}{missing[0]}': the safetensors files do not match "
                             f"config.json's {what}")
    if unexpected:
        raise GraphkilnError(f"checkpoint has {what} tensor '{wanted[unexpected[0]]}' that nothing reads: config.json "
                             f"describes another {what} than the safetensors files")
    for key, name in wanted.items():
        shape, stored = tuple(headers[name]["shape"]), headers[name]["dtype"]
        if shape != tuple(expected[key].shape):
            raise GraphkilnError(f"checkpoint tensor '{name}' has shape {list(shape)}, but config.json implies "
                                 f"{list(expected[key].shape)}: fix config.json")
        if stored not in ("F32", "F16", "BF16", "F64"):
            raise GraphkilnError(f"checkpoint tensor '{name}' is stored as {stored}, not as a float type: export the "
                                 "unquantized float checkpoint")
    return wanted


def _modules(vcfg: VisionConfig, tower_class: str, device: str):
    import transformers
    from transformers import LlavaConfig
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    raw = {k: v for k, v in vcfg.raw.items() if k not in ("architectures", "transformers_version", "auto_map")}
    cfg = LlavaConfig(**raw)
    cfg.vision_config._attn_implementation = "eager"  # plain MatMul/Softmax in the graph
    with torch.device(device):
        tower = getattr(transformers, tower_class)(cfg.vision_config)
        projector = LlavaMultiModalProjector(cfg)
    return cfg, tower, projector


_TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def check_llava_vision(src: Path, vcfg: VisionConfig, tower_class: str) -> None:
    """What ``build_llava_vision`` would refuse about the weights, from the headers alone (export
    runs it before creating its output). ``tower_class``: the tower's transformers model class."""
    _, tower, projector = _modules(vcfg, tower_class, "meta")
    headers = tensor_headers(src)
    match_tensors(tower, headers, _TOWER_PREFIXES, "vision tower")
    match_tensors(projector, headers, _PROJECTOR_PREFIXES, "projector")


def load_tensors(module: nn.Module, src: Path, headers: dict[str, dict], prefixes: tuple[str, ...], dtype: str,
          what: str) -> None:
    wanted = match_tensors(module, headers, prefixes, what)
    tensors = read_tensors(src, list(wanted.values()), dtype)
    module.load_state_dict({key: tensors[name] for key, name in wanted.items()}, strict=True, assign=True)


def build_llava_vision(src: Path, vcfg: VisionConfig, dtype: str, tower_class: str,
                       layers: tuple[int, ...]) -> LlavaVisionForExport:
    """``layers``: the hidden-state indices the projector reads (0: the embeddings), in order."""
    # built on the CPU, not the meta device: the towers' non-persistent buffers (position ids) are
    # not in the checkpoint; a tower is small beside its decoder
    cfg, tower, projector = _modules(vcfg, tower_class, "cpu")
    headers = tensor_headers(src)
    load_tensors(tower, src, headers, _TOWER_PREFIXES, dtype, "vision tower")
    load_tensors(projector, src, headers, _PROJECTOR_PREFIXES, dtype, "projector")
    # layers past the deepest selected hidden state are never used: don't put them in the graph
    encoder = tower.encoder
    encoder.layers = encoder.layers[: max(max(layers), 1)]
    return LlavaVisionForExport(tower, projector, layers, cfg.vision_feature_select_strategy == "default").eval()
