"""LoRA adapters at run time: read PEFT adapter directories and keep them in fixed slots.

An artifact exported with ``--lora-rank R --max-loras N`` takes, per targeted projection of each
layer, an A stack ``[N+1, in, R]`` and a B stack ``[N+1, R, out]`` as graph inputs, plus
``lora_rows`` / ``lora_slots`` naming the rows that use an adapter and their slots: such a row's
projection is ``base(x) + (x @ A[slot]) @ B[slot]``. Slot 0 is all zeros ("no adapter"); slots 1..N hold
loaded adapters. B is pre-scaled (lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA) and an
adapter of rank r < R fills the first r columns of A / rows of B, the rest zero, so padding adds
exactly nothing.

Two jobs, kept apart:

* ``read_peft_adapter``: a PEFT LoRA directory (``adapter_config.json`` +
  ``adapter_model.safetensors``) is untrusted input. It is validated completely and turned into
  per-target (A, B) float32 pairs before anything is written anywhere; any problem is one
  ``GraphkilnError`` line naming the cause and the fix. Pickled adapters are never opened.
  The safetensors file is read with json + numpy (its format is an 8-byte header length, a JSON
  header, then raw little-endian bytes) rather than ``safetensors.numpy``: numpy has no bfloat16,
  which is how many adapters are stored, and the runtime keeps to numpy + onnxruntime.
* ``AdapterPool``: owns the stacks the engine binds as graph inputs, the slot table (which
  adapter is in which slot, how many running requests use it, when it was last used) and LRU
  replacement.

Torch-free by design (``graphkiln.runtime`` must run with numpy + onnxruntime only).
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np

from graphkiln.errors import GraphkilnError

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Where each projection lives inside a decoder layer, as PEFT names it for a Llama-style
# ``*ForCausalLM`` (checked against peft's own output in tests/test_lora_adapters.py); other
# families' artifacts record their own paths (``manifest.LoraSpec.module_paths``).
_CONTAINER = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
LLAMA_MODULE_PATHS = {m: f"model.layers.{{layer}}.{c}.{m}" for m, c in _CONTAINER.items()}


def _name_patterns(module_paths: Mapping[str, str]) -> list[tuple[re.Pattern, str]]:
    """Per module, the PEFT tensor-name pattern of its path template ("...layers.{layer}.mixer.q_proj")."""
    out = []
    for module, template in module_paths.items():
        head, tail = template.split("{layer}")
        out.append((re.compile(rf"base_model\.model\.({re.escape(head)}(0|[1-9][0-9]{{0,5}}){re.escape(tail)})"
                               rf"\.lora_([AB])\.weight"), module))
    return out


def _parse_name(patterns, name: str):
    """(module path, layer, module, "A"/"B") of a PEFT LoRA tensor name, or None."""
    for pattern, module in patterns:
        m = pattern.fullmatch(name)
        if m:
            return m.group(1), int(m.group(2)), module, m.group(3)
    return None

# PEFT saves the default adapter's weights as
#   base_model.model.<module path in the base model>.lora_A.weight   [r, in]
#   base_model.model.<module path in the base model>.lora_B.weight   [out, r]
# with the module path "model.layers.<i>.<self_attn|mlp>.<proj>" for a *ForCausalLM. The layer
# number is matched without leading zeros so two spellings cannot name one module.

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

_MAX_CONFIG_BYTES = 1 << 20
_MAX_HEADER_BYTES = 100 << 20
_FLOAT_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}  # BF16: widened by hand


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


def _show(text, limit: int = 80) -> str:
    """An untrusted string quoted for a one-line message: control characters escaped, length capped."""
    text = str(text)
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _one_line(message: str) -> str:
    # last line of defence for the CLI's one-line contract: paths and names come from the user
    return message.replace("\r", "\\r").replace("\n", "\\n")


def _refuse(path: Path, problem: str) -> GraphkilnError:
    return GraphkilnError(_one_line(f"LoRA adapter {path}: {problem}"))


def _module_list(targets: Iterable[LoraTarget]) -> str:
    present = {t.module for t in targets}
    return ", ".join(m for m in MODULES if m in present) or "none"


def _lora_targets_flag(modules: Iterable[str]) -> str:
    return ",".join(m.removesuffix("_proj") for m in MODULES if m in set(modules))


# ---------------------------------------------------------------------------------------------
# adapter_config.json


@dataclass(frozen=True)
class _Scaling:
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


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_SIMPLE_PATTERN_KEY = re.compile(r"\^?[A-Za-z0-9_.]+\$?")


def _patterns(path: Path, config: dict, field: str, valid, what: str) -> tuple:
    patterns = config.get(field) or {}
    if not isinstance(patterns, dict):
        raise _refuse(path, f"adapter_config.json {field} is {type(patterns).__name__}, not an object of "
                            f"module path -> {what}; fix or remove it")
    for key, value in patterns.items():
        if not _SIMPLE_PATTERN_KEY.fullmatch(key):
            raise _refuse(path, f"adapter_config.json {field} key {_show(key)} is a regular expression graphkiln "
                                f"does not evaluate; spell it as a plain module path such as "
                                f"'model.layers.3.self_attn.q_proj' or 'q_proj' (one key per module)")
        if not valid(value):
            raise _refuse(path, f"adapter_config.json {field}[{_show(key)}] is {_show(value)}, not a {what}; "
                                f"fix the adapter's config")
    return tuple(patterns.items())


def _read_config(path: Path, rank: int) -> _Scaling:
    """Validate adapter_config.json: a plain LoRA graphkiln can apply exactly, rank <= the artifact's."""
    cfg_path = path / "adapter_config.json"
    try:
        with open(cfg_path, "rb") as f:
            raw = f.read(_MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise _refuse(path, "no adapter_config.json; pass a PEFT LoRA adapter directory (the one "
                            "save_pretrained wrote)") from None
    except OSError as exc:
        raise _refuse(path, f"cannot read adapter_config.json ({exc.strerror or exc}); check the file and its "
                            f"permissions") from None
    if len(raw) > _MAX_CONFIG_BYTES:
        raise _refuse(path, f"adapter_config.json is over {_MAX_CONFIG_BYTES >> 20} MiB, not a PEFT config; "
                            f"pass the adapter directory save_pretrained wrote")
    try:
        config = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _refuse(path, f"adapter_config.json is not valid JSON ({_one_line(str(exc))}); re-save the "
                            f"adapter with PEFT's save_pretrained") from None
    if not isinstance(config, dict):
        raise _refuse(path, f"adapter_config.json holds a JSON {type(config).__name__}, not an object; re-save "
                            f"the adapter with PEFT's save_pretrained")

    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise _refuse(path, f"peft_type is {_show(peft_type)}; graphkiln applies only LoRA adapters "
                            f"(peft_type 'LORA'): merge this adapter into the model and export that instead")
    if config.get("bias", "none") != "none":
        raise _refuse(path, f"bias is {_show(config.get('bias'))}: the adapter trained the base model's biases, "
                            f"which graphkiln cannot swap per request; retrain with bias='none' or merge the "
                            f"adapter and export the merged model")
    for option, reason in _REFUSED_OPTIONS.items():
        if config.get(option) not in (None, False, [], {}, ""):
            raise _refuse(path, f"{option} is set: the adapter {reason}, which graphkiln cannot apply as a "
                                f"plain LoRA; merge the adapter into the model and export that instead")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise _refuse(path, f"init_lora_weights is {_show(init)}, which rewrites the base weights: the adapter "
                            f"is relative to a residual model, not the exported one; convert it with PEFT's "
                            f"save_pretrained(..., path_initial_model_for_weight_conversion=...) first")
    for option, value in config.items():
        if option not in _IGNORED_OPTIONS and option not in _REFUSED_OPTIONS and value not in (None, False, [], {}, ""):
            raise _refuse(path, f"adapter_config.json sets {_show(option)} = {_show(value, 40)}, a PEFT option "
                                f"graphkiln does not know how to apply; save the adapter without it (plain LoRA)")

    r, alpha, rslora = config.get("r"), config.get("lora_alpha"), config.get("use_rslora", False)
    if not _positive_int(r):
        raise _refuse(path, f"r is {_show(r)}, not a positive integer; fix the adapter's config")
    if not _finite_number(alpha):
        raise _refuse(path, f"lora_alpha is {_show(alpha)}, not a finite number; fix the adapter's config")
    if not isinstance(rslora, bool):
        raise _refuse(path, f"use_rslora is {_show(rslora)}, not true/false; fix the adapter's config")
    rank_pattern = _patterns(path, config, "rank_pattern", _positive_int, "positive integer rank")
    alpha_pattern = _patterns(path, config, "alpha_pattern", _finite_number, "finite number")
    # Refused here, before any tensor is read, with the flag that fixes it. (A pattern entry that
    # matches no module is still counted: PEFT's own max rank counts it too.)
    biggest = max([r, *(v for _, v in rank_pattern)])
    if biggest > rank:
        raise _refuse(path, f"adapter rank {biggest} is above the artifact's LoRA rank {rank}; re-export "
                            f"with --lora-rank {biggest} (or more)")
    return _Scaling(r, float(alpha), rslora, rank_pattern, alpha_pattern)


# ---------------------------------------------------------------------------------------------
# adapter_model.safetensors


@dataclass(frozen=True)
class _Stored:
    """One tensor's safetensors header entry, validated: a float dtype, data inside the file."""

    dtype: str
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


def _safetensors_index(path: Path, file: Path) -> dict[str, _Stored]:
    """The tensors a safetensors file declares, from its header only (no tensor data read).

    Everything the header says is checked against the file: it is untrusted, and the names and
    shapes are validated before any data is read, so a huge or hostile file costs nothing."""
    try:
        with open(file, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            head = f.read(8)
            if len(head) < 8:
                raise _refuse(path, "adapter_model.safetensors is truncated (no header); re-save the adapter")
            n = int.from_bytes(head, "little")
            if n > min(_MAX_HEADER_BYTES, size - 8):
                raise _refuse(path, f"adapter_model.safetensors declares a {n}-byte header in a {size}-byte file; "
                                    f"the file is truncated or not safetensors: re-save the adapter")
            raw = f.read(n)
    except OSError as exc:
        raise _refuse(path, f"cannot read adapter_model.safetensors ({exc.strerror or exc}); check the file "
                            f"and its permissions") from None

    def no_duplicates(pairs):  # json keeps the last of two equal keys silently; two tensors of one name is corrupt
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate key " + _show(next(k for k in keys if keys.count(k) > 1)))
        return dict(pairs)

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _refuse(path, f"adapter_model.safetensors has a corrupt header ({_one_line(str(exc))}); "
                            f"re-save the adapter") from None
    if not isinstance(header, dict):
        raise _refuse(path, "adapter_model.safetensors has a corrupt header (not an object); re-save the adapter")
    base = 8 + n
    index = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shown = _show(name)
        if not (isinstance(entry, dict) and isinstance(entry.get("shape"), list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry["shape"])
                and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in entry["data_offsets"])
                and isinstance(entry.get("dtype"), str)):
            raise _refuse(path, f"adapter_model.safetensors has a corrupt header entry for {shown}; re-save the "
                                f"adapter")
        dtype = entry["dtype"]
        if dtype not in _FLOAT_DTYPES:
            raise _refuse(path, f"tensor {shown} is {_show(dtype, 12)}, not a float tensor; LoRA weights are "
                                f"float32/float16/bfloat16: re-save the adapter")
        shape = tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        nbytes = math.prod(shape) * np.dtype(_FLOAT_DTYPES[dtype]).itemsize
        if not 0 <= begin <= end <= size - base or end - begin != nbytes:
            raise _refuse(path, f"tensor {shown} has data offsets {_show([begin, end])} that do not fit its shape "
                                f"{shape} or the file; the file is corrupt or truncated: re-save the adapter")
        index[name] = _Stored(dtype, shape, base + begin, end - begin)
    return index


def _read_tensor(path: Path, file: Path, stored: _Stored) -> np.ndarray:
    """One indexed tensor's data as float32 (bfloat16 widened exactly)."""
    try:
        with open(file, "rb") as f:
            f.seek(stored.offset)
            blob = f.read(stored.nbytes)
    except OSError as exc:
        raise _refuse(path, f"cannot read adapter_model.safetensors ({exc.strerror or exc}); check the file "
                            f"and its permissions") from None
    if len(blob) != stored.nbytes:  # the file shrank since it was indexed
        raise _refuse(path, "adapter_model.safetensors is truncated; re-save the adapter")
    data = np.frombuffer(blob, dtype=_FLOAT_DTYPES[stored.dtype])
    if stored.dtype == "BF16":  # bfloat16 is the top half of a float32
        data = (data.astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32).reshape(stored.shape)


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
    one for a target the artifact was not exported with. Order of checks: the config, then every
    tensor's name and shape from the safetensors header, then the data (float, finite). Any problem
    raises one ``GraphkilnError`` line. Pickled weights are never opened. ``module_paths``: each
    module's path in the base model with ``{layer}`` for the layer number (default: Llama's,
    ``LLAMA_MODULE_PATHS``).
    """
    path = Path(path)
    targets = list(targets)
    by_key = {t.key: t for t in targets}
    if not path.is_dir():
        raise _refuse(path, "not a directory; pass a PEFT LoRA adapter directory (adapter_config.json + "
                            "adapter_model.safetensors)")
    scaling = _read_config(path, rank)
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt"))
        if pickles:
            raise _refuse(path, f"the weights are stored as a pickle ({_show(pickles[0])}), which graphkiln never "
                                f"loads (it can run code); convert them to adapter_model.safetensors (load with "
                                f"PEFT, save_pretrained(..., safe_serialization=True)) on a machine you trust")
        raise _refuse(path, "no adapter_model.safetensors; pass the directory PEFT's save_pretrained wrote")
    index = _safetensors_index(path, weights)
    if not index:
        raise _refuse(path, "adapter_model.safetensors holds no tensors; pass a trained LoRA adapter")

    pairs: dict[tuple[int, str], dict[str, str]] = {}
    paths = dict(module_paths or LLAMA_MODULE_PATHS)
    found_paths: dict[tuple[int, str], str] = {}
    patterns = _name_patterns(paths)
    for name in sorted(index):
        parsed = _parse_name(patterns, name)
        if parsed is None:
            example = next(iter(paths.values())).replace("{layer}", "<i>")
            raise _refuse(path, f"unknown tensor {_show(name)} (one of {len(index)}); graphkiln applies only LoRA "
                                f"pairs 'base_model.model.<projection path>.lora_A/B.weight' of this model's "
                                f"{', '.join(paths)} (e.g. {example}): the adapter is for another architecture or "
                                f"carries extra weights")
        module_path, layer, module, which = parsed
        if layer >= num_layers:
            raise _refuse(path, f"tensor {_show(name)} is for layer {layer}, but the model has {num_layers} "
                                f"layer(s): the adapter was trained for a different base model")
        if (layer, module) not in by_key:
            exported = sorted({t.module for t in targets if t.layer == layer}, key=MODULES.index)
            wanted = _lora_targets_flag({t.module for t in targets} | {module})
            raise _refuse(path, f"the adapter changes layer {layer} {module}, but the artifact has no LoRA inputs "
                                f"for it (exported LoRA targets{'' if exported else ' on other layers'}: "
                                f"{', '.join(exported) if exported else _module_list(targets)}); re-export with "
                                f"--lora-targets {wanted}")
        pairs.setdefault((layer, module), {})[which] = name
        found_paths[(layer, module)] = module_path

    plan = []  # (key, A name, B name, r, scale): everything checked before any data is read
    for key, pair in pairs.items():
        target, module_path = by_key[key], found_paths[key]
        for which in "AB":
            if which not in pair:
                present = pair["B" if which == "A" else "A"]
                raise _refuse(path, f"tensor {_show(present)} has no lora_{which} partner; the adapter file is "
                                    f"incomplete: re-save it")
        r = scaling.rank_of(module_path)
        if r > rank:
            raise _refuse(path, f"adapter rank {r} (for {module_path}) is above the artifact's LoRA rank {rank}; "
                                f"re-export with --lora-rank {r} (or more)")
        for name, want in ((pair["A"], (r, target.in_features)), (pair["B"], (target.out_features, r))):
            if index[name].shape != want:
                raise _refuse(path, f"tensor {_show(name)} has shape {index[name].shape}, but layer {key[0]} "
                                    f"{key[1]} needs {want} (rank {r} from the config, {target.in_features} -> "
                                    f"{target.out_features} from the model): the adapter is for a different base "
                                    f"model or its config does not match its tensors")
        plan.append((key, pair["A"], pair["B"], r, scaling.scale_of(module_path)))

    out: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    for key, a_name, b_name, r, scale in plan:
        a, b = _read_tensor(path, weights, index[a_name]), _read_tensor(path, weights, index[b_name])
        for name, tensor in ((a_name, a), (b_name, b)):
            if not np.isfinite(tensor).all():
                raise _refuse(path, f"tensor {_show(name)} holds NaN or infinite values; the adapter is broken: "
                                    f"retrain or re-save it")
        target = by_key[key]
        a_out = np.zeros((target.in_features, rank), np.float32)
        b_out = np.zeros((rank, target.out_features), np.float32)
        a_out[:, :r] = a.T
        # the scale is applied in float64 and rounded once: PEFT multiplies float32 by a Python float
        with np.errstate(over="ignore"):  # overflow is refused just below
            b_out[:r, :] = (b.T.astype(np.float64) * scale).astype(np.float32)
        if not np.isfinite(b_out).all():
            raise _refuse(path, f"tensor {_show(b_name)} overflows float32 once scaled by {scale:g}; fix the "
                                f"adapter's lora_alpha or weights")
        out[key] = (a_out, b_out)
    return out


# ---------------------------------------------------------------------------------------------
# slots


def _content_digest(adapter: dict) -> bytes:
    import hashlib

    h = hashlib.blake2b(b"graphkiln-lora/", digest_size=16)
    for key in sorted(adapter):
        a, b = adapter[key]
        h.update(f"{key[0]}.{key[1]}:{a.dtype.str}{a.shape}{b.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
        h.update(np.ascontiguousarray(b).tobytes())
    return h.digest()


@dataclass
class _Slot:
    name: str | None = None  # the adapter held (routable by name unless busy); None: free
    busy: bool = False  # rows being written by load/unload outside the lock: neither free nor routable
    refs: int = 0  # running requests that route rows to this slot
    last_used: int = 0  # LRU clock value of the latest load/acquire/release
    digest: bytes = b""  # the held adapter's content hash (``AdapterPool.digest``)


class AdapterPool:
    """LoRA adapters in a fixed number of slots, as the stacks an adapter-capable artifact takes.

    Ownership: the pool allocates, per target, ``A [max_loras + 1, in, rank]`` and
    ``B [max_loras + 1, rank, out]`` once, C-contiguous in ``dtype``, and owns them for its whole
    life. They are never reallocated or replaced (``arrays`` hands out the same objects forever), so
    the engine binds them to the graph inputs once or every step at no cost; it must not write them.
    Only the pool writes, and only rows of a slot that no request can route to at that moment (a
    slot being loaded or unloaded), so a step running concurrently reads consistent rows for every
    slot its ``lora_slots`` name. Slot 0 is zeros forever ("no adapter").

    Slot life: ``load`` claims a free slot, or evicts the least recently used adapter that no
    request holds, writes the adapter into it (every target: untouched ones zeroed) and then makes
    it routable by name. ``acquire(name)`` returns the slot for a request's rows and counts the
    request; ``release(slot)`` uncounts it, and must come only after the last step reading that slot
    has finished. A slot with requests counted is never evicted or unloaded. ``unload`` zeroes the
    slot and frees it. ``version`` increases each time any slot's contents change (for a device copy
    of the stacks to know when to refresh).

    Thread-safe: one lock guards the slot table; reading and validating an adapter and writing its
    slot happen outside the lock, so loads never stall acquire/release of running requests.
    """

    def __init__(self, targets: Iterable[LoraTarget], rank: int, max_loras: int, dtype="float32",
                 num_layers: int | None = None, module_paths: Mapping[str, str] | None = None):
        self.targets = tuple(targets)
        if not self.targets:
            raise ValueError("AdapterPool needs at least one LoraTarget")
        if len({t.key for t in self.targets}) != len(self.targets):
            raise ValueError("AdapterPool targets repeat a (layer, module)")
        if not _positive_int(rank) or not _positive_int(max_loras):
            raise ValueError(f"AdapterPool rank and max_loras must be positive ints, not {rank!r}, {max_loras!r}")
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float16):
            raise ValueError(f"AdapterPool dtype must be float32 or float16, not {dtype!r}")
        self.rank, self.max_loras = rank, max_loras
        self.module_paths = dict(module_paths) if module_paths else None  # read_peft_adapter's
        self.num_layers = num_layers if num_layers is not None else 1 + max(t.layer for t in self.targets)
        self._arrays = {t.key: (np.zeros((max_loras + 1, t.in_features, rank), self.dtype),
                                np.zeros((max_loras + 1, rank, t.out_features), self.dtype)) for t in self.targets}
        self.arrays: Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray]] = MappingProxyType(self._arrays)
        self._slots = [_Slot() for _ in range(max_loras + 1)]  # [0] unused: slot 0 is never assigned
        self._lock = threading.Lock()
        self._clock = 0
        self.version = 0
        self._listeners: list = []  # called with a slot index once its rows are written (add_listener)

    # -- queries ------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """The loaded adapters' names, in slot order."""
        with self._lock:
            return [s.name for s in self._slots[1:] if s.name is not None and not s.busy]

    def __contains__(self, name) -> bool:
        with self._lock:
            return self._slot_of(name) is not None

    def slot_of(self, name: str) -> int | None:
        with self._lock:
            return self._slot_of(name)

    def _slot_of(self, name) -> int | None:
        # a busy slot's name is only reserved: not routable until its rows are written
        for i, s in enumerate(self._slots):
            if i and not s.busy and s.name is not None and s.name == name:
                return i
        return None

    def _refuse_taken(self, name: str) -> None:
        """Lock held: a name already loaded, or reserved by a load in progress, is refused."""
        if any(s.name == name for s in self._slots[1:]):
            raise GraphkilnError(_one_line(f"a LoRA adapter named {_show(name)} is already loaded (or being "
                                           f"loaded); unload it first or choose another name"))

    def _loaded(self) -> str:
        return ", ".join(_show(s.name) for s in self._slots[1:] if s.name is not None and not s.busy) or "none"

    def _tick(self, slot: _Slot) -> None:
        self._clock += 1
        slot.last_used = self._clock

    # -- loading ------------------------------------------------------------------------------

    def load(self, name: str, path) -> int:
        """Read, validate and load the PEFT adapter at ``path`` under ``name``; returns its slot.

        The adapter is read and checked completely before any slot is claimed, so a refused adapter
        changes nothing. Then a free slot is claimed, or the least recently used adapter no request
        holds is evicted; if every slot holds an adapter in use, ``GraphkilnError``. The name is
        reserved while the slot's rows are written and becomes acquirable only once they are all
        written. A write that fails (MemoryError, interrupt) frees the slot again: a free slot's rows
        may be stale, which is harmless because no row routes to a free slot.
        """
        if not isinstance(name, str) or not name or not name.isprintable() or len(name) > 256:
            raise GraphkilnError(_one_line(f"LoRA adapter name {_show(name)} is not a usable name; use 1-256 "
                                           f"printable characters"))
        with self._lock:
            self._refuse_taken(name)
        adapter = read_peft_adapter(path, self.targets, self.rank, self.num_layers, self.module_paths)
        if self.dtype != np.float32:
            with np.errstate(over="ignore"):  # overflow is checked (and refused) just below
                adapter = {k: (a.astype(self.dtype), b.astype(self.dtype)) for k, (a, b) in adapter.items()}
            if not all(np.isfinite(a).all() and np.isfinite(b).all() for a, b in adapter.values()):
                raise _refuse(Path(path), f"values overflow the artifact's {self.dtype.name} adapter inputs; "
                                          f"use a float32 artifact or an adapter with smaller weights")

        digest = _content_digest(adapter)
        with self._lock:
            self._refuse_taken(name)
            index = self._claim()
            slot = self._slots[index]
            slot.busy, slot.name = True, name  # reserves the name; not routable until written
        try:
            self._write(index, adapter)
        except BaseException:
            with self._lock:
                slot.busy, slot.name = False, None
            raise
        with self._lock:
            slot.busy = False
            slot.digest = digest
            self._tick(slot)
            self.version += 1
        return index

    def _claim(self) -> int:
        """A free slot, else the LRU slot holding an adapter no request uses (evicted). Lock held."""
        for i, s in enumerate(self._slots):
            if i and s.name is None and not s.busy:
                return i
        idle = [(s.last_used, i) for i, s in enumerate(self._slots) if i and not s.busy and s.refs == 0]
        if not idle:
            raise GraphkilnError(_one_line(f"all {self.max_loras} LoRA slots hold adapters in use by running "
                                           f"requests ({self._loaded()}); retry when one finishes, or export "
                                           f"with a larger --max-loras"))
        _, index = min(idle)
        self._slots[index].name = None  # evicted: no longer routable by name from here on
        return index

    def add_listener(self, written) -> None:
        """Call ``written(slot)`` each time a slot's rows have been written (load, unload), before the
        slot becomes routable: a runner that keeps its own copies of the stacks (a Ray stage actor)
        copies the slot's rows there. An exception from it fails the load like a failed write."""
        self._listeners.append(written)

    def _write(self, index: int, adapter) -> None:
        # In place, this slot's rows only: other slots' rows are being read by running steps.
        for key, (a_stack, b_stack) in self._arrays.items():
            if key in adapter:
                a_stack[index], b_stack[index] = adapter[key]
            else:
                a_stack[index], b_stack[index] = 0, 0
        for written in self._listeners:
            written(index)

    # -- unloading ----------------------------------------------------------------------------

    def unload(self, name: str) -> None:
        """Remove adapter ``name`` and zero its slot; refused while running requests hold it."""
        with self._lock:
            index = self._slot_of(name)
            if index is None:
                raise GraphkilnError(_one_line(f"no LoRA adapter named {_show(name)} is loaded (loaded: "
                                               f"{self._loaded()})"))
            slot = self._slots[index]
            if slot.refs:
                raise GraphkilnError(_one_line(f"LoRA adapter {_show(name)} is in use by {slot.refs} running "
                                               f"request(s); unload it after they finish"))
            slot.name, slot.busy = None, True
        try:
            self._write(index, {})
        finally:
            with self._lock:
                slot.busy = False
                self.version += 1

    # -- requests -----------------------------------------------------------------------------

    def acquire(self, name: str | None) -> int:
        """The slot for a request using adapter ``name`` (None: the base model, slot 0, uncounted).

        Counts the request against the slot, so it is neither evicted nor unloaded until the matching
        ``release``, and marks the adapter as recently used."""
        if name is None:
            return 0
        with self._lock:
            index = self._slot_of(name)
            if index is None:
                raise GraphkilnError(_one_line(f"no LoRA adapter named {_show(name)} is loaded (loaded: "
                                               f"{self._loaded()}); load it first"))
            slot = self._slots[index]
            slot.refs += 1
            self._tick(slot)
            return index

    def release(self, slot: int) -> None:
        """Uncount one request from ``slot`` (0 is a no-op); call after its last step has finished."""
        if slot == 0:
            return
        with self._lock:
            if not (isinstance(slot, int) and 0 < slot <= self.max_loras) or self._slots[slot].refs <= 0:
                raise ValueError(f"release of LoRA slot {slot!r}, which no request holds")  # an engine bug
            self._slots[slot].refs -= 1
            self._tick(self._slots[slot])

    def digest(self, slot: int) -> bytes:
        """A hash of what ``slot`` holds (b"" for slot 0, the base model): equal for the same
        adapter loaded twice, different for different weights under one name (prefix-cache keys)."""
        with self._lock:
            return self._slots[slot].digest if slot else b""

    def refs(self, slot: int) -> int:
        """How many running requests hold ``slot``."""
        with self._lock:
            return self._slots[slot].refs if slot else 0
