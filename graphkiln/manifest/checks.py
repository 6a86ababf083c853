"""What a manifest's sections must agree on, checked once every record is valid on its own
(``Manifest``'s validator runs ``check_cross_references``): one decoder graph (or stages
covering the layers), every file checksummed, each layer's state matching the tensors that
read and write it, one update mode per state, engines and batched graphs naming real graphs,
the vision seam and spec together, LoRA stacks matching the lora record, token ids inside the
vocabulary. A failure is a ``FieldError`` naming the exact field."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from graphkiln.imaging import check_compatible
from graphkiln.manifest.fields import FieldError
from graphkiln.manifest.specs import StateSpec, TensorSpec, first_output, output_mode, state_kind
from graphkiln.manifest.vocabulary import LORA_STACK_ROLES, MANIFEST_NAME, STAGE_GRAPH

if TYPE_CHECKING:
    from graphkiln.manifest.document import Manifest


def check_cross_references(m: Manifest) -> None:
    """What the runtime assumes across sections: one decoder graph; every graph and tokenizer
    file checksummed; layers in range, each in one state, the graph's state tensors matching it;
    token ids inside the vocabulary."""
    vocab, num_layers = m.model.vocab_size, m.model.num_layers
    keys = [(g.name, g.target) for g in m.graphs]
    for i, (name, target) in enumerate(keys):
        if (name, target) in keys[:i]:
            raise FieldError(("graphs", i, "name"), f"{name!r} appears twice for target {target}")
    names = [g.name for g in m.graphs]
    if "decoder" not in names and not m.stages:
        raise FieldError(("graphs",), "has no graph named 'decoder'")
    _check_stages(m, names)
    if MANIFEST_NAME in m.files:
        raise FieldError(("files",), f"lists {MANIFEST_NAME}, which cannot hold its own checksum")
    for i, g in enumerate(m.graphs):
        if g.file not in m.files:
            raise FieldError(("graphs", i, "file"), f"{g.file!r} is not listed in files (no checksum covers it)")
    for i, f in enumerate(m.tokenizer_files):
        if f not in m.files:
            raise FieldError(("tokenizer_files", i), f"{f!r} is not listed in files (no checksum covers it)")
        if f in m.tokenizer_files[:i]:
            raise FieldError(("tokenizer_files", i), f"{f!r} appears twice")
    owner: dict[tuple[int, str], StateSpec] = {}  # (layer, kind) -> its state
    for i, s in enumerate(m.states):
        for j, layer in enumerate(s.layers):
            if layer >= num_layers:
                raise FieldError(("states", i, "layers", j), f"is {layer}, not a layer of this {num_layers}-layer model")
            kinds = {k for (held, k) in owner if held == layer} | {s.kind}
            if (layer, s.kind) in owner or (len(kinds) > 1 and kinds != {"conv", "recurrent"}):
                raise FieldError(("states", i, "layers", j), f"layer {layer} is in two states")
            owner[layer, s.kind] = s
        if s.dtype != m.states[0].dtype:
            raise FieldError(("states", i, "dtype"), f"is {s.dtype}, but states[0] is {m.states[0].dtype} "
                              "(the runtime keeps all state in one dtype)")
    for i, g in enumerate(m.graphs):
        for side in ("inputs", "outputs"):
            for j, t in enumerate(getattr(g, side)):
                where = ("graphs", i, side, j)
                if t.role in LORA_STACK_ROLES:
                    _check_lora_stack(m, where, t)
                    continue
                if t.layer is None:
                    if t.role == "logits" and t.shape and isinstance(t.shape[-1], int) and t.shape[-1] != vocab:
                        raise FieldError(where + ("shape",), f"ends in {t.shape[-1]}, not the vocabulary size {vocab}")
                    if t.role == "last_hidden_state":
                        hidden = m.model.hidden_size
                        if tuple(t.shape) != ("batch", "n_logits", hidden):
                            raise FieldError(where + ("shape",), f"is {list(t.shape)}, not ['batch', 'n_logits', "
                                              f"{hidden}] (the logits positions' final-norm hidden states)")
                        if g.target == "tensorrt":  # its runners bind every output to a buffer they know
                            raise FieldError(where, "last_hidden_state is not supported on a tensorrt-target graph")
                    continue
                kind = state_kind(t.role)
                s = owner.get((t.layer, kind))
                if s is None or s.kind != kind:
                    raise FieldError(where + ("layer",), f"{t.layer} has no {kind} state (see states[].layers)")
                if side == "outputs" and output_mode(t) != output_mode(g.outputs[first_output(g, s)]):
                    first = g.outputs[first_output(g, s)]
                    raise FieldError(where, f"{t.name!r} is updated {output_mode(t)} but {first.name!r} of the "
                                      f"same {kind} state {output_mode(first)}: a graph updates a state one way")
                want = (s.num_kv_heads, s.head_dim) if kind == "kv" else s.slot_shape()
                got = (t.shape[1], t.shape[3]) if kind == "kv" else tuple(t.shape[1:])
                if any(isinstance(x, int) and x != y for x, y in zip(got, want)):
                    fields = {"kv": "num_kv_heads, head_dim", "conv": "channels, width", "recurrent": "dims"}[kind]
                    raise FieldError(where + ("shape",), f"{list(t.shape)} does not match its {kind} state "
                                      f"({fields} {list(want)})")
    for i, e in enumerate(m.engines):
        if (e.graph, e.target) not in keys:
            raise FieldError(("engines", i, "graph"), f"{e.graph!r} ({e.target}) is not a graph of this artifact")
        if e.target != "tensorrt":
            raise FieldError(("engines", i, "target"), f"is {e.target}: TensorRT engines are built from the "
                              "tensorrt-target graph")
        for loc, rel in ((("file",), e.file), (("timing_cache",), e.timing_cache)):
            if rel is not None and rel not in m.files:
                raise FieldError(("engines", i) + loc, f"{rel!r} is not listed in files (no checksum covers it)")
        if e.max_seq_len > min(s.max_seq_len for s in m.states):
            raise FieldError(("engines", i, "max_seq_len"), f"is {e.max_seq_len}, longer than the states' "
                              f"max_seq_len {min(s.max_seq_len for s in m.states)}")
        inputs = {t.name for t in m.graphs[keys.index((e.graph, e.target))].inputs}
        for j, p in enumerate(e.profiles):
            for name, shapes in p.shapes.items():
                if name not in inputs:
                    raise FieldError(("engines", i, "profiles", j, "shapes"), f"names {name!r}, not an input "
                                      f"of graph {e.graph!r}")
                if len({len(x) for x in shapes}) != 1 or any(a > b for lo, hi in zip(shapes, shapes[1:])
                                                             for a, b in zip(lo, hi)):
                    raise FieldError(("engines", i, "profiles", j, "shapes", name),
                                      f"{[list(x) for x in shapes]} is not min <= opt <= max of one rank")
        if (e.graph, e.target, e.backend) in [(o.graph, o.target, o.backend) for o in m.engines[:i]]:
            raise FieldError(("engines", i), f"repeats the {e.backend} engine of graph {e.graph!r}")
    for i, b in enumerate(m.batched):
        if (b.graph, b.target) not in keys:
            raise FieldError(("batched", i, "graph"), f"{b.graph!r} ({b.target}) is not a graph of this artifact")
        if b.file not in m.files:
            raise FieldError(("batched", i, "file"), f"{b.file!r} is not listed in files (no checksum covers it)")
        for j, d in enumerate(b.weights):
            for field_name in ("source", "source_scales", "source_zero_points", "smooth"):
                ref = getattr(d, field_name)
                if ref is not None and ref.file not in m.files:
                    raise FieldError(("batched", i, "weights", j, field_name, "file"),
                                      f"{ref.file!r} is not listed in files (no checksum covers it)")
    has_vision_graph = "vision" in names
    # the seam is the first graph's: the decoder's, or a staged artifact's first stage's
    first = "stage0" if m.stages else "decoder"
    seams = [g for g in m.graphs if any(t.role == "vision_embeddings" for t in g.inputs)]
    if any(g.name != first for g in seams):
        raise FieldError(("graphs",), f"graph {next(g.name for g in seams if g.name != first)!r} takes "
                          f"vision_embeddings, which only the {first} graph may take")
    if m.vision is not None:
        if not has_vision_graph:
            raise FieldError(("vision",), "is set but the artifact has no graph named 'vision'")
        if len(seams) != names.count(first):
            raise FieldError(("vision",), f"is set but a {first} graph lacks the vision_embeddings seam")
        if m.stages:  # the process running the first stage runs the vision graph too
            for g in m.graphs:
                if g.name == "vision" and g.file not in m.stages[0].files:
                    raise FieldError(("stages", 0, "files"), f"does not list the vision graph file {g.file!r} "
                                      "(the vision graph belongs to the first stage)")
        if m.vision.image_token_id >= vocab:
            raise FieldError(("vision", "image_token_id"), f"is {m.vision.image_token_id}, outside the "
                              f"vocabulary [0, {vocab})")
        rule = m.vision.placeholder
        for name in ("row_token_id", "prefix_ids", "suffix_ids"):
            ids = getattr(rule, name, None)
            bad = [t for t in (ids if isinstance(ids, tuple) else (ids,)) if t is not None and not 0 <= t < vocab]
            if bad:
                raise FieldError(("vision", "placeholder", name), f"holds token id {bad[0]}, outside the "
                                  f"vocabulary [0, {vocab})")
        try:
            check_compatible(m.vision.preprocessing, m.vision.placeholder)
        except ValueError as exc:
            raise FieldError(("vision", "placeholder"), str(exc)) from None
        hidden = m.model.hidden_size
        for i, g in enumerate(m.graphs):
            for j, t in enumerate(g.outputs if g.name == "vision" else g.inputs):
                if t.role in ("image_embeddings", "vision_embeddings") and t.shape[-1] != hidden:
                    raise FieldError(("graphs", i, "outputs" if g.name == "vision" else "inputs", j, "shape"),
                                      f"ends in {t.shape[-1]}, not the model's hidden size {hidden}")
    elif has_vision_graph or seams:
        raise FieldError(("vision",), "is missing: the artifact has a vision graph or seam but no vision spec")
    _check_lora_graphs(m)
    _check_embedding(m)
    gen = m.generation
    for loc, token in [(("eos_token_ids", i), t) for i, t in enumerate(gen.eos_token_ids)] + [
            (("bos_token_id",), gen.bos_token_id), (("pad_token_id",), gen.pad_token_id)]:
        if token is not None and token >= vocab:
            raise FieldError(("generation",) + loc, f"is {token}, outside the vocabulary [0, {vocab})")


def _check_embedding(m: Manifest) -> None:
    """An embedding record exactly when the decoder graphs return no logits (``EmbeddingSpec``);
    an embedding artifact is one plain decoder (no stages, vision or LoRA: export refuses them)."""
    no_logits = [i for i, g in enumerate(m.graphs) if g.name == "decoder"
                 and not any(t.role == "logits" for t in g.outputs)]
    if m.embedding is None and no_logits:
        raise FieldError(("graphs", no_logits[0], "outputs"), "hold no logits, but the manifest has no embedding "
                          "record (only an embedding artifact's decoder returns last_hidden_state alone)")
    if m.embedding is not None:
        if len(no_logits) != sum(g.name == "decoder" for g in m.graphs) or m.stages or m.vision or m.lora:
            raise FieldError(("embedding",), "is set, but the artifact's graphs are not one embedding decoder "
                              "(every decoder graph returns last_hidden_state and no logits; no stages, vision or LoRA)")


def _check_lora_stack(m: Manifest, where: tuple, t: TensorSpec) -> None:
    """A LoRA stack input matches the manifest's ``lora`` record: [slots, in, rank] / [slots, rank, out]."""
    if m.lora is None:
        raise FieldError(where, f"{t.name!r} is a LoRA input, but the manifest has no lora record")
    if t.module not in m.lora.modules:
        raise FieldError(where + ("module",), f"is {t.module}, not one of lora.modules {list(m.lora.modules)}")
    if t.layer >= m.model.num_layers:
        raise FieldError(where + ("layer",), f"is {t.layer}, not a layer of this {m.model.num_layers}-layer model")
    slots, rows, cols = t.shape
    rank_at = 2 if t.role == "lora_a" else 1
    if slots != m.lora.max_loras + 1 or t.shape[rank_at] != m.lora.rank or t.dtype != "float32":
        raise FieldError(where + ("shape",), f"is {t.dtype} {list(t.shape)}; a {t.role} stack is float32 with {m.lora.max_loras + 1} slots and rank "
                          f"{m.lora.rank} (lora.max_loras + 1, lora.rank)")


