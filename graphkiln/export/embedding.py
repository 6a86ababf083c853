"""``export --task embed``: an embedding artifact from a decoder checkpoint (torch-free).

An embedding artifact's decoder graph has no LM head: it returns ``last_hidden_state`` (the
final-norm hidden states at the ``logits_index`` positions, ``models.decoder``) in the logits'
place, and its manifest records the default pooling and normalisation (``manifest.EmbeddingSpec``)
that ``runtime.embed`` applies. Embedding checkpoints such as Qwen3-Embedding are plain decoders,
often saved from the base model class (``Qwen3Model``: no ``model.`` prefix, no ``lm_head``):
the family of the matching ``*ForCausalLM`` reads them (``models.weights`` takes the unprefixed
layout), and the head is treated as tied, since the graph never reads it.

Defaults come from the flags, else from the checkpoint's sentence-transformers files (a
``1_Pooling/config.json`` pooling mode, a ``Normalize`` module in ``modules.json``), else
last-token pooling, normalised (what decoder embedding models are trained with).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import EMBEDDING_POOLINGS, EmbeddingSpec
from graphkiln.untrusted import read_json, show

TASKS = ("generate", "embed")
_ST_POOLING = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}
_ST_FIX = "fix or remove the checkpoint's sentence-transformers files, or pass --pooling and --normalize explicitly"


def check_task_options(task: str, pooling: str | None, normalize: bool | None, targets: tuple[str, ...],
                       stages: bool, lora: bool, hidden_states: bool) -> None:
    """Refuse (one line) what an embedding export cannot be, before anything is read."""
    if task not in TASKS:
        raise GraphkilnError(f"--task {show(task)} is not a task: choose one of {', '.join(TASKS)}")
    if task != "embed":
        if pooling is not None or normalize is not None:
            raise GraphkilnError("--pooling and --normalize describe an embedding artifact: add --task embed, or drop them")
        return
    if pooling is not None and pooling not in EMBEDDING_POOLINGS:
        raise GraphkilnError(f"--pooling {show(pooling)} is not a pooling: choose one of {', '.join(EMBEDDING_POOLINGS)}")
    if "tensorrt" in targets:
        raise GraphkilnError("--task embed is not supported with --target tensorrt yet (its runners bind only the "
                             "outputs they know): use --target onnxruntime or portable")
    for given, flag in ((stages, "--stages/--stage-layers"), (lora, "--lora-rank"),
                        (hidden_states, "--return-hidden-states")):
        if given:
            raise GraphkilnError(f"--task embed does not take {flag} (an embedding artifact is one decoder graph that "
                                 "returns hidden states only): drop it")


def embedding_architecture(arch: str, known) -> str:
    """The family that reads an embedding checkpoint of architecture ``arch``: a base model class
    (``Qwen3Model``) is read by its ``*ForCausalLM`` family when one is registered (``known``)."""
    if arch.endswith("Model") and not known(arch):
        causal = arch.removesuffix("Model") + "ForCausalLM"
        if known(causal):
            return causal
    return arch


def embedding_config(cfg):
    """The decoder config an embedding export loads: the head tied to the embedding, so a checkpoint
    without ``lm_head.weight`` loads and an untied one is not read (the graph has no head)."""
    return dataclasses.replace(cfg, tie_word_embeddings=True)


def embedding_spec(src: Path, pooling: str | None, normalize: bool | None, vision: bool) -> EmbeddingSpec:
    """The manifest's embedding record: the flags, else the checkpoint's sentence-transformers files,
    else last-token pooling, normalised."""
    if vision:
        raise GraphkilnError("--task embed is for text decoders: this checkpoint is a vision-language model; "
                             "export it without --task embed")
    st_pooling, st_normalize = sentence_transformers_defaults(src)
    pooling = pooling or st_pooling or "last"
    normalize = normalize if normalize is not None else (st_normalize if st_normalize is not None else True)
    return EmbeddingSpec(pooling, normalize)


def sentence_transformers_defaults(src: Path) -> tuple[str | None, bool | None]:
    """(pooling, normalize) that a checkpoint's sentence-transformers files declare, or None each:
    ``modules.json`` lists the modules (a ``Pooling`` one's directory holds its config; a
    ``Normalize`` one normalises)."""
    modules_file = src / "modules.json"
    if not modules_file.exists():
        return None, None
    modules = read_json(modules_file, "modules.json", _ST_FIX, limit=1 << 20, within=src)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise GraphkilnError(f"modules.json is not a list of modules: {_ST_FIX}")
    types = [str(m.get("type", "")) for m in modules]
    normalize = any(t.endswith(".Normalize") for t in types)
    pooling = None
    for m, t in zip(modules, types):
        if not t.endswith(".Pooling"):
            continue
        where = m.get("path")
        if not isinstance(where, str) or not where or where.startswith("/") or ".." in Path(where).parts:
            raise GraphkilnError(f"modules.json names the pooling module's path {show(where)}: {_ST_FIX}")
        cfg = read_json(src / where / "config.json", f"{where}/config.json", _ST_FIX, limit=1 << 20, within=src)
        if not isinstance(cfg, dict):
            raise GraphkilnError(f"{show(where)}/config.json is not a JSON object: {_ST_FIX}")
        chosen = [mode for key, mode in _ST_POOLING.items() if cfg.get(key) is True]
        others = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v is True and k not in _ST_POOLING]
        if others or len(chosen) != 1:
            raise GraphkilnError(f"{show(where)}/config.json pools by {others[0] if others else 'several modes'}, "
                                 f"which graphkiln does not do (it pools by last token or mean): {_ST_FIX}")
        pooling = chosen[0]
    return pooling, normalize
