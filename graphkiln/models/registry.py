"""Architecture name (config.json ``architectures[0]``) -> model family.

A family is a small module that turns a raw HF config dict into a ``DecoderConfig`` and
maps our parameter names to checkpoint tensor names. Families register on import; the
registry imports the built-in ones lazily so ``graphkiln.models`` stays torch-free.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from graphkiln.errors import GraphkilnError
from graphkiln.models.config import DecoderConfig
from graphkiln.models.sources import Source

_BUILTIN_FAMILY_MODULES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "lfm2", "lfm2_moe", "lfm3",
                          "gemma3", "llava", "gemma3_vl", "qwen2_5_vl", "qwen3_5", "qwen3_5_moe", "qwen3_next",
                          "nemotron_h", "granitemoehybrid", "gpt_oss", "phi3")


@dataclass(frozen=True)
class ModelFamily:
    """How one HF architecture becomes an export-friendly decoder."""

    architecture: str
    parse_config: Callable[[dict], DecoderConfig]
    # Canonical parameter name -> where its tensor comes from in the checkpoint. Identity
    # for the Llama-style families because the canonical names are Llama's on purpose.
    source: Callable[[str, DecoderConfig], Source] = lambda name, cfg: name
    # A vision-language model's vision graph spec (models.vision); None for a text-only model.
    vision: object | None = None
    # The graphs its artifact holds (models.graphs): (cfg, stage ranges or None) -> GraphPlans in
    # export order; None: the default (the decoder or its stages, then the vision graph if any).
    graphs: Callable[[DecoderConfig, tuple | None], tuple] | None = None

    def graph_specs(self, cfg: DecoderConfig, stage_ranges: tuple | None) -> tuple:
        """The ``models.graphs.GraphPlan``s export runs its loop over, in order."""
        from graphkiln.models.graphs import default_graph_specs

        if self.graphs is not None:
            return self.graphs(cfg, stage_ranges)
        return default_graph_specs(self.vision is not None, stage_ranges)


_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    _FAMILIES[family.architecture] = family
    return family


def _load_builtins() -> None:
    for name in _BUILTIN_FAMILY_MODULES:
        importlib.import_module(f"graphkiln.models.{name}")


def supported_architectures() -> list[str]:
    _load_builtins()
    return sorted(_FAMILIES)


def family_for(architecture: str) -> ModelFamily:
    _load_builtins()
    try:
        return _FAMILIES[architecture]
    except KeyError:
        raise GraphkilnError(
            f"unsupported architecture '{architecture}': graphkiln exports "
            f"{', '.join(supported_architectures())}"
        ) from None