def _check_stages(m: Manifest, names: list[str]) -> None:
    """A staged artifact (``stages``): stage k is graph ``stage{k}``, the stages cover the
    layers in order, each graph reads and writes only its own layers' state, takes
    input_ids (first) or hidden_states (later) and returns logits (last) or hidden_states,
    and each stage's states are the manifest's states restricted to its layers."""
    stage_graphs = sorted({n for n in names if STAGE_GRAPH.fullmatch(n)})
    if not m.stages:
        if stage_graphs:
            raise FieldError(("stages",), f"is empty but the artifact has stage graph {stage_graphs[0]!r}")
        return
    if "decoder" in names:
        raise FieldError(("graphs",), "holds a 'decoder' graph beside pipeline stages: a staged artifact has "
                          "one graph per stage")
    if len(stage_graphs) != len(m.stages):
        raise FieldError(("stages",), f"lists {len(m.stages)} stages but the artifact has "
                          f"{len(stage_graphs)} stage graphs")
    last = len(m.stages) - 1
    expected = 0
    for i, st in enumerate(m.stages):
        where = ("stages", i)
        if st.graph != f"stage{i}" or st.graph not in names:
            raise FieldError(where + ("graph",), f"is {st.graph!r}, not the artifact's graph 'stage{i}'")
        start, end = st.layers
        if start != expected or end <= start:
            raise FieldError(where + ("layers",), f"is {[start, end]}: stages must cover the layers in order, "
                              f"without gaps or overlaps (this one must start at {expected})")
        expected = end
        if st.tied_head and i != last:
            raise FieldError(where + ("tied_head",), "is set on a stage that is not the last (the head's copy "
                              "belongs to the last stage)")
        for j, f in enumerate(st.files):
            if f not in m.files:
                raise FieldError(where + ("files", j), f"{f!r} is not listed in files (no checksum covers it)")
        held: set[tuple[int, str]] = set()
        for j, s in enumerate(st.states):
            for k, layer in enumerate(s.layers):
                owner = next((g for g in m.states if layer in g.layers and g.kind == s.kind), None)
                if not start <= layer < end or owner is None:
                    raise FieldError(where + ("states", j, "layers", k), f"is {layer}, not a stateful layer of "
                                      f"this stage ({start}:{end})")
                if asdict(owner) | {"layers": None} != asdict(s) | {"layers": None}:
                    raise FieldError(where + ("states", j), f"differs from the manifest state holding layer {layer}")
                if (layer, s.kind) in held:
                    raise FieldError(where + ("states", j, "layers", k), f"layer {layer} is in two states")
                held.add((layer, s.kind))
        owned = {(layer, g.kind) for g in m.states for layer in g.layers if start <= layer < end}
        if held != owned:
            raise FieldError(where + ("states",), f"misses the {min(owned - held)[1]} state of layer "
                              f"{min(owned - held)[0]}")
        for g in m.graphs:
            if g.name != st.graph:
                continue
            if g.file not in st.files:
                raise FieldError(where + ("files",), f"does not list the stage's graph file {g.file!r}")
            roles_in = {t.role for t in g.inputs}
            roles_out = {t.role for t in g.outputs}
            want_in, want_out = ("input_ids" if i == 0 else "hidden_states"), ("logits" if i == last else "hidden_states")
            if want_in not in roles_in or want_out not in roles_out:
                raise FieldError(where + ("graph",), f"graph {g.file} must take {want_in} and return {want_out} "
                                  f"as stage {i} of {last + 1}")
            for t in g.inputs + g.outputs:
                if t.layer is not None and not start <= t.layer < end:
                    raise FieldError(where + ("graph",), f"graph {g.file} has {t.name!r}, a tensor of layer "
                                      f"{t.layer} outside the stage's layers {start}:{end}")
    if expected != m.model.num_layers:
        raise FieldError(("stages",), f"cover layers 0:{expected}, not the model's {m.model.num_layers} layers")


def _check_lora_graphs(m: Manifest) -> None:
    """Each decoder or stage graph of an adapter-capable artifact that takes LoRA stacks takes
    lora_rows and lora_slots and, per stack, its partner; an artifact without a lora record has
    none of them."""
    for i, g in enumerate(m.graphs):
        stacks = {(t.layer, t.module, t.role) for t in g.inputs if t.role in LORA_STACK_ROLES}
        routing = {t.role for t in g.inputs if t.role in ("lora_rows", "lora_slots")}
        if m.lora is None:
            if routing:
                raise FieldError(("graphs", i, "inputs"), f"takes {min(routing)}, but the manifest has no lora record")
            continue
        if stacks and routing != {"lora_rows", "lora_slots"}:
            raise FieldError(("graphs", i, "inputs"), "takes LoRA stacks but not both lora_rows and lora_slots")
        for layer, module, role in sorted(stacks):
            other = "lora_b" if role == "lora_a" else "lora_a"
            if (layer, module, other) not in stacks:
                raise FieldError(("graphs", i, "inputs"), f"has the {role} stack of layer {layer} {module} "
                                  f"but not its {other}")
