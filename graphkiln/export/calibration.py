"""Activation statistics for the quantizer: how much each input feature of each Linear matters.

Rounding error in weight column k of a Linear costs ``E[x_k^2]`` times its square in the layer's
output (x: the layer's input), so the quantizer (``export.lowering.quantize``) minimises the
error weighted by these per-feature means, as llama.cpp's importance matrix does. They come from
one forward pass of the float torch decoder (the module about to be traced) over a calibration
text, tokenized with the checkpoint's own tokenizer: ``graphkiln/data/calibration.txt``, a mix
of prose, dialogue, code and lists written for this project, and deliberately not the text
``graphkiln verify`` scores perplexity on (graphkiln/data/prose.txt), so the figure it reports is
not measured on the calibration data.

Returned by parameter name (``model.layers.3.mlp.down_proj.weight``, ``lm_head.weight``), the
name the exporter gives the weight's initializer (``<name>.T`` when stored transposed).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CALIBRATION_TEXT = Path(__file__).resolve().parents[1] / "data" / "calibration.txt"
CALIBRATION_TOKENS = 512  # one window; measured enough on the real checkpoint (see docs/quantization.md)


def calibration_ids(checkpoint: Path, limit: int, vocab_size: int) -> list[int] | None:
    """The calibration text's first ``limit`` token ids under the checkpoint's tokenizer.json (ids the
    model's vocabulary lacks dropped), or None when the checkpoint has no (readable) tokenizer.json."""
    path = checkpoint / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception:  # a tokenizer the library cannot read: the export copies it and fails there if it matters
        return None
    ids = [i for i in tok.encode(CALIBRATION_TEXT.read_text(encoding="utf-8")).ids if i < vocab_size][:limit]
    return ids if len(ids) >= 2 else None


def input_importance(decoder, ids: list[int], progress=None) -> dict[str, np.ndarray]:
    """{weight parameter name: float32 [in_features] mean squared input} for every ``nn.Linear`` of
    ``decoder`` (a ``models.decoder.DecoderForExport``) over one forward pass of ``ids``.

    A streamed decoder (``models.weights.load_decoder(streamed=True)``) runs the pass one layer at a
    time (``_layer_by_layer``), the hidden states carried from layer to layer, as GPTQ/AWQ tools do."""
    if getattr(decoder, "weights", None) is not None:
        return _layer_by_layer(decoder, ids, progress)
    import torch

    cfg = decoder.cfg
    dtype = decoder.lm_head.weight.dtype
    seq = len(ids)
    sums: dict[str, torch.Tensor] = {}
    hooks = []

    def hook(name):
        def record(module, inputs, output):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).to(torch.float64)
            sums[name] = sums.get(name, 0) + (x * x).sum(0)

        return record

    for name, module in decoder.named_modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_hook(hook(f"{name}.weight")))
    args: list = [torch.tensor([ids]), torch.arange(seq).unsqueeze(0), torch.arange(seq).unsqueeze(0)]
    if cfg.vision_seam:  # no image rows
        args += [torch.zeros(0, cfg.hidden_size, dtype=dtype), torch.zeros(0, dtype=torch.long)]
    if cfg.mrope_section:
        args.append(torch.arange(seq).expand(3, 1, seq).contiguous())
    if cfg.image_lookahead:
        args.append(torch.zeros(1, seq, dtype=torch.long))
    if cfg.has_slot_states:
        args += [torch.tensor([seq]), torch.tensor([0])]
    if cfg.lora is not None:  # the base model's statistics: no row uses an adapter
        args += [torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)]
    for i, layer in enumerate(cfg.layers):
        if layer.mixer == "attention":
            args += [torch.zeros(1, cfg.num_kv_heads, seq, cfg.head_dim, dtype=dtype) for _ in range(2)]
        else:
            args += [torch.zeros(1, *state.shape, dtype=dtype) for state in cfg.slot_states(i)]
    if cfg.lora is not None:
        from graphkiln.export.onnx_export import lora_stack_specs

        args += [torch.zeros(t.shape) for t in lora_stack_specs(cfg, range(cfg.num_layers))]
    try:
        with torch.no_grad():
            decoder(*args)
    finally:
        for h in hooks:
            h.remove()
    # (a tied head shares the embedding's parameter, but its Linear is lm_head: named by the module)
    return {name: (s / seq).to(torch.float32).numpy() for name, s in sums.items()}


