"""Human-readable summary of an artifact (``graphkiln inspect``)."""

from __future__ import annotations

from pathlib import Path

from graphkiln.manifest import MANIFEST_NAME, Manifest, artifact_file, state_update


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return ""


def _kv_lines(m: Manifest) -> list[str]:
    """KV bytes per token of one request at 4K and 32K tokens of context as the CPU runtime's pools
    hold them, where sliding-window layers make it differ from full-length rows: their caches are
    window-sized for a graph that addresses them so (``runtime.backends.state``)."""
    import numpy as np

    from graphkiln.runtime.backends.state import StatePool, takes_window_offset

    if not any(s.kind == "kv" and s.sliding_window for s in m.states):
        return []
    itemsize = 2 if m.states[0].dtype in ("float16", "bfloat16") else 4
    targets: dict[str, bool] = {}  # target -> whether its decoder (or a stage of it) addresses windows
    for g in m.graphs:
        if g.name == "decoder" or g.name.startswith("stage"):
            targets[g.target] = targets.get(g.target, False) or takes_window_offset(g)
    out = []
    for target, by_window in targets.items():
        windowed = StatePool(m.states, np.dtype(f"f{itemsize}"), windowed=by_window)
        sizes = ", ".join(f"{_size(round(windowed.kv_bytes_per_token(n)))}/token at {n // 1024}K tokens"
                          for n in (4096, 32768))
        how = "sliding layers window-sized" if windowed.windowed else "full-length rows"
        out.append(f"kv cache     {sizes}: {how} ({target})")
    return out


def describe(root: Path, m: Manifest, digest: str | None = None) -> str:
    """The summary ``inspect`` prints. ``m`` must be validated (``Manifest.read``); the files it
    lists are stat'ed only after each one is checked to resolve inside ``root`` (a symlink out
    of the artifact is a GraphkilnError, raised before anything is printed)."""
    sizes = {f: _stat_size(root, f) for f in m.files}
    lines = [
        f"artifact     {root}  (format v{m.format_version})",
        *([f"digest       {digest}  (sha256 of {MANIFEST_NAME}: pin the artifact with run --expect-digest)"] if digest else []),
        f"model        {m.model.architecture} from {m.model.source}",
        f"             {m.model.num_parameters / 1e6:.1f}M parameters, {m.model.num_layers} layers, "
        f"hidden {m.model.hidden_size}, vocab {m.model.vocab_size}, dtype {m.model.dtype}",
    ]
    if m.model.quant:
        scheme = {True: "symmetric ", False: "asymmetric "}.get(m.model.quant_symmetric, "")
        lines.append(f"quant        {m.model.quant} weight-only (Linear layers, {scheme}blocks of {m.model.quant_block_size}, "
                     f"com.microsoft.MatMulNBits); embeddings and norms {m.model.dtype}")
    for g in m.graphs:
        in_place = [f"{s.kind}{'' if s.sliding_window is None else f' window {s.sliding_window}'}"
                    for s in m.states if state_update(g, s) == "in_place"]
        lines.append(f"graph        {g.name}: {g.file} (opset {g.opset}, target {g.target}"
                     + (f"; writes {', '.join(in_place)} state in place" if in_place else "") + ")")
        # a stage's layers need not start at 0: show its first layer's tensors, count the rest
        layers = sorted({t.layer for t in g.inputs + g.outputs if t.layer is not None})
        first = layers[0] if layers else None
        shown = [t for t in g.inputs if t.layer in (None, first)] + [t for t in g.outputs if t.layer in (None, first)]
        width = max([16] + [len(t.name) for t in shown])
        for t in shown:
            kind = "in " if t in g.inputs else "out"
            lines.append(f"  {kind} {t.name:<{width}} {t.dtype:<9} [{', '.join(map(str, t.shape))}]")
        per_layer = sum(1 for t in g.inputs + g.outputs if t.layer not in (None, first))
        if per_layer:
            lines.append(f"  ... and {per_layer} more per-layer state and LoRA tensors (layers {_ranges(tuple(layers[1:]))})")
    for i, st in enumerate(m.stages):
        lines.append(f"stage        {i}: graph {st.graph}, layers {st.layers[0]}..{st.layers[1] - 1}, "
                     f"{len(st.states)} state pool(s), files {', '.join(st.files)}"
                     + ("; its own copy of the tied head" if st.tied_head else ""))
    if m.lora is not None:
        stacks = sum(t.role == "lora_a" for t in m.graphs[0].inputs) if not m.stages else None
        lines.append(f"lora         adapters of rank <= {m.lora.rank} on {', '.join(m.lora.modules)}, {m.lora.max_loras} "
                     f"slots loaded at once" + (f" ({stacks} projections)" if stacks else "")
                     + "; run --lora DIR, serve --lora NAME=DIR, GenerationConfig(adapter=)")
    if m.vision is not None:
        lines.extend(_vision_lines(m))
    for s in m.states:
        if s.kind == "conv":
            per_slot = s.channels * s.width * len(s.layers) * (2 if s.dtype in ("float16", "bfloat16") else 4)
            lines.append(f"state        conv on layers {_ranges(s.layers)}: {s.channels} channels x {s.width} "
                         f"(kernel - 1) per slot, {s.dtype} ({_size(per_slot)}/request)")
            continue
        window = f", sliding window {s.sliding_window}" if s.sliding_window else ", full attention"
        per_token = 2 * s.num_kv_heads * s.head_dim * len(s.layers) * (2 if s.dtype in ("float16", "bfloat16") else 4)
        lines.append(
            f"state        {s.kind} on layers {_ranges(s.layers)}: {s.num_kv_heads} kv heads x {s.head_dim}, "
            f"max {s.max_seq_len} tokens, {s.dtype}{window} ({_size(per_token)}/token)"
        )
    lines.extend(_kv_lines(m))
    for e in m.engines:
        lines.append(f"engine       {e.graph} ({e.target}): {e.file}, TensorRT {e.tensorrt_version} for {e.gpu_name} "
                     f"(sm {e.compute_capability}), batch <= {e.max_batch}, <= {e.max_seq_len} tokens, profiles "
                     + ", ".join(p.name for p in e.profiles))
    for op in m.custom_ops:
        lines.append(f"custom op    {op.domain}.{op.name} v{op.version} (TensorRT plugin "
                     f"{op.plugin_namespace}::{op.name} v{op.plugin_version}; onnxruntime runs its attached function)")
    g = m.generation
    lines.append(f"generation   eos {list(g.eos_token_ids)}, do_sample {g.do_sample}, temperature {g.temperature}, "
                 f"top_k {g.top_k}, top_p {g.top_p}, max_new_tokens {g.max_new_tokens}")
    lines.append(f"tokenizer    {', '.join(m.tokenizer_files) or 'none (token ids only)'}")
    total = sum(n for n in sizes.values() if n is not None)
    lines.append(f"files        {len(m.files)} files, {_size(total)}, sha256 recorded")
    for f, n in sizes.items():
        lines.append(f"  {f:<28} {'MISSING' if n is None else _size(n)}")
    lines.append("written by   " + ", ".join(f"{k} {v}" for k, v in m.tool_versions.items()))
    return "\n".join(lines)


