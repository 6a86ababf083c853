"""Vision-language runtime (issue 13): placeholder expansion, the image embedding cache, the
Engine's ``images=`` API, ``run --image``, ``verify`` and ``inspect`` on a VLM artifact.

Parity is against transformers' ``LlavaForConditionalGeneration`` fed the very pixel values the
runtime computed (``imaging.preprocess``; the preprocessing itself is checked against
transformers' processors in tests/test_imaging.py): fp32 logits within 1e-4 at every prompt
position and greedy tokens identical over 16 steps.
"""

from __future__ import annotations

import io
import json
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from graphkiln.errors import GraphkilnError
from graphkiln.runtime import Engine, GenerationConfig
from graphkiln.runtime.backends.vision import EmbeddingCache, check_placeholder_count, expand_placeholders
from cli_contract import assert_one_error, run_cli
from conftest import tokens_through_scheduler

ATOL = 1e-4
STEPS = 16
VLM_CASES = ("llava_clip", "llava_siglip")


def greedy(n: int = STEPS, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, do_sample=False, stop_token_ids=(), **kw)


def rgb(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng([seed, height, width]).integers(0, 256, (height, width, 3), dtype=np.uint8)


def png_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and text, text
    return text


# -- placeholder expansion and the cache (no artifact) -------------------------------------------

def test_expand_placeholders_puts_each_images_rows_at_its_token():
    ids, pos = expand_placeholders([5, 9, 6, 9, 7], 9, [3, 2])
    assert ids == [5, 9, 9, 9, 6, 9, 9, 7]
    assert pos.dtype == np.int64 and pos.tolist() == [1, 2, 3, 5, 6]
    ids, pos = expand_placeholders([9, 9], 9, [1, 2])
    assert ids == [9, 9, 9] and pos.tolist() == [0, 1, 2]
    ids, pos = expand_placeholders([1, 2, 3], 9, [])
    assert ids == [1, 2, 3] and pos.shape == (0,)


@pytest.mark.parametrize("ids, images, needle", [
    ([5, 9, 9], 1, "prompt 3 has 2 <image> placeholders but 1 image"),
    ([5, 9], 2, "prompt 3 has 1 <image> placeholder but 2 images"),
    ([5, 6], 1, "prompt 3 has no <image> placeholder but 1 image"),
    ([9], 0, "prompt 3 has 1 <image> placeholder but no image"),
])
def test_placeholder_count_mismatch_is_one_line(ids, images, needle):
    for call in (lambda: check_placeholder_count(ids, 9, images, prompt=3),
                 lambda: expand_placeholders(ids, 9, [4] * images, prompt=3)):
        with pytest.raises(GraphkilnError) as exc:
            call()
        assert one_line(exc).startswith(needle), str(exc.value)


def test_cache_is_lru_bounded_in_bytes_and_counts_hits():
    row = lambda v: np.full((4, 8), v, np.float32)  # 128 bytes each
    cache = EmbeddingCache(300)
    cache.put("a", row(1))
    cache.put("b", row(2))
    assert cache.bytes == 256 and len(cache) == 2
    assert cache.get("a")[0, 0] == 1  # a is now the most recently used
    cache.put("c", row(3))  # over 300 bytes: the least recently used (b) goes
    assert "b" not in cache and "a" in cache and "c" in cache and cache.bytes == 256
    assert cache.get("b") is None
    assert (cache.hits, cache.misses) == (1, 1)
    cache.put("huge", np.zeros((100, 8), np.float32))  # larger than the whole bound: not kept
    assert "huge" not in cache and cache.bytes == 256
    cache.put("a", row(5))  # replaced, not counted twice
    assert cache.bytes == 256 and cache.get("a")[0, 0] == 5
    with pytest.raises(ValueError):
        cache.get("a")[0, 0] = 7  # shared between requests: read-only
    off = EmbeddingCache(0)
    off.put("a", row(1))
    assert len(off) == 0 and off.get("a") is None
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(GraphkilnError):
            EmbeddingCache(bad)


def test_images_for_a_text_only_artifact_are_refused_and_nothing_is_held(llama_case):
    engine = llama_case.engine
    with pytest.raises(GraphkilnError) as exc:
        engine.generate([[5, 6, 7]], greedy(2), images=[[rgb(0, 8, 8)]])
    assert "text-only" in one_line(exc)
    with pytest.raises(GraphkilnError):
        engine.prompt_logits([[5, 6, 7]], images=[[rgb(0, 8, 8)]])
    with pytest.raises(GraphkilnError):
        next(iter(engine.stream([5, 6, 7], greedy(2), images=rgb(0, 8, 8))))
    assert engine.pool.live == 0
    # no images (None, or None per prompt) is fine on a text-only artifact
    assert engine.generate([[5, 6, 7]], greedy(2), images=[None])[0].token_ids == \
        engine.generate([[5, 6, 7]], greedy(2))[0].token_ids


# -- the VLM artifacts --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def references():
    """LlavaForConditionalGeneration per case name, loaded once per module."""
    loaded = {}

    def get(case):
        if case.spec.name not in loaded:
            import torch
            from transformers import LlavaForConditionalGeneration

            loaded[case.spec.name] = LlavaForConditionalGeneration.from_pretrained(
                str(case.checkpoint), dtype=torch.float32).eval()
        return loaded[case.spec.name]

    return get


@pytest.fixture(params=VLM_CASES)
def vlm(request, tiny):
    return tiny(request.param, "onnxruntime")


@pytest.fixture
def clip(tiny):
    return tiny("llava_clip", "onnxruntime")


def token(case) -> int:
    return case.manifest.vision.image_token_id


def text_ids(case, n: int, salt: int) -> list[int]:
    """Random token ids that are not the image token."""
    ids = np.random.default_rng([case.spec.seed, salt]).integers(3, case.vocab_size, n)
    ids[ids == token(case)] = 4
    return ids.tolist()


def pixels(case, images):
    import torch

    from graphkiln.imaging import load_image, preprocess

    spec = case.manifest.vision
    pv = preprocess([load_image(im, spec.max_image_pixels) for im in images], spec.preprocessing).pixel_values
    return {"pixel_values": torch.from_numpy(pv)} if images else {}


def check_parity(case, model, prompts, images):
    """Our logits at every prompt position and 16 greedy steps against transformers, per prompt."""
    import torch

    engine = case.engine
    results = engine.generate(prompts, greedy(output_logits=True), images=images)
    logits = engine.prompt_logits(prompts, images=images)
    for i, (res, ours) in enumerate(zip(results, logits)):
        imgs = images[i] or []
        n = sum(engine.vision.load(im).tokens for im in imgs)
        assert len(res.prompt_ids) == len(prompts[i]) + n - len(imgs)  # each image token became n rows
        assert res.prompt_ids.count(token(case)) == n
        ids = torch.tensor([res.prompt_ids])
        with torch.no_grad():
            ref = model(input_ids=ids, **pixels(case, imgs)).logits[0].numpy()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, min_new_tokens=STEPS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True, **pixels(case, imgs))
        assert ours.shape == ref.shape
        assert np.abs(ours - ref).max() <= ATOL, (i, np.abs(ours - ref).max())
        assert res.token_ids == out.sequences[0, ids.shape[1]:].tolist(), i
        ref_steps = torch.stack(out.logits, 1)[0].numpy()
        assert np.abs(res.logits - ref_steps).max() <= ATOL
    assert engine.pool.live == 0
    return results


