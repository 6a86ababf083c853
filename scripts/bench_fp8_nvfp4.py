"""FP8 and NVFP4 checkpoints of a real model, exported kept quantized: the integer blocks' error
against the stored values, and perplexity against the dequantized model.

From a float checkpoint (default: SmolLM2-135M-Instruct, ``scripts/real_checkpoint.py``), writes
two quantized copies as the Hub stores them, every decoder Linear quantized (embedding and tied
head kept float, as DeepSeek-V3 / Qwen3-FP8 / ModelOpt keep them):

* ``fp8``: ``quant_method: fp8``, e4m3 with ``weight_scale_inv`` over 128 x 128 tiles (amax / 448);
* ``nvfp4``: ModelOpt NVFP4 (``hf_quant_config.json``), E2M1 pairs, e4m3 scale per 16, fp32
  per-tensor ``weight_scale_2`` (ModelOpt's recipe: amax / (6 * 448)).

Then exports each (``--quant none``: the float artifact of the stored values, the reference; the
default int8 blocks; NVFP4 also ``--quant int4``) and scores perplexity on graphkiln's built-in
prose, 2 threads. Prints the conversion summaries (blocks exact, relative RMS error) and a table.

    python scripts/bench_fp8_nvfp4.py --work /work/bench-tmp/fp8-nvfp4 [--checkpoint DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def _fp8(w, tile: int = 128):
    import torch

    n, k = w.shape
    rows, cols = -(-n // tile), -(-k // tile)
    padded = torch.zeros(rows * tile, cols * tile)
    padded[:n, :k] = w.abs()
    scale = padded.reshape(rows, tile, cols, tile).amax((1, 3)) / 448
    scale = torch.where(scale > 0, scale, torch.ones(()))
    full = scale.repeat_interleave(tile, 0)[:n].repeat_interleave(tile, 1)[:, :k]
    return {"weight": (w / full).to(torch.float8_e4m3fn), "weight_scale_inv": scale}


def _nvfp4(w):
    import torch

    n, k = w.shape
    s2 = (w.abs().max() / (6 * 448)).reshape(())
    blocks = w.reshape(n, k // 16, 16)
    s = (blocks.abs().amax(-1) / 6 / s2).to(torch.float8_e4m3fn)
    x = (blocks / (s.float().clamp_min(1e-30) * s2)[..., None]).reshape(n, k).numpy()
    idx = np.abs(np.abs(x)[..., None] - E2M1).argmin(-1).astype(np.uint8) | ((x < 0) << 3).astype(np.uint8)
    return {"weight": torch.from_numpy(idx[:, 0::2] | (idx[:, 1::2] << 4)), "weight_scale": s,
            "weight_scale_2": s2.float(), "input_scale": torch.ones(())}


def write_quantized(src: Path, dest: Path, kind: str) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    if (dest / ".complete").is_file():
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out = {}
    for name, t in tensors.items():
        module, _, role = name.rpartition(".")
        if role == "weight" and module.rpartition(".")[2] in LINEAR:
            out.update({f"{module}.{r}": v for r, v in (_fp8 if kind == "fp8" else _nvfp4)(t.float()).items()})
        else:
            out[name] = t.to(torch.bfloat16)
    save_file({k: v.contiguous() for k, v in out.items()}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and not f.name.startswith(".") and f.name != "config.json":
            shutil.copy(f, dest / f.name)
    raw = json.loads((src / "config.json").read_text())
    if kind == "fp8":
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                      "activation_scheme": "dynamic"}
    else:
        (dest / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt", "version": "0.29.0"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                             "exclude_modules": ["lm_head"]}}))
    (dest / "config.json").write_text(json.dumps(raw, indent=2))
    (dest / ".complete").write_text("")
    return dest


def export_and_score(ckpt: Path, art: Path, quant: str | None) -> dict:
    from graphkiln.export.pipeline import ExportOptions, export_model
    from graphkiln.perplexity import artifact_perplexity, read_text
    from graphkiln.runtime import Engine

    said = []
    import graphkiln.export.pipeline as pipeline

    real = pipeline._say
    pipeline._say = lambda opts, msg: said.append(msg.strip())
    t0 = time.perf_counter()
    try:
        shutil.rmtree(art, ignore_errors=True)
        export_model(str(ckpt), art, ExportOptions(progress=False, quant=quant, max_seq_len=2048))
    finally:
        pipeline._say = real
    took = time.perf_counter() - t0
    engine = Engine.load(art, threads=2)
    ppl = artifact_perplexity(engine, read_text(None))
    size = sum(p.stat().st_size for p in art.iterdir() if p.is_file())
    return {"ppl": ppl.value, "said": [s for s in said if "blocks" in s], "export_s": took, "bytes": size}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--checkpoint", type=Path, default=None, help="float checkpoint (default: SmolLM2-135M)")
    args = ap.parse_args()
    src = args.checkpoint
    if src is None:
        sys.path.insert(0, str(Path(__file__).parent))
        import real_checkpoint

        src = real_checkpoint.build(args.work / "smollm2")
    rows = []
    for kind, quants in (("fp8", ("none", None, "int4")), ("nvfp4", ("none", None, "int4"))):
        ckpt = write_quantized(src, args.work / f"{kind}-ckpt", kind)
        base = None
        for quant in quants:
            r = export_and_score(ckpt, args.work / f"{kind}-art-{quant}", quant)
            base = base or r["ppl"]
            rows.append((kind, quant or "default (int8)", r, r["ppl"] / base))
            print(kind, quant, json.dumps({k: v for k, v in r.items()}), flush=True)
    print("| checkpoint | --quant | perplexity | vs --quant none | artifact MB | conversion |")
    print("|---|---|---|---|---|---|")
    for kind, quant, r, rel in rows:
        print(f"| {kind} | {quant} | {r['ppl']:.3f} | {rel:.3f}x | {r['bytes'] / 1e6:.1f} | {'; '.join(r['said'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
