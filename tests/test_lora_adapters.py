"""LoRA adapters at run time (graphkiln.runtime.lora): PEFT directories read exactly, hostile ones
refused with one line each, and the slot pool's LRU / reference counting / fixed arrays.

Adapters are real PEFT output: random LoRA weights (init_lora_weights=False, so B is non-zero) on
a tiny random LlamaForCausalLM whose projections all have different shapes (q 32->32, k/v 32->16,
gate/up 32->48, down 48->32), so a transposed or misrouted tensor cannot pass. The reference is
PEFT's own ``get_delta_weight`` ([out, in]) for every wrapped module: ``(A @ B).T`` must equal it.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
from safetensors.numpy import load_file, save_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from graphkiln.errors import GraphkilnError  # noqa: E402
from graphkiln.runtime.lora import MODULES, AdapterPool, LoraTarget, read_peft_adapter  # noqa: E402

# peft calls a transformers API that transformers 5 deprecates: noise, not something under test
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

RANK = 8  # the "artifact's" --lora-rank: above the adapters' r=4, so padding is exercised
SHAPES = {"q_proj": (32, 32), "k_proj": (32, 16), "v_proj": (32, 16), "o_proj": (32, 32),
          "gate_proj": (32, 48), "up_proj": (32, 48), "down_proj": (48, 32)}
LAYERS = 2
TARGETS = [LoraTarget(layer, m, *SHAPES[m]) for layer in range(LAYERS) for m in MODULES]


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def make_adapter(base, out: Path, seed: int = 1, dtype=None, **lora):
    """Save a random PEFT LoRA of ``base`` to ``out``; returns {module path: PEFT delta [out, in]} and
    the PEFT model."""
    torch.manual_seed(seed)
    settings = dict(r=4, lora_alpha=8, target_modules=list(MODULES), init_lora_weights=False)
    settings.update(lora)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**settings))
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(out)
    deltas = {name.removeprefix("base_model.model."): module.get_delta_weight("default").detach().float().numpy()
              for name, module in model.named_modules() if isinstance(module, peft.tuners.lora.Linear)}
    assert deltas, "PEFT wrapped nothing"
    return deltas, model


def key_of(module_path: str) -> tuple[int, str]:
    parts = module_path.split(".")  # model.layers.<i>.<self_attn|mlp>.<proj>
    return int(parts[2]), parts[4]


@pytest.fixture(scope="module")
def plain(base, tmp_path_factory):
    """An r=4, alpha=8 adapter on every projection: the starting point of the hostile variants."""
    out = tmp_path_factory.mktemp("plain") / "adapter"
    deltas, _ = make_adapter(base, out)
    return out, deltas


@pytest.fixture(scope="module")
def others(base, tmp_path_factory):
    """Three more adapters (different seeds) for the pool tests."""
    root = tmp_path_factory.mktemp("others")
    dirs = []
    for seed in (2, 3, 4):
        make_adapter(base, root / f"a{seed}", seed=seed)
        dirs.append(root / f"a{seed}")
    return dirs


# ---------------------------------------------------------------------------------------------
# read_peft_adapter: exact against PEFT


def test_peft_writes_the_names_graphkiln_reads(plain):
    names = set(load_file(plain[0] / "adapter_model.safetensors"))
    want = {f"base_model.model.model.layers.{layer}.{'self_attn' if m in MODULES[:4] else 'mlp'}.{m}.lora_{ab}.weight"
            for layer in range(LAYERS) for m in MODULES for ab in "AB"}
    assert names == want


CASES = {
    "plain": dict(),
    "rslora": dict(use_rslora=True),
    "full_rank": dict(r=RANK, lora_alpha=5),
    "patterns": dict(rank_pattern={"v_proj": 2, "model.layers.1.mlp.down_proj": 8},
                     alpha_pattern={"layers.1.self_attn.q_proj": 3, "gate_proj": 1.5}),
    "layers_to_transform": dict(target_modules=["q_proj", "v_proj", "up_proj"], layers_to_transform=[1]),
}


@pytest.mark.parametrize("case", CASES)
def test_delta_matches_peft(base, tmp_path, case):
    deltas, model = make_adapter(base, tmp_path / "a", **CASES[case])
    got = read_peft_adapter(tmp_path / "a", TARGETS, RANK, LAYERS)
    assert set(got) == {key_of(p) for p in deltas}  # untouched targets absent (zero), touched all present
    for path, delta in deltas.items():
        a, b = got[key_of(path)]
        target = next(t for t in TARGETS if t.key == key_of(path))
        assert a.dtype == b.dtype == np.float32 and a.flags.c_contiguous and b.flags.c_contiguous
        assert a.shape == (target.in_features, RANK) and b.shape == (RANK, target.out_features)
        np.testing.assert_allclose((a @ b).T, delta, rtol=0, atol=1e-6, err_msg=path)
        assert np.abs(delta).max() > 1e-2  # B really is non-zero: the comparison means something
        r = model.base_model.model.get_submodule(path).r["default"]
        assert not a[:, r:].any() and not b[r:, :].any()  # rank padding is exact zeros
        assert np.abs(a[:, :r]).min(axis=0).max() > 0 and np.abs(b[:r]).max(axis=1).min() > 0
    if case == "layers_to_transform":
        assert {k[0] for k in got} == {1}
    if case == "patterns":
        assert model.base_model.model.get_submodule("model.layers.0.self_attn.v_proj").r["default"] == 2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_adapters_widen_exactly(base, tmp_path, dtype):
    """safetensors.numpy cannot even load bfloat16 (numpy has no such dtype): the reader widens it."""
    _, model = make_adapter(base, tmp_path / "a", dtype=getattr(torch, dtype), use_rslora=True)
    got = read_peft_adapter(tmp_path / "a", TARGETS, RANK, LAYERS)
    for name, module in model.named_modules():
        if isinstance(module, peft.tuners.lora.Linear):
            a, b = got[key_of(name.removeprefix("base_model.model."))]
            np.testing.assert_array_equal(a[:, :4], module.lora_A["default"].weight.detach().float().numpy().T)
            want = module.lora_B["default"].weight.detach().float().numpy().T * (8 / 2)  # alpha / sqrt(r)
            np.testing.assert_allclose(b[:4], want, rtol=1e-7, atol=0)


# ---------------------------------------------------------------------------------------------
# read_peft_adapter: refusals, one line each, naming the cause


def edit_config(d: Path, **changes):
    config = json.loads((d / "adapter_config.json").read_text())
    config.update(changes)
    (d / "adapter_config.json").write_text(json.dumps(config))


def edit_tensors(d: Path, change):
    tensors = load_file(d / "adapter_model.safetensors")
    change(tensors)
    save_file(tensors, d / "adapter_model.safetensors")


Q0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_"


def set_tensor(name, value):
    return lambda d: edit_tensors(d, lambda t: t.__setitem__(name, value))


def drop_tensor(name):
    return lambda d: edit_tensors(d, lambda t: t.pop(name))


def write(name, data: bytes):
    return lambda d: (d / name).write_bytes(data)


def nan_a(t):
    t[Q0 + "A.weight"] = t[Q0 + "A.weight"].copy()
    t[Q0 + "A.weight"][1, 2] = np.nan


def duplicate_header_key(d: Path):
    blob = (d / "adapter_model.safetensors").read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    first = next(k for k in header if k != "__metadata__")
    text = json.dumps(header)[:-1] + ", " + json.dumps(first) + ": " + json.dumps(header[first]) + "}"
    text = text.encode().ljust(n + 80 - (n + 80) % 8)  # fits: re-place the data after the longer header
    (d / "adapter_model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + blob[8 + n:])


def write_header(d: Path, header: bytes):
    """adapter_model.safetensors holding ``header`` (padded to 8 bytes) and no data."""
    header = header.ljust(-(-len(header) // 8) * 8)
    (d / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)


def sparse_header(n: int):
    """A safetensors file declaring an ``n``-byte header that is all there (a sparse file: costs no disk)."""
    def change(d: Path):
        with open(d / "adapter_model.safetensors", "wb") as f:
            f.write(n.to_bytes(8, "little") + b"{")
            f.truncate(8 + n)
    return change


def pickle_only(d: Path):
    (d / "adapter_model.safetensors").unlink()
    # loading this pickle would create the sentinel file: the test checks it was never unpickled
    (d / "adapter_model.bin").write_bytes(pickle.dumps(_Opener(str(d / "UNPICKLED"))))


class _Opener:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def dir_as_config(d: Path):
    (d / "adapter_config.json").unlink()
    (d / "adapter_config.json").mkdir()


# id: (change to a copy of the plain adapter, read_peft_adapter overrides, words the message must hold)
REFUSALS = {
    "missing_directory": (lambda d: shutil.rmtree(d), {}, ["not a directory"]),
    "missing_config": (lambda d: (d / "adapter_config.json").unlink(), {}, ["adapter_config.json' does not exist"]),
    "unreadable_config": (dir_as_config, {}, ["adapter_config.json' is a directory"]),
    "config_not_json": (write("adapter_config.json", b"{'r': 4"), {}, ["not valid JSON"]),
    "config_not_utf8": (write("adapter_config.json", b'{"r": "\xff"}'), {}, ["not UTF-8"]),
    "config_not_object": (write("adapter_config.json", b"[1, 2]"), {}, ["JSON list, not an object"]),
    "not_lora": (lambda d: edit_config(d, peft_type="LOHA"), {}, ["peft_type is 'LOHA'", "only LoRA"]),
    "pickle_only": (pickle_only, {}, ["pickle", "'adapter_model.bin'", "never loads", "safetensors"]),
    "no_weights": (lambda d: (d / "adapter_model.safetensors").unlink(), {}, ["no adapter_model.safetensors"]),
    "fan_in_fan_out": (lambda d: edit_config(d, fan_in_fan_out=True), {}, ["fan_in_fan_out is set", "Conv1D"]),
    "dora": (lambda d: edit_config(d, use_dora=True), {}, ["use_dora is set", "DoRA"]),
    "bias": (lambda d: edit_config(d, bias="all"), {}, ["bias is 'all'", "bias='none'"]),
    "lora_bias": (lambda d: edit_config(d, lora_bias=True), {}, ["lora_bias is set"]),
    "modules_to_save": (lambda d: edit_config(d, modules_to_save=["lm_head"]), {}, ["modules_to_save"]),
    "trainable_tokens": (lambda d: edit_config(d, trainable_token_indices=[3, 4]), {}, ["trainable_token_indices"]),
    "pissa": (lambda d: edit_config(d, init_lora_weights="pissa"), {}, ["'pissa'", "rewrites the base weights"]),
    "unknown_option": (lambda d: edit_config(d, use_magic=True), {}, ["'use_magic'", "does not know"]),
    "config_too_large": (write("adapter_config.json", b" " * (2 << 20) + b"{}"), {},
                         ["adapter_config.json' is 2,097,154 bytes, more than the 1,048,576 allowed"]),
    "scaled_overflow": (lambda d: edit_config(d, lora_alpha=1e300), {}, ["overflows float32 once scaled"]),
    "r_not_int": (lambda d: edit_config(d, r="4"), {}, ["r is '4'", "positive integer"]),
    "alpha_nan": (write("adapter_config.json", b'{"peft_type": "LORA", "r": 4, "lora_alpha": NaN}'), {},
                  ["lora_alpha is nan", "finite"]),
    "rank_above": (lambda d: None, {"rank": 2}, ["adapter rank 4", "LoRA rank 2", "--lora-rank 4"]),
    "rank_pattern_above": (lambda d: edit_config(d, rank_pattern={"q_proj": 16}), {}, ["--lora-rank 16"]),
    "regex_pattern": (lambda d: edit_config(d, rank_pattern={".*q_proj": 2}), {},
                      ["rank_pattern key '.*q_proj'", "regular expression"]),
    "module_not_exported": (lambda d: None, {"targets": [t for t in TARGETS if t.module != "v_proj"]},
                            ["changes layer 0 v_proj", "no LoRA inputs",
                             "q_proj, k_proj, o_proj, gate_proj, up_proj, down_proj",
                             "--lora-targets q,k,v,o,gate,up,down"]),
    "layer_out_of_range": (lambda d: None, {"targets": [t for t in TARGETS if t.layer == 0], "num_layers": 1},
                           ["for layer 1", "model has 1 layer(s)", "different base model"]),
    "wrong_shape": (set_tensor(Q0 + "A.weight", np.ones((4, 16), np.float32)), {},
                    ["has shape (4, 16)", "needs (4, 32)"]),
    "non_float": (set_tensor(Q0 + "A.weight", np.ones((4, 32), np.int32)), {}, ["is 'I32', not a float tensor"]),
    "non_finite": (lambda d: edit_tensors(d, nan_a), {}, ["q_proj.lora_A.weight", "NaN or infinite"]),
    "missing_b": (drop_tensor(Q0 + "B.weight"), {}, ["q_proj.lora_A.weight", "no lora_B partner"]),
    "missing_a": (drop_tensor(Q0 + "A.weight"), {}, ["q_proj.lora_B.weight", "no lora_A partner"]),
    "unknown_tensor": (set_tensor("base_model.model.lm_head.lora_A.weight", np.ones((4, 32), np.float32)), {},
                       ["unknown tensor 'base_model.model.lm_head.lora_A.weight'"]),
    "fused_projection": (set_tensor("base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight",
                                    np.ones((4, 32), np.float32)), {}, ["unknown tensor", "qkv_proj"]),
    "no_tensors": (lambda d: save_file({}, d / "adapter_model.safetensors"), {}, ["holds no tensors"]),
    "truncated_weights": (lambda d: (d / "adapter_model.safetensors").write_bytes(
        (d / "adapter_model.safetensors").read_bytes()[:-100]), {}, ["corrupt or truncated"]),
    "huge_header": (write("adapter_model.safetensors", (1 << 40).to_bytes(8, "little") + b"{}"), {},
                    ["header", "truncated or not safetensors"]),
    "duplicate_tensor_name": (duplicate_header_key, {}, ["header of LoRA adapter file", "duplicate key", "corrupt"]),
    # hostile JSON: nesting that would overflow the parser's recursion (one line, not RecursionError)
    "config_deeply_nested": (write("adapter_config.json", b'{"a": ' * 100_000 + b"1" + b"}" * 100_000), {},
                             ["adapter_config.json", "nests deeper than"]),
    "config_deep_list": (write("adapter_config.json", b"[" * 5000 + b"]" * 5000), {},
                         ["adapter_config.json", "nests deeper than"]),
    "header_deeply_nested": (lambda d: write_header(d, b"[" * 5000 + b"]" * 5000), {},
                             ["adapter_model.safetensors", "nests deeper than"]),
    "header_deep_value": (lambda d: write_header(d, b'{"__metadata__": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3001),
                          {}, ["adapter_model.safetensors", "nests deeper than"]),
    # headers bounded by what an adapter for this model can hold (28 tensors: 2 layers x 7
    # projections x A, B) before a byte of them is parsed: a sparse 64 MB header, and real ones of
    # 2,000 well-formed entries (the had 1.4M) and of one huge __metadata__
    "header_over_bound": (sparse_header(64_000_000), {}, ["64,000,000-byte header", "at most 28 LoRA tensors"]),
    "header_many_entries": (lambda d: write_header(d, json.dumps(
        {f"{Q0}A.weight".replace("layers.0", f"layers.{i}"): {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
         for i in range(2_000)}).encode()), {}, ["-byte header", "at most 28 LoRA tensors"]),
    "header_huge_metadata": (lambda d: write_header(d, json.dumps({"__metadata__": {"x": "y" * (1 << 20)}}).encode()),
                             {}, ["-byte header", "at most 28 LoRA tensors"]),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refused(plain, tmp_path, case):
    change, overrides, words = REFUSALS[case]
    d = tmp_path / "adapter\nname"  # a newline in the path must not break the one-line message
    shutil.copytree(plain[0], d)
    change(d)
    args = dict(targets=TARGETS, rank=RANK, num_layers=LAYERS) | overrides
    with pytest.raises(GraphkilnError) as err:
        read_peft_adapter(d, **args)
    message = str(err.value)
    assert "\n" not in message and "\r" not in message
    for word in words:
        assert word in message, (word, message)
    assert not (d / "UNPICKLED").exists()


def within(seconds: float, fn, *args, unblock=None):
    """``fn(*args)``'s result or exception, failing the test if it is still running after
    ``seconds`` (then ``unblock()`` frees the stuck thread, e.g. by opening a FIFO's other end)."""
    box = {}

    def call():
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        if unblock is not None:
            unblock()
        worker.join(5)
        pytest.fail(f"{getattr(fn, '__name__', fn)} was still running after {seconds} s (blocked)")
    if "error" in box:
        raise box["error"]
    return box.get("result")


def open_fifo_writer(path: Path):
    """Open and close a FIFO's write end: a reader blocked opening it returns and reads EOF."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def special(kind: str):
    """Put a FIFO, a link to /dev/zero or a directory in a file's place."""
    def change(target: Path):
        target.unlink()
        if kind == "fifo":
            os.mkfifo(target)
        elif kind == "dev_zero":
            target.symlink_to("/dev/zero")
        else:
            target.mkdir()
    return change


SPECIAL = {"fifo": "a FIFO, not a regular file", "dev_zero": "a device, not a regular file",
           "directory": "a directory, not a regular file"}


@pytest.mark.parametrize("file", ["adapter_config.json", "adapter_model.safetensors"])
@pytest.mark.parametrize("kind", list(SPECIAL))
def test_special_files_are_refused_without_blocking(plain, tmp_path, file, kind):
    """Every file of an adapter is opened without blocking and must be a regular file: a FIFO
    (a plain open() waits for a writer forever), a link to /dev/zero (reads without end) or a
    directory in a file's place is one line naming the file and what it is."""
    d = tmp_path / "adapter"
    shutil.copytree(plain[0], d)
    special(kind)(d / file)
    with pytest.raises(GraphkilnError) as err:
        within(10, read_peft_adapter, d, TARGETS, RANK, LAYERS, unblock=lambda: open_fifo_writer(d / file))
    message = str(err.value)
    assert file in message and SPECIAL[kind] in message and "\n" not in message, message
    assert "no adapter_model.safetensors" not in message


@pytest.mark.parametrize("make", [
    lambda root: root / ("x" * 300),  # one name over the file system's 255
    lambda root: root.joinpath(*["d" * 200] * 25),  # a path over PATH_MAX (4096)
    lambda root: root / ("x" * 300) / "adapter",  # the long name above the adapter's own
])
def test_over_long_paths_are_one_line(tmp_path, make):
    path = make(tmp_path)
    with pytest.raises(GraphkilnError) as err:
        read_peft_adapter(path, TARGETS, RANK, LAYERS)
    message = str(err.value)
    assert "too long" in message and len(message) < 600 and "\n" not in message, message


# ---------------------------------------------------------------------------------------------
# AdapterPool


def snapshot(pool):
    return {k: (a.copy(), b.copy()) for k, (a, b) in pool.arrays.items()}


def identities(pool):
    return {k: (id(a), a.ctypes.data, id(b), b.ctypes.data) for k, (a, b) in pool.arrays.items()}


def test_pool_layout_and_load(plain, base, tmp_path):
    make_adapter(base, tmp_path / "partial", target_modules=["k_proj", "down_proj"], layers_to_transform=[1])
    pool = AdapterPool(TARGETS, RANK, max_loras=2)
    for t in TARGETS:
        a, b = pool.arrays[t.key]
        assert a.shape == (3, t.in_features, RANK) and b.shape == (3, RANK, t.out_features)
        assert a.dtype == b.dtype == np.float32 and a.flags.c_contiguous and b.flags.c_contiguous
    assert pool.load("full", plain[0]) == 1 and pool.load("partial", tmp_path / "partial") == 2
    assert pool.names() == ["full", "partial"] and "full" in pool and "nope" not in pool
    full = read_peft_adapter(plain[0], TARGETS, RANK, LAYERS)
    partial = read_peft_adapter(tmp_path / "partial", TARGETS, RANK, LAYERS)
    for key, (a, b) in pool.arrays.items():
        assert not a[0].any() and not b[0].any()  # slot 0: no adapter
        np.testing.assert_array_equal(a[1], full[key][0])
        np.testing.assert_array_equal(b[1], full[key][1])
        if key in partial:
            np.testing.assert_array_equal(a[2], partial[key][0])
            np.testing.assert_array_equal(b[2], partial[key][1])
        else:  # a target the adapter does not touch: zero update
            assert not a[2].any() and not b[2].any()
    assert set(partial) == {(1, "k_proj"), (1, "down_proj")}


def test_lru_eviction_keeps_arrays_and_other_slots(plain, others):
    pool = AdapterPool(TARGETS, RANK, max_loras=2)
    ids = identities(pool)
    assert pool.load("a", plain[0]) == 1 and pool.load("b", others[0]) == 2
    pool.release(pool.acquire("a"))  # a is now the most recently used: b is the LRU
    before = snapshot(pool)
    assert pool.load("c", others[1]) == 2  # evicts b, not a
    assert pool.names() == ["a", "c"]
    after = snapshot(pool)
    for key in before:  # slot 1 (a) was not touched while c was written into slot 2
        np.testing.assert_array_equal(after[key][0][:2], before[key][0][:2])
        np.testing.assert_array_equal(after[key][1][:2], before[key][1][:2])
        assert not np.array_equal(after[key][1][2], before[key][1][2])
    with pytest.raises(GraphkilnError, match="no LoRA adapter named 'b' is loaded"):
        pool.acquire("b")
    slot_c = pool.acquire("c")
    pool.release(slot_c)  # now a is the LRU
    assert pool.load("d", others[2]) == 1
    assert pool.names() == ["d", "c"]
    pool.unload("d")
    assert identities(pool) == ids  # same objects, same buffers, through loads, evictions, unloads
    for a, b in pool.arrays.values():
        assert not a[0].any() and not b[0].any()


def test_full_of_in_use_slots_refuses(plain, others):
    pool = AdapterPool(TARGETS, RANK, max_loras=2)
    pool.load("a", plain[0])
    pool.load("b", others[0])
    slots = [pool.acquire("a"), pool.acquire("b")]
    before, version = snapshot(pool), pool.version
    with pytest.raises(GraphkilnError) as err:
        pool.load("c", others[1])
    message = str(err.value)
    assert "all 2 LoRA slots hold adapters in use" in message and "--max-loras" in message and "\n" not in message
    assert pool.names() == ["a", "b"] and pool.version == version
    for key, (a, b) in snapshot(pool).items():
        np.testing.assert_array_equal(a, before[key][0])
        np.testing.assert_array_equal(b, before[key][1])
    pool.release(slots[1])
    assert pool.load("c", others[1]) == 2  # b is free of requests now: evicted


def test_unload_refused_while_acquired(plain):
    pool = AdapterPool(TARGETS, RANK, max_loras=1)
    slot = pool.load("a", plain[0])
    held = [pool.acquire("a"), pool.acquire("a")]
    assert held == [slot, slot] and pool.refs(slot) == 2
    with pytest.raises(GraphkilnError) as err:
        pool.unload("a")
    assert "'a' is in use by 2 queued or running request(s)" in str(err.value)
    pool.release(slot)
    with pytest.raises(GraphkilnError, match="in use by 1 queued or running"):
        pool.unload("a")
    pool.release(slot)
    pool.unload("a")
    assert pool.names() == []
    for a, b in pool.arrays.values():  # the freed slot is zeroed: a stale route reads no adapter
        assert not a.any() and not b.any()
    with pytest.raises(GraphkilnError, match="no LoRA adapter named 'a' is loaded"):
        pool.unload("a")
    with pytest.raises(ValueError, match="no request holds"):
        pool.release(slot)


def test_acquire_base_and_names(plain):
    pool = AdapterPool(TARGETS, RANK, max_loras=1)
    assert pool.acquire(None) == 0 and pool.refs(0) == 0
    pool.release(0)
    pool.load("a", plain[0])
    with pytest.raises(GraphkilnError, match="already loaded"):
        pool.load("a", plain[0])
    with pytest.raises(GraphkilnError, match="not a usable name"):
        pool.load("bad\nname", plain[0])
    with pytest.raises(GraphkilnError, match=r"no LoRA adapter named 'x' is loaded \(loaded: 'a'\)"):
        pool.acquire("x")


# names clients send as ``model``: the CLI's --lora NAME, the route's lora_name and the pool
# share one rule (1-256 printable characters, no surrounding whitespace)
BAD_NAMES = ["", " a", "a ", "\u00a0a", "a\u3000", "\tab", "a\nb", "a\x1b[31m", "a\u2028b", "x" * 257, 7, None]


@pytest.mark.parametrize("name", BAD_NAMES, ids=range(len(BAD_NAMES)))
def test_unusable_names_are_refused(plain, name):
    pool = AdapterPool(TARGETS, RANK, max_loras=1)
    with pytest.raises(GraphkilnError) as err:
        pool.load(name, plain[0])
    message = str(err.value)
    assert "not a usable" in message and "\n" not in message and "\x1b" not in message, message
    assert pool.names() == []


@pytest.mark.parametrize("shape", [
    dict(max_loras=256, rank=64, features=1 << 20, layers=1),  # --max-loras: 257 slots
    dict(max_loras=2, rank=1 << 16, features=1 << 16, layers=4),  # a huge rank
    dict(max_loras=4, rank=256, features=8192, layers=1 << 12),  # many targets
])
def test_stacks_larger_than_memory_are_refused(shape):
    """The stacks are (max_loras + 1) x rank x sum(in + out) x 4 bytes: estimated and checked
    against available memory before they are allocated, one line naming the figure and the flag."""
    targets = [LoraTarget(layer, "q_proj", shape["features"], shape["features"]) for layer in range(shape["layers"])]
    with pytest.raises(GraphkilnError) as err:
        AdapterPool(targets, shape["rank"], shape["max_loras"])
    message = str(err.value)
    want = (shape["max_loras"] + 1) * shape["rank"] * 2 * shape["features"] * shape["layers"] * 4
    assert f"needs about {want / 2**30:.2f} GiB" in message, message
    assert f"{shape['max_loras'] + 1} slots" in message and "--max-loras" in message and "--lora-rank" in message


def test_refused_adapter_changes_nothing(plain, tmp_path):
    pool = AdapterPool(TARGETS, RANK, max_loras=1)
    pool.load("a", plain[0])
    bad = tmp_path / "bad"
    shutil.copytree(plain[0], bad)
    edit_config(bad, use_dora=True)
    before, version = snapshot(pool), pool.version
    with pytest.raises(GraphkilnError, match="DoRA"):
        pool.load("b", bad)  # the only slot is idle and would be evicted: validation comes first
    assert pool.names() == ["a"] and pool.version == version
    for key, (a, b) in snapshot(pool).items():
        np.testing.assert_array_equal(a, before[key][0])
        np.testing.assert_array_equal(b, before[key][1])


def test_float16_pool(plain, tmp_path):
    pool = AdapterPool(TARGETS, RANK, max_loras=1, dtype="float16")
    slot = pool.load("a", plain[0])
    full = read_peft_adapter(plain[0], TARGETS, RANK, LAYERS)
    for key, (a, b) in pool.arrays.items():
        assert a.dtype == b.dtype == np.float16
        np.testing.assert_array_equal(a[slot], full[key][0].astype(np.float16))
        np.testing.assert_array_equal(b[slot], full[key][1].astype(np.float16))
    huge = tmp_path / "huge"
    shutil.copytree(plain[0], huge)
    edit_config(huge, lora_alpha=1e6)  # fine in float32, overflows float16 once scaled
    with pytest.raises(GraphkilnError, match="overflow the artifact's float16"):
        pool.load("huge", huge)


def test_threads_count_exactly(plain, others):
    """Requests acquire/release from several threads while adapters are loaded and unloaded."""
    pool = AdapterPool(TARGETS, RANK, max_loras=3)
    pool.load("a", plain[0])
    pool.load("b", others[0])
    errors = []

    def requests(name):
        try:
            for _ in range(300):
                pool.release(pool.acquire(name))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=requests, args=(n,)) for n in ("a", "b", "a", "b")]
    for w in workers:
        w.start()
    for _ in range(3):
        pool.load("c", others[1])
        pool.unload("c")
    for w in workers:
        w.join()
    assert not errors
    assert pool.refs(1) == pool.refs(2) == 0 and pool.names() == ["a", "b"]
    pool.unload("a")  # nothing left counted against it