def test_parity_one_image(vlm, references):
    p = text_ids(vlm, 3, 1) + [token(vlm)] + text_ids(vlm, 5, 2)
    check_parity(vlm, references(vlm), [p], [[rgb(1, 45, 60)]])


def test_parity_two_images_of_different_sizes_in_one_prompt(vlm, references):
    t = token(vlm)
    p = text_ids(vlm, 2, 3) + [t] + text_ids(vlm, 4, 4) + [t] + text_ids(vlm, 3, 5)
    small, wide = rgb(2, 24, 30), rgb(3, 50, 97)
    check_parity(vlm, references(vlm), [p], [[small, wide]])
    # the order of the images is the order of the placeholders
    a = vlm.engine.prompt_logits([p], images=[[small, wide]])[0]
    b = vlm.engine.prompt_logits([p], images=[[wide, small]])[0]
    assert np.abs(a - b).max() > 1e-3


def test_parity_batch_of_two_where_one_prompt_has_no_image(vlm, references):
    t = token(vlm)
    with_image = text_ids(vlm, 4, 6) + [t] + text_ids(vlm, 2, 7)
    text_only = text_ids(vlm, 11, 8)
    results = check_parity(vlm, references(vlm), [text_only, with_image], [None, [rgb(4, 33, 40)]])
    # each row alone gives the same tokens as in the batch (the seam indices address the right row)
    alone = vlm.engine.generate([with_image], greedy(), images=[[rgb(4, 33, 40)]])[0]
    assert alone.token_ids == results[1].token_ids


