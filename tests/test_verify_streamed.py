"""``verify`` against the streamed reference (``export.streamed_reference``): graphkiln's torch decoder
run one layer at a time from the checkpoint, for checkpoints whose transformers reference would not
fit in memory (``verify --streamed-reference`` forces it).

Its logits are transformers' fp32 ones on a dense, a MoE and a conv-hybrid checkpoint; ``verify``
with it reports what the transformers path reports on a matching artifact (teacher-forced greedy
steps included), fails on another seed's checkpoint of the same config, is chosen on its own when
transformers' reference would not fit, and scores a quantized artifact's reference perplexity as
transformers does.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SPECS, build_checkpoint

STEPS = 16


@pytest.mark.parametrize("name", ["llama_gqa_bias", "qwen3_moe", "lfm2"])
def test_streamed_logits_equal_transformers(name, tmp_path, request):
    import torch
    from transformers import AutoModelForCausalLM

    from graphkiln.export.streamed_reference import StreamedReference
    from graphkiln.export.verify import reference_perplexity

    # the dense one is the session's (its artifact is verified below); the others need no artifact
    ckpt = (request.getfixturevalue("llama_case").checkpoint if name == "llama_gqa_bias"
            else build_checkpoint(SPECS[name], tmp_path / name))
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    rng = np.random.default_rng(7)
    sequences = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (1, 6, 23, 40)]
    with StreamedReference(ckpt) as ref:
        # the resident copies the streamed load keeps for tracing are dropped: only norms and rope stay real
        assert all(p.is_meta for p in ref.decoder.model.layers.parameters())
        assert ref.decoder.lm_head.weight.is_meta and ref.vocab_size == model.config.vocab_size
        got = ref.logits(sequences)
        ppl = ref.perplexity(sequences[1:])
    with torch.no_grad():
        for seq, logits in zip(sequences, got):
            want = model(torch.tensor([seq])).logits[0].numpy()
            assert logits.shape == want.shape and logits.dtype == np.float32
            np.testing.assert_allclose(logits, want, rtol=0, atol=1e-4)
    theirs = reference_perplexity(model, sequences[1:])
    assert ppl.tokens == theirs.tokens == sum(len(s) - 1 for s in sequences[1:])
    assert ppl.nll == pytest.approx(theirs.nll, rel=1e-6)


def test_streamed_verify_reports_what_transformers_reports(llama_case):
    from graphkiln.export.verify import verify_artifact

    def run(streamed):
        return verify_artifact(llama_case.artifact, str(llama_case.checkpoint), steps=STEPS, engine=llama_case.engine,
                               streamed=streamed)

    hf, ours = run(False), run(True)
    assert hf.reference_kind == "transformers" and ours.reference_kind == "streamed"
    assert ours.passed and hf.passed, (ours.summary(), hf.summary())
    assert (ours.tokens_compared, ours.tokens_agreed, ours.positions_compared, ours.positions_top1_agreed) == \
        (hf.tokens_compared, hf.tokens_agreed, hf.positions_compared, hf.positions_top1_agreed)
    assert ours.tokens_agreed == ours.tokens_compared == 4 * STEPS  # 4 prompts
    assert ours.max_abs_error <= 1e-4 and abs(ours.max_abs_error - hf.max_abs_error) <= 2e-5
    assert ours.summary().startswith("streamed reference") and ours.summary().endswith("PASS")


def test_streamed_verify_fails_for_another_seed(llama_case, tmp_path, capsys):
    from graphkiln.cli import main
    from graphkiln.export.verify import verify_artifact

    other = build_checkpoint(llama_case.spec, tmp_path / "other", seed=llama_case.spec.seed + 1000)
    report = verify_artifact(llama_case.artifact, str(other), steps=8, engine=llama_case.engine, streamed=True)
    assert report.reference_kind == "streamed"
    assert not report.passed and report.max_abs_error > 1e-2 and report.agreement < 1.0
    assert "FAIL" in report.summary()

    capsys.readouterr()
    assert main(["verify", str(llama_case.artifact), "--reference", str(other), "--streamed-reference",
                 "--steps", "4"]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert main(["verify", str(llama_case.artifact), "--reference", str(llama_case.checkpoint), "--streamed-reference",
                 "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("streamed reference") and "PASS" in out


def test_streamed_reference_is_chosen_when_transformers_would_not_fit(llama_case, monkeypatch):
    from graphkiln import memory
    from graphkiln.export.streamed_reference import transformers_reference_bytes
    from graphkiln.export.verify import verify_artifact

    need = transformers_reference_bytes(llama_case.checkpoint)
    params = sum(p.numel() for p in llama_case.reference.parameters())
    assert need == int(params * 4 * 1.2)
    assert llama_case.engine  # loaded before the memory is made scarce (the artifact's load checks it too)
    monkeypatch.setattr(memory, "available_memory", lambda: need - 1)
    report = verify_artifact(llama_case.artifact, str(llama_case.checkpoint), steps=4, engine=llama_case.engine)
    assert report.reference_kind == "streamed" and report.passed, report.summary()
    monkeypatch.setattr(memory, "available_memory", lambda: need)
    report = verify_artifact(llama_case.artifact, str(llama_case.checkpoint), steps=4, engine=llama_case.engine)
    assert report.reference_kind == "transformers" and report.passed, report.summary()


def test_vision_language_artifacts_keep_the_transformers_reference(llama_case, monkeypatch):
    """(the choice alone, on a text checkpoint's headers: no vision-language export needed)"""
    from graphkiln import memory
    from graphkiln.errors import GraphkilnError
    from graphkiln.export.verify import _use_streamed

    ckpt = llama_case.checkpoint
    with pytest.raises(GraphkilnError, match="--streamed-reference: a vision-language artifact"):
        _use_streamed(True, str(ckpt), ckpt, vision=True)
    monkeypatch.setattr(memory, "available_memory", lambda: 1000)
    with pytest.raises(GraphkilnError, match=r"needs about 0\.0 GiB in fp32 and 0\.0 GiB of memory are available"):
        _use_streamed(None, str(ckpt), ckpt, vision=True)
    with pytest.raises(GraphkilnError, match="the streamed reference .* needs about"):  # chosen, and it does not fit
        _use_streamed(None, str(ckpt), ckpt, vision=False)
    assert _use_streamed(False, str(ckpt), ckpt, vision=False) is False
    monkeypatch.setattr(memory, "available_memory", lambda: None)  # unknown: transformers, as always
    assert _use_streamed(None, str(ckpt), ckpt, vision=True) is False
    assert _use_streamed(None, str(ckpt), ckpt, vision=False) is False


def test_quantized_artifact_reference_perplexity_streamed(tok_case, tmp_path):
    """A quantized artifact's reference perplexity, scored by the streamed reference, is transformers'
    on the same token windows."""
    import torch
    from transformers import AutoModelForCausalLM

    from graphkiln.export.pipeline import ExportOptions, export_model
    from graphkiln.export.verify import reference_perplexity, verify_artifact
    from graphkiln.perplexity import DEFAULT_WINDOW, windows
    from graphkiln.runtime import Engine

    art = tmp_path / "int8"
    export_model(str(tok_case.checkpoint), art, ExportOptions(progress=False, max_seq_len=128, quant="int8",
                                                              quant_method="rtn"))
    engine = Engine.load(art)
    text = tmp_path / "text.txt"
    text.write_text("The baker rose before dawn, lit the oven and weighed the flour for the first loaves. "
                    "By six the street smelled of bread, and the first customers were already at the door.\n" * 3)
    report = verify_artifact(art, str(tok_case.checkpoint), steps=4, engine=engine, streamed=True, text=str(text))
    assert report.reference_kind == "streamed" and report.passed, report.summary()
    parts = windows(engine.tokenizer.encode(text.read_text()), DEFAULT_WINDOW, engine.max_seq_len)
    assert len(parts) > 1  # several windows, scored in one pass
    model = AutoModelForCausalLM.from_pretrained(str(tok_case.checkpoint), dtype=torch.float32).eval()
    theirs = reference_perplexity(model, parts)
    assert report.perplexity_tokens == theirs.tokens
    assert report.reference_perplexity == pytest.approx(theirs.value, rel=1e-5)