def _vision_lines(m: Manifest) -> list[str]:
    """The vision spec: image token, placeholder rule, position rule, pixel limit, preprocessing."""
    v, p, r = m.vision, m.vision.preprocessing, m.vision.placeholder
    if r.kind == "patch_grid":
        extra = [f"+{r.num_additional_image_tokens} extra"] if r.num_additional_image_tokens else []
        if r.vision_feature_select_strategy == "default":
            extra.append("-1 first feature dropped")
        rule = f"patch grid of {r.patch_size} px" + (f" ({', '.join(extra)})" if extra else "")
    elif r.kind == "fixed":
        rule = f"fixed {r.tokens_per_image}"
    else:
        rule = f"merged grid (merge size {r.merge_size})"
    per_image = ""
    if p.output_size is not None:
        try:
            per_image = f" = {r.num_tokens(p.output_size)} tokens per {p.output_size[0]}x{p.output_size[1]} image"
        except ValueError:
            per_image = ""
    steps = []
    if p.pad_to_square:
        steps.append("pad to square")
    if p.do_resize:
        target = (f"{p.size[0]}x{p.size[1]}" if p.size is not None else f"shortest edge {p.shortest_edge}"
                  if p.shortest_edge is not None else f"{p.min_pixels}..{p.max_pixels} pixels")
        steps.append(f"resize to {target} ({p.resample})")
    if p.do_center_crop:
        steps.append(f"center crop {p.crop_size[0]}x{p.crop_size[1]}")
    if p.do_rescale:
        steps.append(f"rescale x{p.rescale_factor:.6g}")
    if p.do_normalize:
        steps.append("normalize mean (" + ", ".join(f"{x:.4g}" for x in p.image_mean) + ") std ("
                     + ", ".join(f"{x:.4g}" for x in p.image_std) + ")")
    if p.kind == "qwen2_vl":
        steps.append(f"patches {p.patch_size} px x {p.temporal_patch_size} frames, merge {p.merge_size}")
    return [
        f"vision       image token {v.image_token_id}: placeholders per image {rule}{per_image}; positions {v.positions}; "
        f"images up to {v.max_image_pixels} pixels",
        f"  preprocess {p.kind}: " + ", ".join(steps),
    ]


def _stat_size(root: Path, rel: str) -> int | None:
    """Size of artifact file rel, None when it is missing; never follows a link out of root."""
    try:
        return artifact_file(root, rel).stat().st_size
    except OSError:  # missing, or a path through a non-directory
        return None


def _ranges(layers: tuple[int, ...]) -> str:
    out, start = [], None
    for i, l in enumerate(layers):
        if start is None:
            start = l
        if i + 1 == len(layers) or layers[i + 1] != l + 1:
            out.append(str(start) if start == l else f"{start}-{l}")
            start = None
    return ",".join(out)