def test_the_portable_graph_takes_images_too(tiny, references):
    """The portable decoder returns its KV rows (the runtime stores them) instead of writing them in
    place: the same seam, another state contract."""
    case = tiny("llava_clip", "portable")
    t = token(case)
    prompts = [text_ids(case, 2, 12) + [t] + text_ids(case, 3, 13) + [t], text_ids(case, 6, 14)]
    check_parity(case, references(case), prompts, [[rgb(17, 36, 36), rgb(18, 20, 64)], None])


def test_a_repeated_image_hits_the_cache_and_gives_the_same_tokens(clip, tmp_path):
    engine = Engine.load(clip.artifact)
    t = token(clip)
    image = rgb(5, 40, 52)
    prompt = text_ids(clip, 3, 9) + [t] + text_ids(clip, 3, 10)
    first = engine.generate([prompt], greedy(), images=[[image]])[0]
    runs, misses = engine.vision.runs, engine.vision.cache.misses
    assert runs == 1 and engine.vision.cache.hits == 0
    # the same pixels as an array, PNG bytes, a file and a PIL image: one cache entry
    path = tmp_path / "same.png"
    path.write_bytes(png_bytes(image))
    for form in (image, png_bytes(image), path, str(path), Image.fromarray(image)):
        again = engine.generate([prompt], greedy(), images=[[form]])[0]
        assert again.token_ids == first.token_ids
    assert engine.vision.runs == runs  # the vision graph did not run again
    assert engine.vision.cache.misses == misses and engine.vision.cache.hits == 5
    # one image twice in one request: encoded once
    other = rgb(6, 40, 52)
    two = text_ids(clip, 2, 11) + [t, t]
    engine.generate([two], greedy(2), images=[[other, other]])
    assert engine.vision.runs == runs + 1 and engine.vision.images_encoded == 2


def test_cache_bound_is_configurable(clip):
    per_image = clip.engine.vision.load(rgb(7, 32, 32)).tokens * clip.manifest.model.hidden_size * 4
    engine = Engine.load(clip.artifact, check_files=False, vision_cache_bytes=per_image)  # room for one image
    t = token(clip)
    a, b = rgb(7, 32, 32), rgb(8, 32, 32)
    for image in (a, b, a):  # b evicts a
        engine.generate([[5, t]], greedy(1), images=[[image]])
    assert engine.vision.runs == 3 and engine.vision.cache.bytes == per_image
    engine.generate([[5, t]], greedy(1), images=[[a]])
    assert engine.vision.runs == 3
    off = Engine.load(clip.artifact, check_files=False, vision_cache_bytes=0)
    for _ in range(2):
        off.generate([[5, t]], greedy(1), images=[[a]])
    assert off.vision.runs == 2
    with pytest.raises(GraphkilnError):
        Engine.load(clip.artifact, check_files=False, vision_cache_bytes=-1)


