"""A reference for ``graphkiln verify`` that never holds the model whole: graphkiln's own torch
decoder (the family modules the export traces) run one layer at a time from the checkpoint.

transformers' reference loads every weight in fp32 (32 GB for an 8B model), more than the machine
that exported the model may have. This one reads the checkpoint as the streamed export does
(``models.weights.load_decoder(streamed=True)``, ``CheckpointWeights``) and runs it as the
calibration pass does (``export.calibration._layer_by_layer``): the embedding rows of the ids
used, then each layer built, run on every sequence's hidden states and dropped, then the final
norm, then the LM head a band of vocabulary rows at a time. Memory: one layer in fp32, the
sequences' hidden states, one head band and the logits asked for.

Each sequence runs on its own (batch 1, positions 0..n-1, zero caches and slot states, as the
calibration pass runs its window), so no padding or mask enters the comparison. Every position's
logits come from one pass: greedy generation is checked by teacher forcing (the reference run
once over a prompt and the tokens the artifact generated), which compares the same contexts as
running the reference step by step up to the first divergence.

The modules are the ones the export traced, so this reference does not catch a mistake in a
family module (the test suite compares those with transformers); it catches everything after
them: tracing, lowering, the weights as written, the runtime.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError

# rows of the head read and multiplied at once: a band's fp32 bytes stay under this
HEAD_BAND_BYTES = 64 << 20
# hidden states (fp32) of the perplexity windows run in one pass over the layers
PERPLEXITY_PASS_BYTES = 256 << 20
# transformers' fp32 load: the parameters' fp32 bytes times this (buffers, allocator, conversion)
TRANSFORMERS_OVERHEAD = 1.2


def transformers_reference_bytes(path: Path) -> int:
    """About the memory transformers' fp32 reference of the checkpoint at ``path`` takes: every
    stored tensor's element count (safetensors headers, nothing read) x 4 bytes x 1.2."""
    from graphkiln.models.weights import tensor_headers

    count = sum(math.prod(h["shape"]) for h in tensor_headers(path).values())
    return int(count * 4 * TRANSFORMERS_OVERHEAD)


def streamed_reference_bytes(path: Path, perplexity: bool = False) -> int:
    """About the memory the streamed reference of the checkpoint at ``path`` adds to this process at
    its peak, from the safetensors headers alone (nothing read): the tools (``preflight.BASE_BYTES``)
    unless torch is already imported, the largest layer in fp32 while it is read and converted
    (``preflight.WORKING_FACTOR`` x), one head band (at most ``HEAD_BAND_BYTES``) and, with
    ``perplexity``, a perplexity pass's hidden states (at most ``PERPLEXITY_PASS_BYTES``). The
    logits it returns are not counted, as ``transformers_reference_bytes`` does not count
    transformers': either reference returns the same, for verify's few short prompts."""
    import re
    import sys

    from graphkiln.export.preflight import BASE_BYTES, WORKING_FACTOR
    from graphkiln.models.weights import tensor_headers

    layers: dict[str, int] = {}
    vocab = hidden = 0
    for name, h in tensor_headers(path).items():
        count = math.prod(h["shape"])
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        if m:
            layers[m.group(1)] = layers.get(m.group(1), 0) + count
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")) and len(h["shape"]) == 2:
            vocab, hidden = max(vocab, int(h["shape"][0])), int(h["shape"][1])
    largest = max(layers.values(), default=0) * 4
    band = min(HEAD_BAND_BYTES, vocab * hidden * 4)
    tools = 0 if "torch" in sys.modules else BASE_BYTES
    passes = PERPLEXITY_PASS_BYTES if perplexity else 0
    return int(tools + WORKING_FACTOR * largest + band + passes)


