"""The demo: random tiny Llama + tokenizer trained on shipped text -> export -> verify -> generate.

Needs no network. Every file goes into one new directory the demo creates with mkdtemp,
``graphkiln-demo-XXXXXXXX``: under ``--workdir DIR`` when given (kept afterwards: that is what
``--workdir`` is for), else under the system temporary directory (removed unless ``--keep``).
The demo never writes, replaces or removes anything else, so DIR may hold anything, even
directories named ``checkpoint`` or ``artifact``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from graphkiln.errors import GraphkilnError

CORPUS = Path(__file__).with_name("corpus.txt")
SPECIALS = ["<unk>", "<s>", "</s>"]


def train_tokenizer(out_dir: Path, vocab_size: int = 1024) -> int:
    """Byte-level BPE trained on the shipped corpus; writes tokenizer.json and its config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(CORPUS)], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return tok.get_vocab_size()


def build_checkpoint(out_dir: Path, seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    vocab = train_tokenizer(out_dir)
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out_dir)


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def run_demo(workdir: Path | None = None, keep: bool = False) -> int:
    from graphkiln.export.pipeline import ExportOptions, export_model
    from graphkiln.export.verify import verify_artifact
    from graphkiln.runtime import Engine, GenerationConfig

    # A fresh directory of our own: removing it can only remove what the demo wrote.
    try:
        if workdir is not None:
            Path(workdir).mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="graphkiln-demo-", dir=workdir))
    except OSError as exc:
        where = workdir if workdir is not None else tempfile.gettempdir()
        raise GraphkilnError(f"cannot create the demo's directory in {where} ({exc.strerror}): "
                             "choose another --workdir") from None
    ckpt, art = root / "checkpoint", root / "artifact"
    ckpt.mkdir()
    try:
        t = time.perf_counter()
        print("demo: building a random-weight Llama (4 layers, hidden 256) and a BPE tokenizer trained on shipped text")
        build_checkpoint(ckpt)
        t_build = time.perf_counter() - t

        t = time.perf_counter()
        manifest = export_model(str(ckpt), art, ExportOptions(max_seq_len=512, target="onnxruntime"))
        t_export = time.perf_counter() - t

        t = time.perf_counter()
        engine = Engine.load(art)
        report = verify_artifact(art, str(ckpt), steps=32, engine=engine)
        t_verify = time.perf_counter() - t

        prompt = "The potter shapes the clay"
        config = GenerationConfig(max_new_tokens=48, stop_token_ids=())
        engine.generate(prompt, GenerationConfig(max_new_tokens=2))  # warm-up
        t = time.perf_counter()
        result = engine.generate(prompt, config)[0]
        t_gen = time.perf_counter() - t

        print()
        print(f"model      {manifest.model.architecture}, {manifest.model.num_parameters / 1e6:.2f}M parameters, "
              f"checkpoint {_dir_bytes(ckpt) / 1e6:.1f} MB, artifact {_dir_bytes(art) / 1e6:.1f} MB")
        print(f"timings    build {t_build:.1f}s, export {t_export:.1f}s, verify {t_verify:.1f}s")
        print(f"parity     {report.summary()}")
        print(f"generate   {len(result.token_ids)} tokens in {t_gen * 1000:.0f} ms "
              f"({len(result.token_ids) / t_gen:.0f} tokens/s, onnxruntime CPU)")
        print(f"prompt     {prompt!r}")
        print(f"output     {result.text!r}  (random weights: expect gibberish)")
        print(f"files      {root}" + ("" if keep or workdir else " (removed)"))
        return 0 if report.passed else 1
    finally:
        if not keep and workdir is None:
            shutil.rmtree(root, ignore_errors=True)