def _layer_by_layer(decoder, ids: list[int], progress=None) -> dict[str, np.ndarray]:
    """``input_importance`` of a streamed decoder: the same operations as its forward, in the same
    order and dtype, with each layer read from the checkpoint (``CheckpointWeights.layer``) just
    before it runs and dropped after, so the statistics are bit-identical to the whole-model pass
    while memory holds one layer. The embedding rows of ``ids`` alone are read; the head's input is
    the final norm of the last hidden states (the head itself is never read)."""
    import torch

    from graphkiln.models.decoder import embed, layer_stacks, scatter_vision_rows

    cfg, weights = decoder.cfg, decoder.weights
    dtype = weights.dtype
    seq = len(ids)
    sums: dict[str, torch.Tensor] = {}

    def record(name, x):
        x = x.reshape(-1, x.shape[-1]).to(torch.float64)
        sums[name] = sums.get(name, 0) + (x * x).sum(0)

    with torch.no_grad():
        unique = sorted(set(ids))
        rows = torch.cat([weights.read_rows("model.embed_tokens.weight", i, i + 1) for i in unique])
        table = torch.nn.Embedding.from_pretrained(rows, freeze=True)
        local = torch.tensor([[unique.index(i) for i in ids]])
        x = embed(cfg, table, local)
        if cfg.vision_seam:  # no image rows
            x = scatter_vision_rows(x, torch.zeros(0, cfg.hidden_size, dtype=dtype), torch.zeros(0, dtype=torch.long))
        position_ids = torch.arange(seq).unsqueeze(0)
        rope_position_ids = torch.arange(seq).expand(3, 1, seq).contiguous() if cfg.mrope_section else None
        lookahead = torch.zeros(1, seq, dtype=torch.long) if cfg.image_lookahead else None
        seq_lens = slot_idx = None
        if decoder.has_conv:
            seq_lens, slot_idx = torch.tensor([seq]), torch.tensor([0])
        routing = (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)) if cfg.lora is not None else None
        stacks = {}
        if cfg.lora is not None:
            from graphkiln.export.onnx_export import lora_stack_specs

            stacks = layer_stacks(cfg, range(cfg.num_layers),
                                  [torch.zeros(t.shape) for t in lora_stack_specs(cfg, range(cfg.num_layers))])
        rope = {name: decoder._rope(name, rope_position_ids) for name in decoder.rope_flavors}
        for i in range(cfg.num_layers):
            if cfg.layers[i].mixer == "attention":
                states = [torch.zeros(1, cfg.num_kv_heads, seq, cfg.head_dim, dtype=dtype) for _ in range(2)]
            else:
                states = [torch.zeros(1, *state.shape, dtype=dtype) for state in cfg.slot_states(i)]
            layer = weights.layer(i)
            hooks = [m.register_forward_hook(lambda mod, inp, out, n=f"model.layers.{i}.{name}.weight": record(n, inp[0]))
                     for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
            try:
                lora = (*routing, stacks[i]) if stacks.get(i) else None
                x, _ = layer(x, rope, position_ids, states, slot_idx, seq_lens, lookahead, lora)
            finally:
                for h in hooks:
                    h.remove()
            del layer, hooks  # before the next layer is read: one layer in memory at a time
            weights.release()
            if progress is not None:
                progress(i)
        index = torch.arange(seq).unsqueeze(0)
        x = torch.gather(x, 1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        record("lm_head.weight", decoder.model.norm(x))
    return {name: (s / seq).to(torch.float32).numpy() for name, s in sums.items()}