def load_streamed_decoder(path: Path):
    """The checkpoint at ``path`` as a streamed fp32 ``DecoderForExport`` for ``streamed_logits``:
    nothing of it is resident but the small non-layer parameters (the template layers the streamed
    load keeps for tracing are dropped to the meta device, as are the placeholder embedding and
    head). ``decoder.weights`` reads the rest; close it with ``close_streamed_decoder``."""
    from graphkiln.models.config import architecture_of
    from graphkiln.models.registry import family_for
    from graphkiln.models.weights import load_decoder, read_config

    raw = read_config(path)
    family = family_for(architecture_of(raw))
    try:
        cfg = family.parse_config(raw)
    except (ValueError, TypeError) as exc:
        raise GraphkilnError(f"config.json of the reference is inconsistent ({exc}): fix or re-save it") from None
    decoder = load_decoder(path, family, cfg, "fp32", progress=False, streamed=True)
    # read per layer from decoder.weights: the resident copies would only double the memory
    decoder.model.layers.to("meta")
    decoder.model.embed_tokens.to("meta")
    decoder.lm_head.to("meta")
    return decoder


def close_streamed_decoder(decoder) -> None:
    decoder.weights.close()


def _progress(total: int, desc: str):
    from tqdm import tqdm

    # disable=None: a bar on a terminal only (no carriage returns in logs or captured output)
    return tqdm(total=total, desc=desc, unit="layer", disable=None, leave=False)


def streamed_hidden(decoder, sequences: list[list[int]], desc: str = "reference") -> list:
    """The final-norm hidden states (torch, [len, hidden], the weights' dtype) of each token
    sequence, computed layer by layer with the operations and order of the decoder's forward
    (``export.calibration._layer_by_layer``)."""
    import torch

    from graphkiln.models.decoder import embed, scatter_vision_rows

    cfg, weights = decoder.cfg, decoder.weights
    dtype = weights.dtype
    if not sequences:
        return []
    if any(len(s) < 1 for s in sequences):
        raise GraphkilnError("the streamed reference needs sequences of at least one token")
    longest = max(len(s) for s in sequences)
    flavors = decoder.rope_flavors
    if flavors and (not hasattr(decoder, f"rope_cos_{flavors[0]}") or decoder.rope_positions < longest):
        decoder.set_rope_positions(longest)  # per-position values do not depend on the table's size
    with torch.no_grad():
        unique = sorted({i for s in sequences for i in s})
        rows = torch.cat([weights.read_rows("model.embed_tokens.weight", i, i + 1) for i in unique])
        table = torch.nn.Embedding.from_pretrained(rows, freeze=True)
        where = {t: j for j, t in enumerate(unique)}
        runs = []  # per sequence: hidden states and the step inputs that do not change with the layer
        for seq in sequences:
            n = len(seq)
            x = embed(cfg, table, torch.tensor([[where[t] for t in seq]]))
            if cfg.vision_seam:  # no image rows
                x = scatter_vision_rows(x, torch.zeros(0, cfg.hidden_size, dtype=dtype), torch.zeros(0, dtype=torch.long))
            rope_position_ids = torch.arange(n).expand(3, 1, n).contiguous() if cfg.mrope_section else None
            runs.append({
                "x": x,
                "position_ids": torch.arange(n).unsqueeze(0),
                "lookahead": torch.zeros(1, n, dtype=torch.long) if cfg.image_lookahead else None,
                "seq_lens": torch.tensor([n]) if decoder.has_conv else None,
                "slot_idx": torch.tensor([0]) if decoder.has_conv else None,
                "rope": {name: decoder._rope(name, rope_position_ids) for name in decoder.rope_flavors},
            })
        del table, rows
        bar = _progress(cfg.num_layers, desc)
        try:
            for i in range(cfg.num_layers):
                layer = weights.layer(i)
                for run in runs:
                    n = run["x"].shape[1]
                    if cfg.layers[i].mixer == "attention":
                        states = [torch.zeros(1, cfg.num_kv_heads, n, cfg.head_dim, dtype=dtype) for _ in range(2)]
                    else:
                        states = [torch.zeros(1, *state.shape, dtype=dtype) for state in cfg.slot_states(i)]
                    run["x"], _ = layer(run["x"], run["rope"], run["position_ids"], states, run["slot_idx"],
                                        run["seq_lens"], run["lookahead"], None)
                del layer
                weights.release()
                bar.update(1)
        finally:
            weights.release()
            bar.close()
        return [decoder.model.norm(run["x"])[0] for run in runs]


