"""Gemma3ForConditionalGeneration (issue 13): a SigLIP tower with Gemma3's pooled projector in front
of the Gemma3 text decoder, image tokens attending bidirectionally within their image.

The tiny checkpoint: 56x56 images in 14-pixel patches (a 4x4 grid) average-pooled to 4 tokens per
image, a 4-layer text model mixing sliding (window 3, smaller than an image's 4 tokens, so the
window really cuts into the image) and full layers, a word-level tokenizer holding Gemma3's image
tokens and "\\n\\n". Parity is against transformers' model fed the pixel values the runtime
computed and the ``token_type_ids`` Gemma3Processor returns (without them transformers masks the
image causally; a test checks that this changes its logits, so the parity tests the bidirectional
mask): fp32 logits within 1e-4 at every prompt position and greedy tokens identical over 16 steps.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cli_contract import assert_nothing_written, assert_one_error, run_cli
from conftest import MAX_SEQ_LEN, Spec, build_checkpoint, tokens_through_scheduler
from graphkiln.errors import GraphkilnError
from graphkiln.runtime import Engine, GenerationConfig
from graphkiln.runtime.backends.vision import expand_placeholders

ATOL = 1e-4
STEPS = 16
BOI, EOI, SOFT, NEWLINES = 297, 298, 299, 108
TOKENS_PER_IMAGE = 4
SPEC = Spec(
    "gemma3_vl",
    "Gemma3ForConditionalGeneration",
    dict(text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                          sliding_window=3, max_position_embeddings=256, initializer_range=0.15,
                          layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                          rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                              "rope_theta": 1_000_000.0},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
         vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                            num_attention_heads=4, num_hidden_layers=2, image_size=56, patch_size=14,
                            vision_use_head=False),
         mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=BOI, eoi_token_index=EOI, image_token_index=SOFT),
    seed=41,
    features=("vlm", "siglip_tower", "pooled_projector", "bidirectional_images", "sliding_cuts_images"),
    # as Gemma3's hub preprocessor_config.json, scaled down
    preprocessor_config={"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 56, "width": 56},
                         "resample": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                         "do_convert_rgb": None, "do_pan_and_scan": None, "image_seq_length": TOKENS_PER_IMAGE,
                         "processor_class": "Gemma3Processor"},
)


def _tokenizer():
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(3, 100)}, "\n\n": NEWLINES,
             "<start_of_image>": BOI, "<end_of_image>": EOI, "<image_soft_token>": SOFT}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_tokens([AddedToken("\n\n", normalized=False)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<start_of_image>", "<end_of_image>", "<image_soft_token>")])
    return tok


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    ck = build_checkpoint(SPEC, tmp_path_factory.mktemp("gemma3_vl") / "checkpoint")
    _tokenizer().save(str(ck / "tokenizer.json"))
    return ck


@pytest.fixture(scope="module")
def artifacts(checkpoint, tmp_path_factory):
    """target -> exported artifact directory, each exported on first use."""
    from graphkiln.export.pipeline import ExportOptions, export_model

    root, done = tmp_path_factory.mktemp("gemma3_vl_art"), {}

    def get(target: str = "onnxruntime"):
        if target not in done:
            done[target] = root / target
            export_model(str(checkpoint), done[target], ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN,
                                                                      target=target))
        return done[target]

    return get


@pytest.fixture(scope="module")
def engine(artifacts):
    return Engine.load(artifacts("onnxruntime"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def greedy(n: int = STEPS, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, do_sample=False, stop_token_ids=(), **kw)


def rgb(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng([seed, height, width]).integers(0, 256, (height, width, 3), dtype=np.uint8)


def text(n: int, salt: int) -> list[int]:
    """Random ids that are none of the image tokens."""
    ids = np.random.default_rng([SPEC.seed, salt]).integers(3, BOI, n)
    return ids.tolist()


def ref_inputs(engine, ids: list[int], images) -> dict:
    """What Gemma3Processor gives the model for expanded ``ids``: pixel values (the runtime's own
    preprocessing) and token_type_ids marking the image tokens."""
    from graphkiln.imaging import load_image, preprocess

    t = torch.tensor([ids])
    if not images:
        return {"input_ids": t}
    spec = engine.manifest.vision
    pv = preprocess([load_image(im, spec.max_image_pixels) for im in images], spec.preprocessing).pixel_values
    return {"input_ids": t, "pixel_values": torch.from_numpy(pv), "token_type_ids": (t == SOFT).long()}


def check_parity(engine, model, prompts, images):
    results = engine.generate(prompts, greedy(output_logits=True), images=images)
    logits = engine.prompt_logits(prompts, images=images)
    for i, (res, ours) in enumerate(zip(results, logits)):
        imgs = images[i] or []
        # each <start_of_image> became "\n\n" <start_of_image> soft x 4 <end_of_image> "\n\n"
        assert len(res.prompt_ids) == len(prompts[i]) + len(imgs) * (TOKENS_PER_IMAGE + 3)
        assert res.prompt_ids.count(SOFT) == TOKENS_PER_IMAGE * len(imgs)
        inputs = ref_inputs(engine, res.prompt_ids, imgs)
        with torch.no_grad():
            ref = model(**inputs).logits[0].numpy()
            out = model.generate(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]), max_new_tokens=STEPS,
                                 min_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
        assert ours.shape == ref.shape
        assert np.abs(ours - ref).max() <= ATOL, (i, np.abs(ours - ref).max())
        assert res.token_ids == out.sequences[0, len(res.prompt_ids):].tolist(), i
        assert np.abs(res.logits - torch.stack(out.logits, 1)[0].numpy()).max() <= ATOL
    assert engine.pool.live == 0
    return results


# -- config, rule, graphs ------------------------------------------------------------------------

def test_manifest_records_the_rule_and_both_graphs(engine):
    m = engine.manifest
    assert m.vision.image_token_id == BOI  # what the prompt holds, as Gemma3Processor takes it
    rule = m.vision.placeholder
    assert (rule.kind, rule.tokens_per_image, rule.row_token_id) == ("fixed", TOKENS_PER_IMAGE, SOFT)
    assert rule.prefix_ids == (NEWLINES, BOI) and rule.suffix_ids == (EOI, NEWLINES)
    assert m.vision.preprocessing.kind == "gemma3" and m.vision.preprocessing.output_size == (56, 56)
    vision = m.graph("vision")
    assert [t.shape for t in vision.inputs] == [("images", 3, 56, 56)]
    assert [t.shape for t in vision.outputs] == [("image_rows", 64)]
    roles = {t.role for t in m.graph("decoder").inputs}
    assert {"vision_embeddings", "vision_scatter_indices", "lookahead"} <= roles


@pytest.mark.parametrize("field, value", [("row_token_id", 10**6), ("prefix_ids", [1, 10**6]), ("suffix_ids", [10**6])])
def test_a_manifest_with_wrapping_ids_outside_the_vocabulary_is_refused(engine, field, value):
    """The manifest is untrusted: an out-of-vocabulary id would fail inside the embedding lookup."""
    import json

    from graphkiln.errors import GraphkilnError
    from graphkiln.manifest import Manifest

    d = json.loads((engine.artifact_dir / "manifest.json").read_text())
    Manifest.from_json(json.dumps(d))  # the untouched manifest reads
    d["vision"]["placeholder"][field] = value
    with pytest.raises(GraphkilnError) as err:
        Manifest.from_json(json.dumps(d))
    assert f"vision.placeholder.{field}" in str(err.value) and "outside the vocabulary" in str(err.value)
    assert "\n" not in str(err.value)


def test_vision_graph_matches_transformers(artifacts, reference):
    import onnxruntime as ort

    px = np.random.default_rng(1).standard_normal((3, 3, 56, 56)).astype(np.float32)
    sess = ort.InferenceSession(str(artifacts("onnxruntime") / "vision.onnx"), providers=["CPUExecutionProvider"])
    ours = sess.run(None, {"pixel_values": px})[0]
    with torch.no_grad():
        ref = reference.model.get_image_features(pixel_values=torch.from_numpy(px)).pooler_output
    assert ours.shape == (3 * TOKENS_PER_IMAGE, 64)
    assert np.abs(ours - ref.reshape(-1, 64).numpy()).max() <= ATOL


def test_the_reference_mask_is_bidirectional_within_an_image(engine, reference):
    """token_type_ids change the reference's logits in this config (in full and in sliding layers),
    so matching it with them tests our lookahead."""
    ids, _ = expand_placeholders(text(3, 1) + [BOI] + text(4, 2), BOI, [TOKENS_PER_IMAGE],
                                 rule=engine.manifest.vision.placeholder)
    inputs = ref_inputs(engine, ids, [rgb(1, 40, 60)])
    with torch.no_grad():
        both = reference(**inputs).logits
        causal = reference(**{k: v for k, v in inputs.items() if k != "token_type_ids"}).logits
    assert (both - causal).abs().max() > 1e-3


# -- parity through the Engine ------------------------------------------------------------------------

def test_parity_one_image(engine, reference):
    check_parity(engine, reference, [text(3, 3) + [BOI] + text(5, 4)], [[rgb(2, 45, 60)]])


def test_parity_two_images_of_different_sizes_in_one_prompt(engine, reference):
    p = text(2, 5) + [BOI] + text(3, 6) + [BOI] + text(3, 7)
    check_parity(engine, reference, [p], [[rgb(3, 24, 30), rgb(4, 50, 97)]])


def test_parity_batch_of_two_where_one_prompt_has_no_image(engine, reference):
    with_image = text(4, 8) + [BOI] + text(2, 9)
    results = check_parity(engine, reference, [text(11, 10), with_image], [None, [rgb(5, 33, 40)]])
    alone = engine.generate([with_image], greedy(), images=[[rgb(5, 33, 40)]])[0]
    assert alone.token_ids == results[1].token_ids


def test_a_repeated_image_hits_the_cache_and_gives_the_same_tokens(artifacts):
    engine = Engine.load(artifacts("onnxruntime"), check_files=False)
    image, p = rgb(8, 40, 52), text(3, 13) + [BOI] + text(3, 14)
    first = engine.generate([p], greedy(), images=[[image]])[0]
    assert engine.vision.runs == 1
    again = engine.generate([p], greedy(), images=[[image.copy()]])[0]
    assert again.token_ids == first.token_ids
    assert engine.vision.runs == 1 and engine.vision.cache.hits == 1


def test_prompt_refusals_are_one_line_and_leave_every_slot_free(engine):
    runs = engine.vision.runs
    for prompts, images, needle in [
        ([[5, BOI, 6, BOI]], [[rgb(9, 30, 30)]], "has 2 <start_of_image> placeholders but 1 image"),
        ([[5, 6]], [[rgb(9, 30, 30)]], "has no <start_of_image> placeholder but 1 image"),
        ([[5, SOFT, 6, BOI]], [[rgb(9, 30, 30)]], f"holds image row token {SOFT}"),
    ]:
        with pytest.raises(GraphkilnError) as exc:
            engine.generate(prompts, greedy(2), images=images)
        assert needle in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
        assert engine.pool.live == 0
    assert engine.vision.runs == runs


def test_text_prompt_expands_as_gemma3_processor(engine, checkpoint):
    """A text prompt: the same ids as transformers' Gemma3Processor (tokenizer from the checkpoint)."""
    from transformers import AutoImageProcessor, Gemma3Processor, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"),
                                  extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                        "image_token": "<image_soft_token>"})
    processor = Gemma3Processor(AutoImageProcessor.from_pretrained(str(checkpoint)), tok,
                                image_seq_length=TOKENS_PER_IMAGE)
    prompt, image = "w5 w6 <start_of_image> w7 w8", rgb(10, 40, 30)
    want = processor(text=[prompt], images=[[image]], return_tensors="np")
    assert engine.image_token_text == "<start_of_image>"
    got = engine.generate(prompt, greedy(2), images=[image])[0].prompt_ids
    assert got == want["input_ids"][0].tolist()
    assert (np.array(got) == SOFT).astype(int).tolist() == want["token_type_ids"][0].tolist()
    # and the processor's pixel values are the runtime's
    ours = ref_inputs(engine, got, [image])["pixel_values"].numpy()
    assert ours.shape == want["pixel_values"].shape and np.abs(ours - want["pixel_values"]).max() <= 1e-5


