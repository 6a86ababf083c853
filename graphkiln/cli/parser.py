"""The ``graphkiln`` command: export, inspect, run, chat, verify, check, build, serve, demo.

The argument parser: every command's flags, with graphkiln's error contract (``_Parser``).
"""

from __future__ import annotations

import argparse

from graphkiln.cli import commands
from graphkiln.cli.arg_types import int_at_least, lora_pair, number, port, sha256_hex
from graphkiln.cli.flags import (add_batched_int8_flag, add_draft_cost_flag, add_engine_flags, add_generation_flags,
                                 add_prefix_flags, add_ray_flags)


class _Parser(argparse.ArgumentParser):
    """argparse with graphkiln's error contract: one ``error:`` line and exit status 2
    (argparse's own prints a usage block first). Subcommand parsers inherit this class."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="graphkiln", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("export", help="export a checkpoint directory or hub id to an artifact directory")
    e.add_argument("model", help="checkpoint directory (config.json + *.safetensors) or hub id")
    e.add_argument("-o", "--output", required=True, help="artifact directory to create")
    e.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    e.add_argument("--max-seq-len", type=int, default=None, help="default: the config's max_position_embeddings")
    e.add_argument("--opset", type=int, default=23)
    e.add_argument("--target", default="onnxruntime", metavar="TARGET[,TARGET...]",
                   help="one graph per target, over one weights file; "
                        "onnxruntime (default): the CPU artifact (GroupQueryAttention writing the KV cache in "
                        "place, fused norms, com.microsoft.MoE; needed by --quant); portable: standard ONNX + "
                        "graphkiln custom ops, ~10%% slower dense decode and 3-10x slower MoE layers on "
                        "onnxruntime; tensorrt: the portable graph as TensorRT's ONNX parser takes it (custom ops "
                        "as aot=1 plugins writing state in place; see 'graphkiln check'), also runs on onnxruntime")
    e.add_argument("--quant", default=None, choices=["int4", "int8", "none"],
                   help="weight-only quantization of the Linear layers and the embedding (block-wise, "
                        "com.microsoft.MatMulNBits / GatherBlockQuantized; onnxruntime target only). A GGUF or "
                        "GPTQ/AWQ checkpoint keeps its own blocks where they map exactly; FP8/NVFP4 ones become "
                        "int8 blocks by default. none: float weights at --dtype (a quantized checkpoint's "
                        "dequantized values)")
    e.add_argument("--expert-quant", default=None, choices=["int4", "int8"],
                   help="an MXFP4 checkpoint's (gpt-oss) experts as onnxruntime QMoE blocks of this width: int8 "
                        "exact, int4 approximate (default: --quant's width, else int4; without --quant the other "
                        "layers are then float)")
    e.add_argument("--quant-method", default="calibrated", choices=["calibrated", "search", "rtn"],
                   help="how blocks are chosen: calibrated (default): scales searched to minimise the error in "
                        "each layer's output, weighted by activations from a short calibration text; search: "
                        "the same on the weights alone; rtn: round to nearest (fastest export)")
    e.add_argument("--quant-block-size", type=int, default=32, metavar="N",
                   help="weights per quantization block along the input features: 16, 32, 64, 128 or 256 "
                        "(what onnxruntime's MatMulNBits accepts; default 32)")
    e.add_argument("--quant-scheme", default="sym", choices=["sym", "asym"],
                   help="sym (default): scale per block, no zero points (faster); asym: scale and zero point "
                        "per block (tighter fit for skewed blocks)")
    e.add_argument("--stages", type=int, default=None, metavar="N",
                   help="pipeline stages: one decoder graph (and weights file) per slice of layers, N slices "
                        "as even as possible by weight bytes; Engine.load runs them chained")
    e.add_argument("--stage-layers", default=None, metavar="A:B,B:C,...",
                   help="pipeline stages by explicit layer ranges, e.g. 0:6,6:12 (instead of --stages)")
    e.add_argument("--return-hidden-states", action="store_true",
                   help="the decoder graph also returns the final-norm hidden states at the logits positions "
                        "(GenerationConfig(return_hidden_states=...), Engine.embed); not with --target tensorrt")
    e.add_argument("--task", default="generate", choices=["generate", "embed"],
                   help="generate (default): a decoder with its LM head; embed: an embedding artifact (no LM "
                        "head, Engine.embed, serve's /v1/embeddings), e.g. from Qwen3-Embedding")
    e.add_argument("--pooling", default=None, choices=["last", "mean"],
                   help="--task embed: the artifact's default pooling (default: the checkpoint's "
                        "sentence-transformers pooling, else last)")
    e.add_argument("--normalize", default=None, action=argparse.BooleanOptionalAction,
                   help="--task embed: whether embeddings are L2-normalised by default (default: as the "
                        "checkpoint's sentence-transformers modules say, else yes)")
    e.add_argument("--lora-rank", type=int, default=None, metavar="R",
                   help="serve LoRA adapters: per targeted projection, adapter stacks of rank R (the largest "
                        "adapter rank accepted) become graph inputs, each request choosing its adapter or none")
    e.add_argument("--lora-targets", default=None, metavar="q,k,v,o,gate,up,down",
                   help="the projections adapters may change (default: all of these the model has)")
    e.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="adapter slots loaded at once (default 4; least recently used replaced)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    e.set_defaults(fn=commands.do_export)

    i = sub.add_parser("inspect", help="summarise an artifact")
    i.add_argument("artifact")
    i.add_argument("--json", action="store_true", help="print the raw manifest")
    i.set_defaults(fn=commands.do_inspect)

    r = sub.add_parser("run", help="generate from an artifact")
    r.add_argument("artifact")
    r.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    r.add_argument("--prompt-ids", action="append", help="prompt token ids, e.g. '1,2,3' (repeatable)")
    r.add_argument("--image", action="append", metavar="PATH",
                   help="an image for a vision-language artifact (repeatable, in the order of the prompt's image "
                        "tokens, e.g. <image> for LLaVA; all for the one prompt)")
    add_generation_flags(r)
    r.add_argument("--logprobs", type=int_at_least(0), default=None, metavar="N", help="print log-probabilities with N alternatives")
    r.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    r.add_argument("--show-ids", action="store_true", help="print token ids instead of text")
    r.add_argument("--chat", action="store_true",
                   help="apply the artifact's chat template: each --prompt is one user message (its reply's turn "
                        "opened), as 'graphkiln chat' sends it")
    r.add_argument("--system", default=None, metavar="TEXT", help="with --chat: the system message")
    r.add_argument("--lora", default=None, metavar="DIR",
                   help="generate with this PEFT LoRA adapter directory (adapter_config.json + "
                        "adapter_model.safetensors) applied; the artifact must be exported with --lora-rank")
    add_engine_flags(r)
    r.set_defaults(fn=commands.do_run)

    t = sub.add_parser("chat", help="converse with an artifact over its chat template (a terminal, or lines on stdin)")
    t.add_argument("artifact")
    t.add_argument("--system", default=None, metavar="TEXT", help="the system message, kept by /reset")
    add_generation_flags(t)
    add_engine_flags(t)
    t.set_defaults(fn=commands.do_chat)

    v = sub.add_parser("verify", help="compare an artifact with its transformers reference")
    v.add_argument("artifact")
    v.add_argument("--reference", required=True, help="the checkpoint the artifact was exported from")
    v.add_argument("--steps", type=int_at_least(1), default=32)
    v.add_argument("--seed", type=int_at_least(0), default=0)
    v.add_argument("--atol", type=number(0.0), default=None, help="default: 1e-4 for fp32 artifacts")
    v.add_argument("--target", default=None, choices=["portable", "onnxruntime", "tensorrt"],
                   help="verify only the graph exported for this target (default: every graph in the artifact)")
    v.add_argument("--text", default=None, metavar="FILE",
                   help="quantized artifacts: the UTF-8 text whose perplexity is compared with the reference's "
                        "(default: built-in English prose)")
    v.add_argument("--streamed-reference", action="store_true",
                   help="compare with graphkiln's torch decoder run one layer at a time from the checkpoint instead of "
                        "transformers' whole fp32 model (the default when that would not fit in memory)")
    v.set_defaults(fn=commands.do_verify)

    c = sub.add_parser("check", help="check an artifact's graphs against a backend's published operator support")
    c.add_argument("artifact")
    c.add_argument("--backend", required=True, choices=["tensorrt"],
                   help="tensorrt: every node against the TensorRT ONNX parser's operator list (vendored, with its "
                        "version); exit 1 if anything would fail")
    c.set_defaults(fn=commands.do_check)

    b = sub.add_parser("build", help="build a TensorRT engine for an artifact's tensorrt-target graph (NVIDIA GPU)")
    b.add_argument("artifact")
    b.add_argument("--backend", required=True, choices=["tensorrt"],
                   help="tensorrt: TensorRT 11 engine (plan + timing cache) written into the artifact's "
                        "engines/tensorrt/ and recorded in its manifest (which changes its digest)")
    b.add_argument("--max-batch", type=int_at_least(1), default=None, metavar="N",
                   help="most requests served at once: the state pools' slots (default 8)")
    b.add_argument("--max-seq-len", type=int_at_least(2), default=None, metavar="L",
                   help="most tokens per request, prompt included: the state pools' capacity (default and upper "
                        "bound: the artifact's max sequence length)")
    b.set_defaults(fn=commands.do_build)

    s = sub.add_parser("serve", help="serve an artifact over an OpenAI-compatible HTTP API (continuous batching)")
    s.add_argument("artifact")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=port, default=8000, help="TCP port (default 8000; 0: any free port)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: the "
                        "GRAPHKILN_API_KEY environment variable, else no key)")
    s.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model id clients send and /v1/models lists (default: the artifact directory's name)")
    s.add_argument("--max-queue", type=int_at_least(1), default=64, metavar="N",
                   help="requests waiting for a slot before new ones get 429 (default 64)")
    s.add_argument("--max-batch", type=int_at_least(1), default=None, metavar="N",
                   help="requests generating at once: the state pools' slots (default 16, fewer if memory is short)")
    s.add_argument("--step-tokens", type=int_at_least(2), default=256, metavar="N",
                   help="tokens per scheduler step: one per generating request, the rest prefill new prompts in "
                        "chunks (default 256)")
    s.add_argument("--threads", type=int_at_least(1), default=None, help="onnxruntime threads (default: every core)")
    add_prefix_flags(s)
    add_batched_int8_flag(s)
    s.add_argument("--drain-timeout", type=number(0.0), default=30.0, metavar="SECONDS",
                   help="on SIGTERM/Ctrl-C, how long in-flight requests may run before they are cancelled (default 30)")
    s.add_argument("--expect-digest", type=sha256_hex, default=None, metavar="SHA256",
                   help="refuse the artifact unless its manifest has this sha256 (as for run)")
    s.add_argument("--target", default=None, choices=["portable", "onnxruntime", "tensorrt"],
                   help="serve the graph exported for this target (default: the best one for onnxruntime)")
    s.add_argument("--distributed", default=None, choices=["ray"],
                   help="run a staged artifact's stages as Ray actors (pip install 'graphkiln[distributed]')")
    add_ray_flags(s)
    s.add_argument("--lora", action="append", type=lora_pair, default=None, metavar="NAME=DIR",
                   help="serve the PEFT LoRA adapter in DIR as model NAME (repeatable; the artifact must be exported "
                        "with --lora-rank, and holds --max-loras at once)")
    s.add_argument("--allow-lora-updates", action="store_true",
                   help="let clients holding the API key load and unload adapters while serving (POST "
                        "/v1/load_lora_adapter, /v1/unload_lora_adapter: a directory on this server's file system); "
                        "off by default, as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    s.add_argument("--speculative", default=None, metavar="ngram[:K]|draft[:K]",
                   help="requests' default speculative decoding, K drafts per step (default 4): prompt lookup or the "
                        "--draft model's; a request's 'speculative' field (ngram[:K], draft[:K], off) overrides it; "
                        "greedy output is unchanged, sampled output keeps its distribution")
    s.add_argument("--draft", default=None, metavar="DIR",
                   help="load a draft artifact of the same tokenizer (a smaller or int4 export) for draft "
                        "speculation; without --speculative, requests default to it")
    add_draft_cost_flag(s)
    s.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="the tool-call format of /v1/chat/completions' tools: hermes (Qwen2.5/Qwen3), qwen3_coder, "
                        "llama3_json, mistral, harmony (gpt-oss), or none (tools refused); default: the one the "
                        "chat template writes")
    s.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="how replies' thinking is split into reasoning_content: think (<think>...</think>: Qwen3, "
                        "DeepSeek-R1), harmony (gpt-oss's analysis channel), or none; default: the one the chat "
                        "template writes")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(fn=commands.do_serve)

    d = sub.add_parser("demo", help="build, export, verify and run a small random Llama (no network)")
    d.add_argument("--workdir", default=None, metavar="DIR",
                   help="put the demo's files in a new DIR/graphkiln-demo-XXXXXXXX and keep them; nothing else "
                        "in DIR is touched (default: a temporary directory, removed unless --keep)")
    d.add_argument("--keep", action="store_true", help="keep the demo files")
    d.set_defaults(fn=commands.do_demo)
    return p