def head_bands(decoder, band_bytes: int = HEAD_BAND_BYTES):
    """(start, stop, weight rows [stop - start, hidden]) of the LM head (a tied head: the
    embedding's rows), a band at a time, each read from the checkpoint when reached."""
    vocab, hidden = decoder.lm_head.weight.shape
    step = max(1, band_bytes // (hidden * decoder.weights.dtype.itemsize))
    for start in range(0, vocab, step):
        stop = min(vocab, start + step)
        yield start, stop, decoder.weights.read_rows("lm_head.weight", start, stop)


def _band_logits(cfg, hidden, band):
    """``models.decoder.head``'s logits for one band of vocabulary rows: the head, then the logits
    scaling or softcap (both elementwise), in the model dtype, then fp32."""
    import torch

    logits = torch.nn.functional.linear(hidden, band)
    if cfg.logits_scaling is not None:
        logits = logits / cfg.logits_scaling
    if cfg.final_logit_softcap is not None:
        cap = cfg.final_logit_softcap
        logits = torch.tanh(logits / cap) * cap
    return logits.to(torch.float32)


def streamed_logits(decoder, sequences: list[list[int]]) -> list[np.ndarray]:
    """Every position's fp32 logits ([len, vocab]) of each token sequence, from a streamed decoder
    (``load_streamed_decoder``): one pass over the layers, then the head a band at a time."""
    import torch

    hidden = streamed_hidden(decoder, sequences)
    if not hidden:
        return []
    flat = torch.cat(hidden)
    out = np.empty((flat.shape[0], decoder.lm_head.weight.shape[0]), dtype=np.float32)
    with torch.no_grad():
        for start, stop, band in head_bands(decoder):
            out[:, start:stop] = _band_logits(decoder.cfg, flat, band).numpy()
    bounds = np.cumsum([0] + [h.shape[0] for h in hidden])
    return [out[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def streamed_perplexity(decoder, parts: list[list[int]], pass_bytes: int = PERPLEXITY_PASS_BYTES):
    """The streamed reference's perplexity on the token windows ``parts`` (every token after a
    window's first, given the ones before it), as ``export.verify.reference_perplexity`` scores
    transformers': a log-sum-exp kept over the head's bands, so no window's logits are held whole.
    Windows go through the layers together, as many as ``pass_bytes`` of hidden states allow."""
    import torch

    from graphkiln.perplexity import Perplexity

    hidden_size = decoder.cfg.hidden_size
    groups, group, size = [], [], 0
    for part in parts:
        n = len(part) * hidden_size * 4
        if group and size + n > pass_bytes:
            groups.append(group)
            group, size = [], 0
        group.append(part)
        size += n
    if group:
        groups.append(group)
    nll, count = 0.0, 0
    for group in groups:
        hidden = streamed_hidden(decoder, group, desc="reference perplexity")
        flat = torch.cat([h[:-1] for h in hidden])  # the positions that predict a next token
        targets = torch.tensor([t for part in group for t in part[1:]])
        lse = torch.full((flat.shape[0],), -math.inf, dtype=torch.float64)
        picked = torch.zeros(flat.shape[0], dtype=torch.float64)
        with torch.no_grad():
            for start, stop, band in head_bands(decoder):
                logits = _band_logits(decoder.cfg, flat, band).double()
                lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=-1))
                inside = (targets >= start) & (targets < stop)
                rows = inside.nonzero(as_tuple=True)[0]
                picked[rows] = logits[rows, targets[rows] - start]
        nll += float((lse - picked).sum())
        count += flat.shape[0]
    return Perplexity(nll / count, count)


class StreamedReference:
    """The checkpoint at ``path`` as a streamed reference (a context manager that closes its shards)."""

    def __init__(self, path: Path) -> None:
        self.decoder = load_streamed_decoder(path)

    @property
    def vocab_size(self) -> int:
        return int(self.decoder.lm_head.weight.shape[0])

    def logits(self, sequences: list[list[int]]) -> list[np.ndarray]:
        return streamed_logits(self.decoder, sequences)

    def perplexity(self, parts: list[list[int]]):
        return streamed_perplexity(self.decoder, parts)

    def close(self) -> None:
        close_streamed_decoder(self.decoder)

    def __enter__(self) -> StreamedReference:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