def test_runtime_module_is_torch_free():
    code = "import sys, graphkiln.runtime.lora; assert 'torch' not in sys.modules and 'safetensors' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_mixed_batch_rows_match_peft_modules(base, tmp_path):
    """The graph's contract, in numpy: row b's projection is base(x) + x @ A[idx[b]] @ B[idx[b]].
    Rows on slot 0, adapter 1 and adapter 2 (different ranks and scalings) against PEFT's own
    LoRA modules' forward."""
    _, one = make_adapter(base, tmp_path / "one", seed=5)
    _, two = make_adapter(base, tmp_path / "two", seed=6, r=2, lora_alpha=3, use_rslora=True)
    pool = AdapterPool(TARGETS, RANK, max_loras=2)
    idx = np.array([pool.load("one", tmp_path / "one"), 0, pool.load("two", tmp_path / "two"), 1])
    torch.manual_seed(7)
    for name, lora_one in one.named_modules():
        if not isinstance(lora_one, peft.tuners.lora.Linear):
            continue
        lora_two = two.get_submodule(name)
        a, b = pool.arrays[key_of(name.removeprefix("base_model.model."))]
        x = torch.randn(4, lora_one.in_features)
        with torch.no_grad():
            want = [lora_one(x[0]), lora_one.base_layer(x[1]), lora_two(x[2]), lora_one(x[3])]
            base_out = lora_one.base_layer(x).numpy()
        xs = x.numpy()
        got = base_out + np.einsum("bi,bir,bro->bo", xs, a[idx], b[idx])
        np.testing.assert_allclose(got, torch.stack(want).numpy(), rtol=0, atol=1e-5, err_msg=name)


def test_adapter_being_written_is_not_routable(plain, others, monkeypatch):
    """While load writes a slot's rows, its name is reserved but cannot be acquired."""
    pool = AdapterPool(TARGETS, RANK, max_loras=2)
    pool.load("a", plain[0])
    writing, finish = threading.Event(), threading.Event()
    real_write = pool._write

    def slow_write(index, adapter):
        writing.set()
        assert finish.wait(10)
        real_write(index, adapter)

    monkeypatch.setattr(pool, "_write", slow_write)
    loader = threading.Thread(target=pool.load, args=("b", others[0]))
    loader.start()
    try:
        assert writing.wait(10)
        assert pool.names() == ["a"] and "b" not in pool
        with pytest.raises(GraphkilnError, match="no LoRA adapter named 'b' is loaded"):
            pool.acquire("b")
        with pytest.raises(GraphkilnError, match="'b' is already loaded"):
            pool.load("b", others[0])
        pool.release(pool.acquire("a"))  # requests on other slots go on meanwhile
    finally:
        finish.set()
        loader.join()
    assert pool.names() == ["a", "b"] and pool.acquire("b") == 2
