"""What an artifact's LoRA inputs are, and what an adapter may be called: the vocabulary the
reader, the pool, the CLI and the server share."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from graphkiln.errors import GraphkilnError
from graphkiln.untrusted import show

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Where each projection lives inside a decoder layer, as PEFT names it for a Llama-style
# ``*ForCausalLM`` (checked against peft's own output in tests/test_lora_adapters.py); other
# families' artifacts record their own paths (``manifest.LoraSpec.module_paths``).
_CONTAINER = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
LLAMA_MODULE_PATHS = {m: f"model.layers.{{layer}}.{c}.{m}" for m, c in _CONTAINER.items()}

MAX_NAME_CHARS = 256  # the bound of a request's ``model``, which names an adapter


@dataclass(frozen=True)
class LoraTarget:
    """One projection of one layer the artifact takes adapter stacks for: ``x[.., in] -> [.., out]``."""

    layer: int
    module: str  # one of MODULES
    in_features: int
    out_features: int

    def __post_init__(self):
        if self.module not in MODULES:
            raise ValueError(f"LoraTarget module {self.module!r} is not one of {', '.join(MODULES)}")
        for field in ("layer", "in_features", "out_features"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if field == "layer" else 1):
                raise ValueError(f"LoraTarget {field} must be a {'non-negative' if field == 'layer' else 'positive'} "
                                 f"int, not {value!r}")

    @property
    def key(self) -> tuple[int, str]:
        return (self.layer, self.module)


def check_adapter_name(name) -> str:
    """``name`` if an adapter may be called that: 1-256 printable characters (no control
    character, no line or paragraph separator) without surrounding whitespace, since clients send
    it as a request's ``model`` and a padded twin of a name would be a different model. Else one
    GraphkilnError line. The pool, ``serve --lora NAME=DIR`` and ``/v1/load_lora_adapter`` apply it."""
    if (not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or not name.isprintable()
            or name != name.strip()):
        raise GraphkilnError(f"LoRA adapter name {show(name)} is not a usable name: give 1-{MAX_NAME_CHARS} "
                             f"printable characters without surrounding spaces")
    return name


def module_list(targets: Iterable[LoraTarget]) -> str:
    """The modules ``targets`` cover, in MODULES order, for a message."""
    present = {t.module for t in targets}
    return ", ".join(m for m in MODULES if m in present) or "none"


def lora_targets_flag(modules: Iterable[str]) -> str:
    """``modules`` as export's --lora-targets value (q,k,v,...)."""
    return ",".join(m.removesuffix("_proj") for m in MODULES if m in set(modules))
