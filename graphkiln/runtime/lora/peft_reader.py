"""``read_peft_adapter``: a PEFT LoRA directory validated completely against an artifact's LoRA
targets and turned into per-target (A, B) float32 pairs, before anything is written anywhere."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from graphkiln.runtime.lora.adapter_dir import WEIGHTS, adapter_directory, file_exists, open_file, refuse
from graphkiln.runtime.lora.peft_config import read_config
from graphkiln.runtime.lora.safetensors_index import read_tensor, safetensors_index
from graphkiln.runtime.lora.targets import LLAMA_MODULE_PATHS, MODULES, LoraTarget, lora_targets_flag, module_list
from graphkiln.untrusted import show

# PEFT saves the default adapter's weights as
#   base_model.model.<module path in the base model>.lora_A.weight   [r, in]
#   base_model.model.<module path in the base model>.lora_B.weight   [out, r]
# with the module path "model.layers.<i>.<self_attn|mlp>.<proj>" for a *ForCausalLM. The layer
# number is matched without leading zeros so two spellings cannot name one module.
_PREFIX, _SUFFIX = "base_model.model.", ".lora_A.weight"
_MAX_LAYER_DIGITS = 6


def _name_patterns(module_paths: Mapping[str, str]) -> list[tuple[re.Pattern, str]]:
    """Per module, the PEFT tensor-name pattern of its path template ("...layers.{layer}.mixer.q_proj")."""
    out = []
    for module, template in module_paths.items():
        head, tail = template.split("{layer}")
        out.append((re.compile(rf"{re.escape(_PREFIX)}({re.escape(head)}(0|[1-9][0-9]{{0,{_MAX_LAYER_DIGITS - 1}}})"
                               rf"{re.escape(tail)})\.lora_([AB])\.weight"), module))
    return out


def _longest_name(module_paths: Mapping[str, str]) -> int:
    """The most characters a tensor name ``_name_patterns`` accepts can have."""
    return max(len(_PREFIX) + len(t.replace("{layer}", "9" * _MAX_LAYER_DIGITS)) + len(_SUFFIX)
               for t in module_paths.values())


def _parse_name(patterns, name: str):
    """(module path, layer, module, "A"/"B") of a PEFT LoRA tensor name, or None."""
    for pattern, module in patterns:
        m = pattern.fullmatch(name)
        if m:
            return m.group(1), int(m.group(2)), module, m.group(3)
    return None


def read_peft_adapter(path, targets: Iterable[LoraTarget], rank: int, num_layers: int,
                      module_paths: Mapping[str, str] | None = None) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """Read and validate a PEFT LoRA directory against an artifact's LoRA targets.

    Returns ``{(layer, module): (A, B)}`` for each target the adapter touches, with A float32
    ``[in, rank]`` and B float32 ``[rank, out]``, C-contiguous and owned by the caller: ``x @ A @ B``
    is PEFT's ``scaling * lora_B(lora_A(x))``, B carrying the scaling (lora_alpha / r, or
    lora_alpha / sqrt(r) with use_rslora; rank_pattern / alpha_pattern per module), and an adapter
    rank r < ``rank`` fills A's first r columns and B's first r rows, the rest zero. Targets missing
    from the result are not touched by the adapter (their update is zero).

    ``num_layers`` is the model's decoder layer count, to tell an adapter for a bigger model from
    one for a target the artifact was not exported with. Order of checks: the directory, the
    config, then every tensor's name and shape from the safetensors header (itself bounded by the
    targets' count before it is read), then the data (float, finite). Every file is opened
    without blocking and must be a regular file; the weights file is opened once and read through
    that handle. Any problem raises one ``GraphkilnError`` line. Pickled weights are never opened.
    ``module_paths``: each module's path in the base model with ``{layer}`` for the layer number
    (default: Llama's, ``LLAMA_MODULE_PATHS``).
    """
    path = adapter_directory(path)
    targets = list(targets)
    by_key = {t.key: t for t in targets}
    scaling = read_config(path, rank)
    if not file_exists(path, WEIGHTS):
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt"))
        if pickles:
            raise refuse(path, f"the weights are stored as a pickle ({show(pickles[0])}), which graphkiln never "
                               f"loads (it can run code); convert them to {WEIGHTS} (load with PEFT, "
                               f"save_pretrained(..., safe_serialization=True)) on a machine you trust")
        raise refuse(path, f"no {WEIGHTS}; pass the directory PEFT's save_pretrained wrote")
    paths = dict(module_paths or LLAMA_MODULE_PATHS)
    with open_file(path, WEIGHTS) as weights:
        # bounded by what an adapter for this model can hold (every projection of every layer), not
        # only the exported targets: an adapter for a target the artifact lacks gets its own message
        index = safetensors_index(path, weights, 2 * len(paths) * num_layers, _longest_name(paths))
        if not index:
            raise refuse(path, f"{WEIGHTS} holds no tensors; pass a trained LoRA adapter")
        plan = _plan(path, index, targets, by_key, scaling, rank, num_layers, paths)
        out: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
        for key, a_name, b_name, r, scale in plan:
            a, b = read_tensor(path, weights, index[a_name]), read_tensor(path, weights, index[b_name])
            out[key] = _padded(path, by_key[key], rank, r, scale, (a_name, a), (b_name, b))
    return out


def _plan(path: Path, index, targets, by_key, scaling, rank: int, num_layers: int, paths) -> list:
    """(key, A name, B name, r, scale) per adapted target: every name and shape checked against the
    artifact from the header alone, before any data is read."""
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    found_paths: dict[tuple[int, str], str] = {}
    patterns = _name_patterns(paths)
    for name in sorted(index):
        parsed = _parse_name(patterns, name)
        if parsed is None:
            example = next(iter(paths.values())).replace("{layer}", "<i>")
            raise refuse(path, f"unknown tensor {show(name)} (one of {len(index)}); graphkiln applies only LoRA pairs "
                               f"'base_model.model.<projection path>.lora_A/B.weight' of this model's "
                               f"{', '.join(paths)} (e.g. {example}): the adapter is for another architecture or "
                               f"carries extra weights")
        module_path, layer, module, which = parsed
        if layer >= num_layers:
            raise refuse(path, f"tensor {show(name)} is for layer {layer}, but the model has {num_layers} layer(s): "
                               f"the adapter was trained for a different base model")
        if (layer, module) not in by_key:
            exported = sorted({t.module for t in targets if t.layer == layer}, key=MODULES.index)
            wanted = lora_targets_flag({t.module for t in targets} | {module})
            raise refuse(path, f"the adapter changes layer {layer} {module}, but the artifact has no LoRA inputs for "
                               f"it (exported LoRA targets{'' if exported else ' on other layers'}: "
                               f"{', '.join(exported) if exported else module_list(targets)}); re-export with "
                               f"--lora-targets {wanted}")
        pairs.setdefault((layer, module), {})[which] = name
        found_paths[(layer, module)] = module_path

    plan = []
    for key, pair in pairs.items():
        target, module_path = by_key[key], found_paths[key]
        for which in "AB":
            if which not in pair:
                present = pair["B" if which == "A" else "A"]
                raise refuse(path, f"tensor {show(present)} has no lora_{which} partner; the adapter file is "
                                   f"incomplete: re-save it")
        r = scaling.rank_of(module_path)
        if r > rank:
            raise refuse(path, f"adapter rank {r} (for {module_path}) is above the artifact's LoRA rank {rank}; "
                               f"re-export with --lora-rank {r} (or more)")
        for name, want in ((pair["A"], (r, target.in_features)), (pair["B"], (target.out_features, r))):
            if index[name].shape != want:
                raise refuse(path, f"tensor {show(name)} has shape {index[name].shape}, but layer {key[0]} {key[1]} "
                                   f"needs {want} (rank {r} from the config, {target.in_features} -> "
                                   f"{target.out_features} from the model): the adapter is for a different base "
                                   f"model or its config does not match its tensors")
        plan.append((key, pair["A"], pair["B"], r, scaling.scale_of(module_path)))
    return plan


def _padded(path: Path, target: LoraTarget, rank: int, r: int, scale: float, a_named, b_named):
    """(A [in, rank], B [rank, out]) float32 from PEFT's A [r, in] and B [out, r]: B scaled, the
    columns/rows past r zero; non-finite values refused."""
    (a_name, a), (b_name, b) = a_named, b_named
    for name, tensor in ((a_name, a), (b_name, b)):
        if not np.isfinite(tensor).all():
            raise refuse(path, f"tensor {show(name)} holds NaN or infinite values; the adapter is broken: retrain or "
                               f"re-save it")
    a_out = np.zeros((target.in_features, rank), np.float32)
    b_out = np.zeros((rank, target.out_features), np.float32)
    a_out[:, :r] = a.T
    # the scale is applied in float64 and rounded once: PEFT multiplies float32 by a Python float
    with np.errstate(over="ignore"):  # overflow is refused just below
        b_out[:r, :] = (b.T.astype(np.float64) * scale).astype(np.float32)
    if not np.isfinite(b_out).all():
        raise refuse(path, f"tensor {show(b_name)} overflows float32 once scaled by {scale:g}; fix the adapter's "
                           f"lora_alpha or weights")
    return a_out, b_out
