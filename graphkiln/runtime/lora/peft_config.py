"""``adapter_config.json``: a plain LoRA that graphkiln can apply exactly, and per module its rank
and the scale folded into B. Untrusted: read non-blocking and bounded, parsed with
``untrusted.parse_json`` (deep nesting, long integers and bad UTF-8 are one line), every option
checked; one ``GraphkilnError`` line per refusal."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from graphkiln.runtime.lora.adapter_dir import CONFIG, FILES_FIX, refuse
from graphkiln.untrusted import parse_json, read_regular, show

# Options that change what the adapter computes (or need weights graphkiln does not have): each
# refused with its own reason. Values that mean "off" (null, false, empty) pass.
_REFUSED_OPTIONS = {
    "fan_in_fan_out": "stores weights transposed for Conv1D (GPT-2-style) layers",
    "use_dora": "is a DoRA adapter (a learned magnitude per output column, not a plain low-rank update)",
    "lora_bias": "trains a bias on lora_B",
    "modules_to_save": "carries fully trained copies of whole modules (modules_to_save)",
    "trainable_token_indices": "carries trained token embeddings (trainable_token_indices)",
    "layer_replication": "replicates base layers (layer_replication)",
    "target_parameters": "adapts raw parameters such as MoE expert weights (target_parameters)",
    "alora_invocation_tokens": "is an activated LoRA (applies only after its invocation tokens)",
    "use_qalora": "is a QA-LoRA adapter (pooled inputs)",
    "use_bdlora": "is a block-diagonal LoRA adapter (use_bdlora)",
    "arrow_config": "routes between several LoRA experts per token (Arrow)",
    "velora_config": "is a VeLoRA adapter",
    "monteclora_config": "is a MonteCLoRA adapter",
    "kasa_config": "is a KaSA adapter",
}

# Every other adapter_config.json key graphkiln knows and ignores: they describe training, which
# modules PEFT wraps (the tensors themselves say that), or initialisation that leaves the base
# model untouched. A key outside both lists is refused when set, because a future PEFT option
# may change the forward pass and a silently wrong adapter is worse than a refused one.
_IGNORED_OPTIONS = {
    "peft_type", "peft_version", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "bias",
    "init_lora_weights", "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern",
    "task_type", "base_model_name_or_path", "revision", "inference_mode", "lora_dropout", "auto_mapping",
    "loftq_config", "eva_config", "corda_config", "lora_ga_config", "megatron_config", "megatron_core",
    "qalora_group_size", "runtime_config", "ensure_weight_tying",
}

# init_lora_weights values whose initialisation rewrites the base weights (the adapter is then a
# delta against a residual model graphkiln does not have) until PEFT converts it back.
_BASE_REWRITING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")

_MAX_CONFIG_BYTES = 1 << 20  # PEFT's configs are a few KiB; rank/alpha patterns of a big model fit too


@dataclass(frozen=True)
class Scaling:
    """The config's rank and alpha rules: per module, PEFT's rank_pattern / alpha_pattern lookup."""

    r: int
    alpha: float
    rslora: bool
    rank_pattern: tuple[tuple[str, int], ...]
    alpha_pattern: tuple[tuple[str, float], ...]

    @staticmethod
    def _lookup(patterns, module_path: str, default):
        # peft.utils.other.get_pattern_key: the first key (in the file's order) that matches the end of
        # the module path at a '.' boundary. Keys were checked to hold no regex operators, so this
        # evaluates them exactly as PEFT does without running an untrusted expression.
        for key, value in patterns:
            if re.match(rf"(.*\.)?({key})$", module_path):
                return value
        return default

    def rank_of(self, module_path: str) -> int:
        return self._lookup(self.rank_pattern, module_path, self.r)

    def scale_of(self, module_path: str) -> float:
        r = self.rank_of(module_path)
        alpha = self._lookup(self.alpha_pattern, module_path, self.alpha)
        return alpha / math.sqrt(r) if self.rslora else alpha / r


def positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_SIMPLE_PATTERN_KEY = re.compile(r"\^?[A-Za-z0-9_.]+\$?")


def _patterns(path: Path, config: dict, field: str, valid, what: str) -> tuple:
    patterns = config.get(field) or {}
    if not isinstance(patterns, dict):
        raise refuse(path, f"{CONFIG} {field} is {type(patterns).__name__}, not an object of module path -> {what}; "
                           f"fix or remove it")
    for key, value in patterns.items():
        if not _SIMPLE_PATTERN_KEY.fullmatch(key):
            raise refuse(path, f"{CONFIG} {field} key {show(key)} is a regular expression graphkiln does not "
                               f"evaluate; spell it as a plain module path such as 'model.layers.3.self_attn.q_proj' "
                               f"or 'q_proj' (one key per module)")
        if not valid(value):
            raise refuse(path, f"{CONFIG} {field}[{show(key)}] is {show(value)}, not a {what}; fix the adapter's "
                               f"config")
    return tuple(patterns.items())


def read_config(path: Path, rank: int) -> Scaling:
    """Validate directory ``path``'s adapter_config.json: a plain LoRA graphkiln can apply exactly,
    rank <= the artifact's ``rank``."""
    file = path / CONFIG
    raw = read_regular(file, "LoRA adapter file", FILES_FIX, _MAX_CONFIG_BYTES)
    config = parse_json(raw, f"LoRA adapter file {show(str(file), 200)}",
                        "re-save the adapter with PEFT's save_pretrained")
    if not isinstance(config, dict):
        raise refuse(path, f"{CONFIG} holds a JSON {type(config).__name__}, not an object; re-save the adapter with "
                           f"PEFT's save_pretrained")

    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise refuse(path, f"peft_type is {show(peft_type)}; graphkiln applies only LoRA adapters (peft_type "
                           f"'LORA'): merge this adapter into the model and export that instead")
    if config.get("bias", "none") != "none":
        raise refuse(path, f"bias is {show(config.get('bias'))}: the adapter trained the base model's biases, which "
                           f"graphkiln cannot swap per request; retrain with bias='none' or merge the adapter and "
                           f"export the merged model")
    for option, reason in _REFUSED_OPTIONS.items():
        if config.get(option) not in (None, False, [], {}, ""):
            raise refuse(path, f"{option} is set: the adapter {reason}, which graphkiln cannot apply as a plain "
                               f"LoRA; merge the adapter into the model and export that instead")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise refuse(path, f"init_lora_weights is {show(init)}, which rewrites the base weights: the adapter is "
                           f"relative to a residual model, not the exported one; convert it with PEFT's "
                           f"save_pretrained(..., path_initial_model_for_weight_conversion=...) first")
    for option, value in config.items():
        if option not in _IGNORED_OPTIONS and option not in _REFUSED_OPTIONS and value not in (None, False, [], {}, ""):
            raise refuse(path, f"{CONFIG} sets {show(option)} = {show(value, 40)}, a PEFT option graphkiln does not "
                               f"know how to apply; save the adapter without it (plain LoRA)")

    r, alpha, rslora = config.get("r"), config.get("lora_alpha"), config.get("use_rslora", False)
    if not positive_int(r):
        raise refuse(path, f"r is {show(r)}, not a positive integer; fix the adapter's config")
    if not _finite_number(alpha):
        raise refuse(path, f"lora_alpha is {show(alpha)}, not a finite number; fix the adapter's config")
    if not isinstance(rslora, bool):
        raise refuse(path, f"use_rslora is {show(rslora)}, not true/false; fix the adapter's config")
    rank_pattern = _patterns(path, config, "rank_pattern", positive_int, "positive integer rank")
    alpha_pattern = _patterns(path, config, "alpha_pattern", _finite_number, "finite number")
    # Refused here, before any tensor is read, with the flag that fixes it. (A pattern entry that
    # matches no module is still counted: PEFT's own max rank counts it too.)
    biggest = max([r, *(v for _, v in rank_pattern)])
    if biggest > rank:
        raise refuse(path, f"adapter rank {biggest} is above the artifact's LoRA rank {rank}; re-export with "
                           f"--lora-rank {biggest} (or more)")
    return Scaling(r, float(alpha), rslora, rank_pattern, alpha_pattern)
