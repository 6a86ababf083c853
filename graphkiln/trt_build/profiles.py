"""The two TensorRT optimization profiles of a decoder engine, from ``--max-batch`` and ``--max-seq-len``.

Plain code (no TensorRT), so that what an engine admits is decided and tested on CPU.

Sizes. An engine is built for ``B = max_batch`` live requests of up to ``L = max_seq_len``
tokens each. The runner that serves it owns state pools sized exactly that once, for the
engine's life: KV ``[slots=B, kv_heads, L, head_dim]`` per attention layer, conv
``[slots=B, channels, width]`` per conv layer (``graphkiln.runtime.backends.state``'s layouts), at fixed
device addresses (CUDA-graph replay needs them fixed). It binds, for a step over the ``n``
live slots ``0..n-1`` (``1 <= n <= B``):

  input_ids, position_ids  [n, seq]            seq = prompt length (prefill) or 1 (decode)
  logits_index             [n, 1]               the last real token of each row
  seq_lens, slot_idx       [n]
  past_key/past_value.i    [n, kv_heads, L, d]  the pool's first n slots (a contiguous prefix),
                                                also bound as present_key/present_value.i
  conv_state.i             [B, channels, w]     the whole pool, read and written at slot_idx

(a vision-language decoder also takes ``vision_rows`` image rows: 0..B*L in prefill, none in
decode), so the symbolic dimensions range as ``batch`` 1..B, ``seq`` 1..L (prefill) or 1
(decode), ``n_logits`` 1, while ``cache_len`` is L and ``slots`` is B in both profiles: the pools never
change size, so those are not ranges at all. Profile 0 is "prefill", 1 is "decode" (one
engine, two profiles, one execution context: TensorRT Edge-LLM's layout; the decode
profile is the one CUDA graphs are captured on). Opt shapes are where TensorRT times its
tactics: prefill at ``[B, L/2]`` (Edge-LLM's ``[B, maxInputLen/2]``), decode at ``[B, 1]``.

``n_logits`` is 1 in both profiles: generation needs the last token's logits only (what
TensorRT-LLM does unless ``gather_context_logits`` is asked for, and Edge-LLM's
``last_token_ids``); admitting every position would make TensorRT plan ``B x L x vocab``
logits (gigabytes for a real vocabulary). ``Engine.prompt_logits`` (logits at every prompt
position) therefore does not fit these profiles; a runner must refuse it or compute it
another way.

Impossible sizes are refused before anything is built: ``L`` above the states'
``max_seq_len`` (rotary tables and the KV layout end there), ``L < 2``, ``B < 1``, and sizes
at which a bound tensor or the residual stream ``[B, L, hidden]`` would hold more than
``2**31 - 1`` elements (TensorRT's tensor volumes and the plugins' int32 scalars: token
counts, positions). Whether the pools fit a given GPU's memory is the runner's check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import EngineSpec, GraphSpec, Manifest, ProfileSpec

INT32_MAX = 2**31 - 1
PREFILL, DECODE = 0, 1  # profile indices in the engine (and in EngineSpec.profiles)
PROFILE_NAMES = ("prefill", "decode")
DEFAULT_MAX_BATCH = 8


@dataclass(frozen=True)
class BuildSizes:
    """What one engine is built for: ``max_batch`` live requests (the pools' slots) of up to
    ``max_seq_len`` tokens (the pools' capacity). Validated by ``build_sizes``."""

    max_batch: int
    max_seq_len: int


def tensorrt_graph(manifest: Manifest) -> GraphSpec:
    """The tensorrt-target decoder graph, the only one TensorRT engines are built from.

    A pipeline-staged artifact is refused: no TensorRT runner chains stages (runtime.backends.stages runs
    them on onnxruntime only), so engines of its stage graphs would be files nothing runs."""
    if manifest.stages:
        raise GraphkilnError(f"artifact is pipeline-staged ({len(manifest.stages)} stage graphs): graphkiln build makes "
                             "TensorRT engines for single-graph artifacts only (no TensorRT runner chains stages yet): "
                             "export it without --stages/--stage-layers to build an engine")
    for g in manifest.graphs:
        if g.name == "decoder" and g.target == "tensorrt":
            return g
    have = ", ".join(f"{g.name} ({g.target})" for g in manifest.graphs)
    raise GraphkilnError(f"artifact has no tensorrt-target decoder graph (it has {have}): re-export with "
                         "--target tensorrt (or onnxruntime,tensorrt)")


def build_sizes(manifest: Manifest, max_batch: int = DEFAULT_MAX_BATCH, max_seq_len: int | None = None) -> BuildSizes:
    """Checked sizes; ``max_seq_len`` defaults to the states' (the shortest, if they differ)."""
    limit = min(s.max_seq_len for s in manifest.states)
    seq = limit if max_seq_len is None else max_seq_len
    if type(max_batch) is not int or max_batch < 1:
        raise GraphkilnError(f"--max-batch {max_batch!r} must be an integer >= 1: give the most requests the engine "
                             "serves at once")
    if type(seq) is not int or seq < 2:
        raise GraphkilnError(f"--max-seq-len {seq!r} must be an integer >= 2 (a prompt token and a generated one)")
    if seq > limit:
        raise GraphkilnError(f"--max-seq-len {seq} is longer than the artifact's {limit} tokens (its rotary tables and "
                             f"state layout end there): pass --max-seq-len {limit} or less, or re-export with a "
                             "larger --max-seq-len")
    return BuildSizes(max_batch, seq)


def dim_ranges(sizes: BuildSizes) -> dict[str, dict[str, tuple[int, int, int]]]:
    """Per profile name, each symbolic dimension's (min, opt, max); see the module docstring."""
    b, n = sizes.max_batch, sizes.max_seq_len
    fixed = {"n_logits": (1, 1, 1), "cache_len": (n, n, n), "slots": (b, b, b)}
    half = max(1, n // 2)
    return {
        # a vision-language decoder's image rows: any number of the step's tokens, none in decode
        "prefill": {"batch": (1, b, b), "seq": (1, half, n), "vision_rows": (0, b * half, b * n), **fixed},
        "decode": {"batch": (1, b, b), "seq": (1, 1, 1), "vision_rows": (0, 0, 0), **fixed},
    }


def make_profiles(manifest: Manifest, graph: GraphSpec, sizes: BuildSizes) -> tuple[ProfileSpec, ProfileSpec]:
    """The (prefill, decode) profiles of ``graph``: min/opt/max of every input with a symbolic
    dimension (static inputs need none). GraphkilnError when a size overflows (``check_volumes``)."""
    ranges = dim_ranges(sizes)
    out = []
    for name in PROFILE_NAMES:
        dims = ranges[name]
        shapes = {}
        for t in graph.inputs:
            if all(isinstance(d, int) for d in t.shape):
                continue
            if any(isinstance(d, str) and d not in dims for d in t.shape):  # the manifest's DIM_NAMES are all here
                raise GraphkilnError(f"graph {graph.file} input {t.name!r} has a dimension this graphkiln build does "
                                     f"not size ({list(t.shape)}): build with the graphkiln that exported it")
            shapes[t.name] = tuple(tuple(d if isinstance(d, int) else dims[d][k] for d in t.shape) for k in range(3))
        out.append(ProfileSpec(name, shapes))
    check_volumes(manifest, graph, sizes)
    return out[0], out[1]


def check_volumes(manifest: Manifest, graph: GraphSpec, sizes: BuildSizes) -> None:
    """Refuse sizes at which a graph input or output at its largest shape, or the residual
    stream ``[B, L, hidden]``, would hold more than ``INT32_MAX`` elements."""
    ranges = dim_ranges(sizes)
    largest = {d: max(r[d][2] for r in ranges.values()) for d in ranges["prefill"]}
    tensors = [(f"{'input' if t in graph.inputs else 'output'} {t.name}", t.shape) for t in graph.inputs + graph.outputs]
    tensors.append(("the hidden states", ("batch", "seq", manifest.model.hidden_size)))
    for what, shape in tensors:
        dims = [d if isinstance(d, int) else largest[d] for d in shape]
        count = math.prod(dims)
        if count > INT32_MAX:
            raise GraphkilnError(
                f"--max-batch {sizes.max_batch} --max-seq-len {sizes.max_seq_len}: {what} would be {dims}, "
                f"{count:,} elements, more than TensorRT tensors and graphkiln's plugins address (2**31 - 1): "
                "lower --max-batch or --max-seq-len")


def state_pool_bytes(manifest: Manifest, sizes: BuildSizes) -> int:
    """Device memory the runner's state pools take at these sizes (KV and conv, every layer)."""
    item = 4 if manifest.states[0].dtype == "float32" else 2
    total = 0
    for s in manifest.states:
        per_layer = 2 * s.num_kv_heads * sizes.max_seq_len * s.head_dim if s.kind == "kv" else s.channels * s.width
        total += per_layer * sizes.max_batch * len(s.layers)
    return total * item


def admits(profile: ProfileSpec, shapes: Mapping[str, Sequence[int]]) -> str | None:
    """None when every input ``profile`` sizes is in ``shapes`` within its [min, max]; else
    what is not (an input the profile does not size is not its business)."""
    for name, (lo, _, hi) in profile.shapes.items():
        shape = shapes.get(name)
        if shape is None:
            return f"input {name!r} is not bound"
        shape = tuple(int(x) for x in shape)
        if len(shape) != len(lo) or any(not a <= x <= b for a, x, b in zip(lo, shape, hi)):
            return f"input {name!r} is {list(shape)}, outside {list(lo)}..{list(hi)}"
    return None


def select_profile(engine: EngineSpec, shapes: Mapping[str, Sequence[int]]) -> int:
    """The profile a step with these input shapes runs on: decode when it admits them (the
    profile CUDA graphs are captured on), else prefill; GraphkilnError naming what is out of
    range for both (a rebuild with larger sizes, or a smaller batch, fixes it)."""
    order = [i for i in (DECODE, PREFILL) if i < len(engine.profiles)]
    why = {}
    for i in order:
        why[i] = admits(engine.profiles[i], shapes)
        if why[i] is None:
            return i
    reasons = "; ".join(f"{engine.profiles[i].name}: {why[i]}" for i in order)
    raise GraphkilnError(f"the {engine.file} engine (batch <= {engine.max_batch}, <= {engine.max_seq_len} tokens) "
                         f"has no profile for this step ({reasons}): rebuild it with 'graphkiln build' and larger "
                         "--max-batch/--max-seq-len, or run fewer or shorter requests")
