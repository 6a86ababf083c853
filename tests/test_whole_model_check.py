"""The trace-every-layer fallback's memory check (``export.preflight.check_whole_model``, issue 36):
when layer stamping refuses a graph, the export reads every layer and table of the streamed decoder
(``onnx_export.materialized``), the one path whose memory grows with the model; it refuses first, in
one line, when they do not fit the memory available now. No memory figure is mocked: the refused
model is a checkpoint whose sparse shards claim a layer of 1.5x the available memory."""

from __future__ import annotations

import pytest

from conftest import checkpoint_claiming_a_huge_layer


def _meta_decoder(checkpoint):
    """The checkpoint's decoder on the meta device: every layer and table still to be read, as a
    streamed decoder's non-template layers are."""
    from graphkiln.models.config import architecture_of
    from graphkiln.models.registry import family_for
    from graphkiln.models.weights import meta_decoder, read_config

    raw = read_config(checkpoint)
    return meta_decoder(family_for(architecture_of(raw)).parse_config(raw))


def test_whole_model_check_refuses_only_what_does_not_fit(llama_case, tmp_path):
    from graphkiln.errors import GraphkilnError
    from graphkiln.export.onnx_export import materialized
    from graphkiln.export.preflight import check_whole_model
    from graphkiln.models.registry import family_for
    from graphkiln.models.config import architecture_of
    from graphkiln.models.weights import load_decoder, read_config

    # the tiny model fits: the fallback reads every layer and both tables of the streamed decoder
    raw = read_config(llama_case.checkpoint)
    family = family_for(architecture_of(raw))
    decoder = load_decoder(llama_case.checkpoint, family, family.parse_config(raw), "fp32", progress=False,
                           streamed=True)
    assert any(p.is_meta for p in decoder.parameters())
    decoder = materialized(decoder)
    assert not any(p.is_meta for p in decoder.parameters()) and decoder.weights is None

    huge = checkpoint_claiming_a_huge_layer(llama_case.checkpoint, tmp_path / "huge")
    with pytest.raises(GraphkilnError) as refused:
        check_whole_model(_meta_decoder(huge))
    message = str(refused.value)
    assert "\n" not in message and "tracing every layer" in message and "GiB" in message
    assert "--dtype fp16" in message  # the remedy for an fp32 export