# -- export refusals --------------------------------------------------------------------------------

@pytest.mark.parametrize("edit, needles", [
    (lambda c, p: c.update(mm_tokens_per_image=5), ["mm_tokens_per_image 5"]),
    (lambda c, p: c.update(mm_tokens_per_image=9), ["mm_tokens_per_image 9", "4x4 patch grid"]),
    (lambda c, p: c.update(image_token_index=300), ["image_token_index 300 is outside the text vocabulary"]),
    (lambda c, p: c.update(eoi_token_index=BOI), ["must differ"]),
    (lambda c, p: c["vision_config"].update(model_type="clip_vision_model"), ["'clip_vision_model' is not supported"]),
    (lambda c, p: c["text_config"].update(model_type="llama"), ["'llama' is not supported"]),
    (lambda c, p: c["text_config"].update(attn_logit_softcapping=50.0), ["attn_logit_softcapping"]),
    (lambda c, p: p.update(image_seq_length=8), ["image_seq_length 8 differs", "mm_tokens_per_image 4"]),
    (lambda c, p: p.update(do_pan_and_scan=True), ["pan-and-scan"]),
    (lambda c, p: p.update(size={"height": 28, "width": 28}), ["makes 28x28 images but the vision tower takes 56x56"]),
    ("no-tokenizer", ["has no tokenizer.json"]),
    ("tokenizer-disagrees", ["tokenizer.json has <image_soft_token> as id 5"]),
])
def test_export_refuses_a_broken_checkpoint(checkpoint, tmp_path, capsys, edit, needles):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(checkpoint, ck)
    if edit == "no-tokenizer":
        (ck / "tokenizer.json").unlink()
    elif edit == "tokenizer-disagrees":
        d = json.loads((ck / "tokenizer.json").read_text())
        d["model"]["vocab"]["<image_soft_token>"] = 5
        for t in d["added_tokens"]:
            if t["content"] == "<image_soft_token>":
                t["id"] = 5
        (ck / "tokenizer.json").write_text(json.dumps(d))
    else:
        c, p = (json.loads((ck / f).read_text()) for f in ("config.json", "preprocessor_config.json"))
        edit(c, p)
        (ck / "config.json").write_text(json.dumps(c))
        (ck / "preprocessor_config.json").write_text(json.dumps(p))
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "art"
    code, _, err = run_cli(capsys, "export", ck, "-o", out)
    assert_one_error(code, err, *needles, alone=True)
    assert_nothing_written(out)


