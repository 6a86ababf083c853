"""Qwen2_5_VLForConditionalGeneration (issue 13): the windowed vision tower, M-RoPE positions and
the artifact end to end, against transformers on a tiny random-init model.

The tiny tower has 4 blocks with full attention at blocks 1 and 3 and windows of 2x2 merge units
(window_size 56, patch 14, merge 2), so the test images (8x10 and 6x12 patch grids) are split
into several windows, some partial; the text part has mrope_section [2, 3, 3] (head_dim 16), so
the three rotary streams rotate sections of different widths.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from conftest import MAX_SEQ_LEN, Spec, build_checkpoint, tokens_through_scheduler
from graphkiln.errors import GraphkilnError
from graphkiln.runtime import Engine, GenerationConfig
from graphkiln.runtime.request.mrope import rope_positions
from graphkiln.runtime.backends.vision_groups import patch_groups
from cli_contract import run_cli

ATOL = 1e-4
STEPS = 16
TOKEN = 300
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 50176}
SPEC = Spec(
    "qwen2_5_vl",
    "Qwen2_5_VLForConditionalGeneration",
    dict(text_config=dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          initializer_range=0.15, bos_token_id=1, eos_token_id=2,
                          rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
         vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
                            fullatt_block_indexes=[1, 3], window_size=56, patch_size=14, initializer_range=0.15),
         image_token_id=TOKEN, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303),
    seed=41,
    features=("vlm", "windowed_tower", "mrope"),
    preprocessor_config=PREPROCESSOR,
)


def greedy(n: int = STEPS, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, do_sample=False, stop_token_ids=(), **kw)


def rgb(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng([seed, height, width]).integers(0, 256, (height, width, 3), dtype=np.uint8)


def text_ids(n: int, salt: int) -> list[int]:
    ids = np.random.default_rng([SPEC.seed, salt]).integers(3, 300, n)
    return ids.tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(SPEC, tmp_path_factory.mktemp("qwen2_5_vl") / "checkpoint")


@pytest.fixture(scope="module")
def artifacts(checkpoint):
    """target -> exported artifact directory, each exported once per module."""
    from graphkiln.export.pipeline import ExportOptions, export_model

    made = {}

    def get(target: str = "onnxruntime"):
        if target not in made:
            out = checkpoint.parent / f"artifact-{target}"
            export_model(str(checkpoint), out, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN, target=target))
            made[target] = out
        return made[target]

    return get


@pytest.fixture(scope="module")
def reference(checkpoint):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(artifacts):
    return Engine.load(artifacts("onnxruntime"))


def reference_inputs(engine, ids: list[int], images) -> dict:
    """transformers' inputs for one prompt: the runtime's own pixel values (their parity with
    the processor is test_preprocessing_matches_the_processor) and the image-token types from
    which get_rope_index computes the M-RoPE positions."""
    import torch

    from graphkiln.imaging import load_image, preprocess

    if not images:
        return {}
    spec = engine.manifest.vision
    pre = preprocess([load_image(im, spec.max_image_pixels) for im in images], spec.preprocessing)
    t = torch.tensor([ids])
    return {"pixel_values": torch.from_numpy(pre.pixel_values), "image_grid_thw": torch.from_numpy(pre.image_grid_thw),
            "mm_token_type_ids": (t == TOKEN).int()}


def check_parity(engine, model, prompts, images):
    """Our logits at every prompt position and 16 greedy steps (tokens and step logits) against
    transformers, prompt by prompt; every slot free afterwards."""
    import torch

    results = engine.generate(prompts, greedy(output_logits=True), images=images)
    logits = engine.prompt_logits(prompts, images=images)
    for i, (res, ours) in enumerate(zip(results, logits)):
        ids = torch.tensor([res.prompt_ids])
        kw = reference_inputs(engine, res.prompt_ids, images[i])
        with torch.no_grad():
            ref = model(input_ids=ids, **kw).logits[0].numpy()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, min_new_tokens=STEPS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True, **kw)
        assert ours.shape == ref.shape
        assert np.abs(ours - ref).max() <= ATOL, (i, np.abs(ours - ref).max())
        assert res.token_ids == out.sequences[0, ids.shape[1]:].tolist(), i
        assert np.abs(res.logits - torch.stack(out.logits, 1)[0].numpy()).max() <= ATOL
    assert engine.pool.live == 0
    return results


# -- torch-free pieces against transformers' own functions (no export) --------------------------

@pytest.mark.parametrize("grids", [[(1, 8, 10)], [(1, 6, 12), (1, 4, 4)], [(2, 4, 6), (1, 10, 2)], [(1, 2, 2)]])
@pytest.mark.parametrize("window", [1, 2, 3])
def test_patch_groups_are_transformers_windows(grids, window):
    import torch
    from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

    merge = 2
    g = patch_groups(grids, merge, window)
    thw = torch.tensor(grids)
    np.testing.assert_array_equal(g["patch_positions"], get_vision_position_ids(thw, merge).numpy())
    index, cu = get_vision_window_index(thw, spatial_merge_size=merge, window_size=window * merge * 14, patch_size=14)
    unit = merge * merge
    patches = (index[:, None] * unit + torch.arange(unit)).reshape(-1).numpy()  # window order, as transformers
    theirs = [sorted(patches[a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    n = len(g["patch_positions"])
    ours = [sorted(int(p) for p in row if p < n) for row in g["window_groups"]]
    assert ours == theirs
    for groups, slots in ((g["window_groups"], g["window_slots"]), (g["image_groups"], g["image_slots"])):
        assert groups.reshape(-1)[slots].tolist() == list(range(n))  # each patch's way back
    sizes = [t * h * w for t, h, w in grids]
    assert [int((row < n).sum()) for row in g["image_groups"]] == sizes


def test_rope_positions_are_get_rope_index():
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

    with torch.device("meta"):
        model = Qwen2_5_VLModel(Qwen2_5_VLConfig(**SPEC.config))
    for grids, parts in (
        ([], [5]),
        ([(1, 8, 10)], [3, "img", 4]),
        ([(1, 6, 12), (1, 4, 4)], [2, "img", 3, "img", 2]),
        ([(1, 4, 8)], ["img", 5]),
        ([(1, 8, 4)], [1, "img"]),
    ):
        ids, spans, k = [], [], 0
        for part in parts:
            if part == "img":
                t, h, w = grids[k]
                spans.append((len(ids), len(ids) + t * h * w // 4))
                ids += [TOKEN] * (t * h * w // 4)
                k += 1
            else:
                ids += [7] * part
        ours, delta = rope_positions(len(ids), spans, grids, 2)
        if not grids:
            assert delta == 0 and ours.tolist() == [list(range(len(ids)))] * 3
            continue
        t = torch.tensor([ids])
        ref, ref_delta = model.get_rope_index(t, mm_token_type_ids=(t == TOKEN).int(), image_grid_thw=torch.tensor(grids))
        assert ours.tolist() == ref[:, 0].tolist(), parts
        assert delta == int(ref_delta[0, 0])


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
def test_preprocessing_matches_the_processor(mode, checkpoint):
    from transformers import AutoImageProcessor

    from graphkiln.imaging import load_image, preprocess, preprocessing_from_config

    hf = AutoImageProcessor.from_pretrained(str(checkpoint))  # the PIL backend here (no torchvision)
    spec = preprocessing_from_config(PREPROCESSOR)
    images = [Image.fromarray(rgb(i, h, w)).convert(mode) for i, (h, w) in enumerate([(112, 140), (37, 91), (20, 400)])]
    ref = hf(images=images, return_tensors="np")
    ours = preprocess([load_image(im, 1 << 26) for im in images], spec)
    np.testing.assert_allclose(ours.pixel_values, ref["pixel_values"], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(ours.image_grid_thw, ref["image_grid_thw"])


@pytest.mark.parametrize("change, needle", [
    (lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[2, 3, 4]), "summing to head_dim / 2 = 8"),
    (lambda c: c["vision_config"].update(window_size=20), "smaller than one merge unit"),
    (lambda c: c["vision_config"].update(in_channels=4), "vision_config.in_channels"),
    (lambda c: c["vision_config"].update(out_hidden_size=32), "the text hidden_size 64"),
    (lambda c: c["vision_config"].update(fullatt_block_indexes=[4]), "block indices in [0, 4)"),
    (lambda c: c["vision_config"].update(num_heads=16), "divisible by 4"),
    (lambda c: c["text_config"].update(use_sliding_window=True), "use_sliding_window"),
    (lambda c: c["text_config"]["rope_parameters"].update(rope_type="yarn"), "rope_type 'yarn'"),
    (lambda c: c.update(image_token_id="300"), "image_token_id"),
    (lambda c: c["preprocessor"].update(patch_size=16), "patch_size 16 but the vision tower's patch_size is 14"),
])
def test_config_refusals_are_one_line(change, needle):
    import copy

    from graphkiln.models.registry import family_for

    raw = copy.deepcopy(dict(SPEC.config, architectures=[SPEC.architecture], model_type="qwen2_5_vl"))
    raw["preprocessor"] = dict(PREPROCESSOR)
    change(raw)
    pre = raw.pop("preprocessor")
    family = family_for(SPEC.architecture)
    with pytest.raises(GraphkilnError) as exc:
        family.parse_config(raw)
        family.vision.parse(raw, pre)
    assert needle in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_flat_4x_config_and_both_checkpoint_layouts(checkpoint, tmp_path):
    """A 4.x hub config (text keys at the top level, rope_scaling type "mrope") parses to the same
    decoder; the in-memory tensor layout (model.language_model.*, model.visual.*) loads the same
    weights as the layout save_pretrained writes."""
    import torch
    from safetensors.torch import load_file, save_file

    from graphkiln.models.registry import family_for
    from graphkiln.models.weights import load_decoder, read_config

    family = family_for(SPEC.architecture)
    raw = read_config(checkpoint)
    text = dict(raw["text_config"])
    rope = text.pop("rope_parameters")
    flat = {k: v for k, v in raw.items() if k != "text_config"}
    flat.update(text, rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]}, rope_theta=rope["rope_theta"])
    a, b = family.parse_config(raw), family.parse_config(flat)
    assert (a.mrope_section, a.num_layers, a.hidden_size, a.rope) == (b.mrope_section, b.num_layers, b.hidden_size, b.rope)

    moved = tmp_path / "moved"
    moved.mkdir()
    for f in checkpoint.iterdir():
        if f.suffix != ".safetensors":
            (moved / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(checkpoint / "model.safetensors"))
    renamed = {("model.language_model." + k[6:] if k.startswith("model.") else "model." + k if k.startswith("visual.")
                else k): v for k, v in tensors.items()}
    assert any(k.startswith("model.visual.") for k in renamed)
    save_file(renamed, str(moved / "model.safetensors"), metadata={"format": "pt"})
    vcfg = family.vision.parse(raw, PREPROCESSOR)
    for state in (lambda d: load_decoder(d, family, a, "fp32").state_dict(),
                  lambda d: family.vision.build(d, vcfg, "fp32").state_dict()):
        x, y = state(checkpoint), state(moved)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


# -- the artifact --------------------------------------------------------------------------------

def test_manifest_and_vision_graph(artifacts):
    from graphkiln.manifest import Manifest

    manifest = Manifest.read(artifacts("onnxruntime"))
    vision = next(g for g in manifest.graphs if g.name == "vision")
    assert [t.role for t in vision.inputs] == ["pixel_values", "patch_positions", "window_groups", "window_slots",
                                               "image_groups", "image_slots"]
    assert next(t for t in vision.inputs if t.role == "window_groups").shape == ("windows", 16)
    decoder = next(g for g in manifest.graphs if g.name == "decoder")
    assert any(t.role == "rope_position_ids" for t in decoder.inputs)
    assert manifest.vision.placeholder.kind == "merged_grid" and manifest.vision.image_token_id == TOKEN
    assert manifest.vision.positions == "mrope"  # the position rule the runtime follows


def test_parity_one_image(engine, reference):
    p = text_ids(3, 1) + [TOKEN] + text_ids(5, 2)
    check_parity(engine, reference, [p], [[rgb(1, 112, 140)]])


def test_parity_two_images_of_different_sizes_in_one_prompt(engine, reference):
    p = text_ids(2, 3) + [TOKEN] + text_ids(4, 4) + [TOKEN] + text_ids(3, 5)
    check_parity(engine, reference, [p], [[rgb(2, 112, 140), rgb(3, 84, 170)]])


# onnxruntime only: the portable graph's per-token rotary is the Attention function's, checked
# against the reference in test_custom_ops (LLaVA's portable graph takes images in test_vlm_runtime)
@pytest.mark.parametrize("target", ["onnxruntime"])
def test_parity_batch_of_two_where_one_prompt_has_no_image(target, artifacts, engine, reference):
    eng = engine if target == "onnxruntime" else Engine.load(artifacts(target))
    with_image = text_ids(4, 6) + [TOKEN] + text_ids(2, 7)
    text_only = text_ids(11, 8)
    results = check_parity(eng, reference, [text_only, with_image], [None, [rgb(4, 90, 120)]])
    alone = eng.generate([with_image], greedy(), images=[[rgb(4, 90, 120)]])[0]
    assert alone.token_ids == results[1].token_ids


def test_prefill_in_two_pieces_gives_the_same_logits(engine):
    """The decoder fed the prompt in two pieces (the split inside the image) gives the logits of one
    prefill: rotary positions and seam rows are addressed per piece."""
    from graphkiln.runtime.prompt_layout import pack

    p = text_ids(3, 9) + [TOKEN] + text_ids(4, 10)
    image = rgb(5, 112, 140)
    whole = engine.prompt_logits([p], images=[[image]])[0]
    prepared, = engine.prep.prepare([p], [[image]], single=False)
    ids, loaded, positions, layout = prepared.ids, prepared.images, prepared.image_positions, prepared.layout
    rows = np.concatenate(engine.vision.encode(loaded))
    cut = int(positions[len(positions) // 2])
    engine.pool.reserve(1, len(ids))
    slot = engine.pool.claim()
    try:
        pieces = []
        for lo, hi in ((0, cut), (cut, len(ids))):
            n = hi - lo
            seam = (rows, (positions - lo).astype(np.int64))  # indices outside the piece are skipped
            extra = pack(engine.prep.layout_roles, [layout], np.array([lo]), n)
            out = engine.decoder.run(engine.pool, np.array([ids[lo:hi]]), np.arange(lo, hi)[None],
                                     np.arange(n)[None].astype(np.int64), np.array([n]), vision=seam, extra=extra)
            pieces.append(out[0].copy())
    finally:
        engine.pool.release(slot)
    assert np.abs(np.concatenate(pieces) - whole).max() <= 1e-5


def test_a_repeated_image_hits_the_cache(artifacts):
    eng = Engine.load(artifacts("onnxruntime"), check_files=False)
    image = rgb(6, 84, 170)
    prompt = text_ids(3, 11) + [TOKEN] + text_ids(2, 12)
    first = eng.generate([prompt], greedy(), images=[[image]])[0]
    assert eng.vision.runs == 1
    again = eng.generate([prompt], greedy(), images=[[Image.fromarray(image)]])[0]
    assert again.token_ids == first.token_ids
    assert eng.vision.runs == 1 and eng.vision.cache.hits == 1


def test_cli_verify_passes(artifacts, checkpoint, capsys):
    code, out, err = run_cli(capsys, "verify", artifacts("onnxruntime"), "--reference", checkpoint, "--steps", 4)
    assert code == 0 and "PASS" in out, (out, err)
    assert "with images: 1 image, 2 images" in out and "skipped" not in out


def test_images_through_the_scheduler_in_chunks_equal_each_request_alone(artifacts, engine):
    """Continuous batching with a step budget smaller than an image: M-RoPE positions and image
    rows are fed chunk by chunk (rotary positions from the request's layout, not the cache
    positions), decode steps continue from rope_delta, and every request's greedy tokens equal
    the request run alone."""
    prompts = [text_ids(3, 41) + [TOKEN] + text_ids(4, 42), text_ids(7, 43),
               [TOKEN] + text_ids(2, 44) + [TOKEN] + text_ids(1, 45)]
    images = [[rgb(21, 112, 140)], None, [rgb(22, 84, 84), rgb(23, 56, 112)]]
    alone = [engine.generate([p], greedy(), images=[im])[0].token_ids for p, im in zip(prompts, images)]
    step_tokens = 5
    assert min(engine.vision.load(im).tokens for im in images[0] + images[2]) > step_tokens

    assert tokens_through_scheduler(artifacts("onnxruntime"), prompts, images, greedy(), step_tokens) == alone


def test_pipeline_stages_carry_the_mrope_positions(engine, checkpoint, tmp_path):
    """export --stages 2: every stage takes rope_position_ids; the staged artifact equals the
    single graph (logits within 1e-5, 32 identical greedy tokens), images on the first stage."""
    from conftest import staged_vlm_equals_single

    prompts = [text_ids(3, 41) + [TOKEN] + text_ids(4, 42), text_ids(6, 43)]
    staged = staged_vlm_equals_single(engine, checkpoint, tmp_path / "staged", prompts, [[rgb(41, 56, 84)], None])
    assert all(any(t.role == "rope_position_ids" for t in g.inputs) for g in staged.manifest.graphs
               if g.name.startswith("stage"))