def test_image_forms_of_the_api(clip):
    """images= per prompt (a list, one image or None); a single prompt also takes its images directly."""
    engine, t = clip.engine, token(clip)
    img = rgb(9, 30, 30)
    p = [5, t, 6]
    want = engine.generate([p], greedy(3), images=[[img]])[0].token_ids
    assert engine.generate(p, greedy(3), images=[img])[0].token_ids == want
    assert engine.generate(p, greedy(3), images=img)[0].token_ids == want
    assert engine.generate([p], greedy(3), images=[img])[0].token_ids == want
    assert engine.generate(np.array(p), greedy(3), images=(img,))[0].token_ids == want
    streamed = [ev.token_id for ev in engine.stream(p, greedy(3), images=[img])]
    assert streamed == want


def tiny_png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (its data is one row): refused from the header."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 7)) + chunk(b"IEND", b"")


def test_refusals_are_one_line_and_leave_every_slot_free(clip, tmp_path):
    engine, t = clip.engine, token(clip)
    good = rgb(10, 30, 30)
    not_image = tmp_path / "notes.png"
    not_image.write_text("not an image at all\n")
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(png_bytes(rgb(11, 64, 64))[:300])
    runs = engine.vision.runs
    cases = [
        ([[5, t, 6, t]], [[good]], "prompt 0 has 2 image token"),  # more placeholders than images
        ([[5, t, 6]], [[good, good]], "prompt 0 has 1 image token"),  # more images than placeholders
        ([[5, 6], [5, t]], [[good], [good]], "prompt 0 has no image token"),
        ([[5, 6], [5, t]], [None, None], "prompt 1 has 1 image token"),  # a placeholder without an image
        ([[5, t]], [[not_image]], "not an image"),
        ([[5, t]], [[truncated]], "truncated or corrupt"),
        ([[5, t]], [[tmp_path / "missing.png"]], "does not exist"),
        ([[5, t]], [[tiny_png_claiming(10000, 9000)]], "more than the limit of"),  # before decoding
        ([[5, t]], [[tiny_png_claiming(30000, 30000)]], "too large to decode"),  # Pillow's bomb guard
        ([[5, t]], [[np.zeros((8, 8, 3), np.float32)]], "must be uint8"),
        ([[5, t]], [[[1, 2, 3]]], "must be a file path"),
        ([[5, t], [6, t]], [[good]], "images has 1 entry but there are 2 prompts"),
        ([[5, t], [6, t]], good, "one image but there are 2 prompts"),
        ([[5, t]], [7], "images of prompt 0 must be a list"),
        ([list(range(3, 120)) + [t]], [[good]], "maximum sequence length"),  # 118 + 16 > 128 once expanded
    ]
    for prompts, images, needle in cases:
        for call in (lambda: engine.generate(prompts, greedy(2), images=images),
                     lambda: list(engine.stream(prompts, greedy(2), images=images)),
                     lambda: engine.prompt_logits(prompts, images=images)):
            with pytest.raises(GraphkilnError) as exc:
                call()
            assert needle in one_line(exc), (needle, str(exc.value))
            assert engine.pool.live == 0
    assert engine.vision.runs == runs  # nothing was encoded for a refused request
    # and the engine still works
    assert len(engine.generate([[5, t]], greedy(2), images=[[good]])[0].token_ids) == 2


def test_budget_counts_the_expanded_prompt(clip):
    engine, t = clip.engine, token(clip)
    n = engine.vision.load(rgb(12, 32, 32)).tokens
    prompt = list(range(3, 3 + 100)) + [t]  # 101 ids, 100 + n once expanded
    res = engine.generate([prompt], greedy(100), images=[[rgb(12, 32, 32)]])[0]
    assert len(res.prompt_ids) == 100 + n
    assert len(res.token_ids) == engine.max_seq_len - (100 + n) and res.finish_reason == "length"