def test_expand_placeholders_with_a_wrapping_rule():
    from graphkiln.imaging import PlaceholderRule

    rule = PlaceholderRule("fixed", tokens_per_image=2, row_token_id=9, prefix_ids=(1, 8), suffix_ids=(7, 1))
    ids, pos = expand_placeholders([5, 8, 6, 8], 8, [2, 3], rule=rule)
    assert ids == [5, 1, 8, 9, 9, 7, 1, 6, 1, 8, 9, 9, 9, 7, 1]
    assert pos.tolist() == [3, 4, 10, 11, 12]
    # no rule, or LLaVA's, is the plain repetition
    assert expand_placeholders([5, 8], 8, [2], rule=PlaceholderRule("fixed", tokens_per_image=2))[0] == [5, 8, 8]


# -- CLI --------------------------------------------------------------------------------------------

def test_cli_verify_passes(artifacts, checkpoint, capsys):
    code, out, err = run_cli(capsys, "verify", artifacts("onnxruntime"), "--reference", checkpoint, "--steps", 4)
    assert code == 0, (out, err)
    assert "with images: 1 image, 2 images" in out and "PASS" in out and "skipped" not in out


def test_images_through_the_scheduler_in_chunks_equal_each_request_alone(artifacts, engine):
    """Continuous batching with a step budget smaller than an image: a chunk never ends inside an
    image (its tokens see each other, so it must be prefilled whole: PromptLayout.chunk_end),
    and every request's greedy tokens equal the request run alone."""
    from graphkiln.runtime import Engine
    prompts = [text(3, 31) + [BOI] + text(5, 32), text(9, 33), text(2, 34) + [BOI] + text(1, 35) + [BOI]]
    images = [[rgb(11, 50, 60)], None, [rgb(12, 40, 40), rgb(13, 64, 48)]]
    alone = [engine.generate([p], greedy(), images=[im])[0].token_ids for p, im in zip(prompts, images)]
    step_tokens = 3
    assert TOKENS_PER_IMAGE > step_tokens

    assert tokens_through_scheduler(artifacts("onnxruntime"), prompts, images, greedy(), step_tokens) == alone


def test_pipeline_stages_carry_the_image_lookahead(engine, checkpoint, tmp_path):
    """export --stage-layers 0:1,1:4 (a sliding first stage, the rest after it): every stage takes
    the lookahead; the staged artifact equals the single graph (logits within 1e-5, 32 identical
    greedy tokens), images on the first stage."""
    from conftest import staged_vlm_equals_single

    prompts = [text(3, 51) + [BOI] + text(2, 52), text(5, 53)]
    staged = staged_vlm_equals_single(engine, checkpoint, tmp_path / "staged", prompts, [[rgb(51, 60, 44)], None],
                                      stages="0:1,1:4")
    assert all(any(t.role == "lookahead" for t in g.inputs) for g in staged.manifest.graphs
               if g.name.startswith("stage"))