def test_text_prompts_expand_the_image_token_text(clip, checkpoint_copy, tmp_path):
    """With a tokenizer holding <image>, a text prompt expands as LlavaProcessor does it:
    "<image>" becomes num_tokens copies before tokenizing, i.e. the same ids."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from graphkiln.export.pipeline import ExportOptions, export_model

    t = token(clip)
    ckpt = checkpoint_copy(clip)
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(3, 40)}, "<image>": t}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    tok.save(str(ckpt / "tokenizer.json"))
    art = tmp_path / "with-tokenizer"
    export_model(str(ckpt), art, ExportOptions(progress=False, max_seq_len=128, target="onnxruntime"))
    engine = Engine.load(art)
    assert engine.image_token_text == "<image>"
    img, n = rgb(13, 30, 40), engine.vision.load(rgb(13, 30, 40)).tokens
    text = "w5 w6 <image> w7 w8"
    res = engine.generate(text, greedy(), images=[img])[0]
    assert res.prompt_ids == tok.encode(text.replace("<image>", "<image>" * n)).ids
    assert res.token_ids == engine.generate([[5, 6, t, 7, 8]], greedy(), images=[[img]])[0].token_ids
    with pytest.raises(GraphkilnError) as exc:
        engine.generate("w5 <image> <image>", greedy(2), images=[img])
    assert one_line(exc).startswith("prompt 0 has 2 <image> placeholders but 1 image")
    assert engine.pool.live == 0


# -- CLI ------------------------------------------------------------------------------------------

def test_cli_run_image_end_to_end(clip, tmp_path, capsys):
    t = token(clip)
    a, b = tmp_path / "a.png", tmp_path / "b.jpg"
    a.write_bytes(png_bytes(rgb(14, 40, 30)))
    Image.fromarray(rgb(15, 28, 50)).save(b, quality=95)
    ids = [5, t, 6, 7, t, 8]
    code, out, err = run_cli(capsys, "run", clip.artifact, "--prompt-ids", ",".join(map(str, ids)), "--image", a,
                             "--image", b, "--max-new-tokens", 6, "--ignore-eos")
    assert code == 0, err
    want = clip.engine.generate([ids], greedy(6), images=[[a, b]])[0].token_ids
    assert out.split() == [str(x) for x in want]
    code, out, err = run_cli(capsys, "run", clip.artifact, "--prompt-ids", ",".join(map(str, ids)), "--image", a,
                             "--image", b, "--max-new-tokens", 6, "--ignore-eos", "--stream")
    assert code == 0 and out.split() == [str(x) for x in want]
    # refusals: one line each
    assert_one_error(*run_cli(capsys, "run", clip.artifact, "--prompt-ids", f"5,{t}", "--prompt-ids", f"6,{t}",
                              "--image", a)[::2], "--image goes with one prompt")
    assert_one_error(*run_cli(capsys, "run", clip.artifact, "--prompt-ids", f"5,{t},{t}", "--image", a)[::2],
                     "2 image token", "but 1 image")
    assert_one_error(*run_cli(capsys, "run", clip.artifact, "--prompt-ids", f"5,{t}", "--image",
                              tmp_path / "none.png")[::2], "does not exist")


def test_cli_run_image_on_a_text_only_artifact(llama_case, tmp_path, capsys):
    a = tmp_path / "a.png"
    a.write_bytes(png_bytes(rgb(16, 20, 20)))
    assert_one_error(*run_cli(capsys, "run", llama_case.artifact, "--prompt-ids", "5,6", "--image", a)[::2],
                     "text-only")


def test_cli_verify_covers_the_vision_path(clip, capsys):
    code, out, err = run_cli(capsys, "verify", clip.artifact, "--reference", clip.checkpoint, "--steps", 4)
    assert code == 0, (out, err)
    assert "with images: 1 image, 2 images" in out and "batch of 2, one without an image" in out
    assert "PASS" in out and "skipped" not in out


def test_verify_skips_vision_cases_that_do_not_fit(clip):
    from graphkiln.export.verify import VerifyReport, _vision_cases

    ids = lambda n: [5] * n
    # 24 tokens: one 16-token image and 7 text tokens fit (alone, and in the batch); two images do not
    cases = {label: prompts for label, prompts, _ in _vision_cases(clip.engine, 24, ids, 0)}
    assert [isinstance(p, str) for p in cases.values()] == [False, True, False]
    skipped = next(f"{label} ({why})" for label, why in cases.items() if isinstance(why, str))
    assert "39 tokens with the images expanded, more than the 24 that fit" in skipped
    report = VerifyReport(batch_shapes=((4,),), steps=4, max_abs_error=0.0, max_rel_error=0.0, tokens_compared=4,
                          tokens_agreed=4, atol=1e-4, min_agreement=1.0, vision_checked=("1 image",),
                          vision_skipped=(skipped,))
    assert report.passed and "with images: 1 image (max abs error 0); skipped 2 images" in report.summary()


def test_inspect_shows_both_graphs_and_the_vision_spec(clip, capsys):
    code, out, err = run_cli(capsys, "inspect", clip.artifact)
    assert code == 0, err
    assert "graph        decoder:" in out and "graph        vision: vision.onnx" in out
    assert "vision_scatter_indices" in out and "pixel_values" in out and "image_embeddings" in out
    vision = next(line for line in out.splitlines() if line.startswith("vision "))
    assert f"image token {token(clip)}" in vision and "16 tokens per 32x32 image" in vision and "positions 1d" in vision
    assert "preprocess clip: resize to shortest edge 32 (bicubic), center crop 32x32" in out
    assert json.loads(run_cli(capsys, "inspect", clip.artifact, "--json")[1])["vision"]["image_token_id"] == token(clip)


@pytest.mark.parametrize("kwargs", [dict(device="cuda"), dict(backend="tensorrt")])
def test_gpu_backends_refuse_a_vision_language_artifact(tiny, kwargs):
    """The GPU runners bind no vision seam yet: one line, before anything is opened."""
    case = tiny("llava_clip", "onnxruntime")
    with pytest.raises(GraphkilnError, match="vision-language artifacts run on onnxruntime on the CPU only"):
        Engine.load(case.artifact, **kwargs)


def test_images_through_the_scheduler_in_chunks_equal_each_request_alone(clip):
    """Continuous batching with a step budget smaller than an image's rows: each image is
    prefilled across several chunks (the seam skips the rows outside each chunk) while other
    requests decode, and every request's greedy tokens equal the request run alone."""
    t = token(clip)
    prompts = [text_ids(clip, 3, 21) + [t] + text_ids(clip, 4, 22), text_ids(clip, 6, 23),
               [t] + text_ids(clip, 2, 24) + [t]]
    images = [[rgb(7, 45, 60)], None, [rgb(8, 40, 52), rgb(9, 60, 45)]]
    alone_engine = Engine.load(clip.artifact)
    alone = [alone_engine.generate([p], greedy(), images=[im])[0].token_ids for p, im in zip(prompts, images)]
    step_tokens = 4
    assert min(alone_engine.vision.load(im).tokens for im in images[0] + images[2]) > step_tokens

    assert tokens_through_scheduler(clip.artifact, prompts, images, greedy(), step_tokens) == alone


def test_pipeline_stages_take_images_through_the_first_stage(clip, tmp_path):
    """export --stages 2 of a VLM: the vision graph and the seam belong to stage 0; the staged
    artifact equals the single graph (logits within 1e-5, 32 identical greedy tokens) on a batch
    where one prompt has two images and the other none."""
    from conftest import staged_vlm_equals_single

    t = token(clip)
    prompts = [text_ids(clip, 3, 31) + [t] + text_ids(clip, 2, 32) + [t], text_ids(clip, 7, 33)]
    staged_vlm_equals_single(clip.engine, clip.checkpoint, tmp_path / "staged", prompts,
                             [[rgb(31, 40, 52), rgb(32, 30, 30)], None])
