"""The ``graphkiln`` command: export, inspect, run, chat, verify, check, build, serve, demo.

Every user error surfaces as one ``error: ...`` line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import math
import os
import re
import sys
from pathlib import Path

from graphkiln.errors import GraphkilnError
from graphkiln.untrusted import show
from graphkiln.untrusted import show


def _export(args) -> int:
    from graphkiln.export.pipeline import ExportOptions, export_model

    export_model(args.model, Path(args.output), ExportOptions(
        dtype=args.dtype, max_seq_len=args.max_seq_len, opset=args.opset, overwrite=args.overwrite,
        target=args.target, quant=args.quant, quant_block_size=args.quant_block_size,
        quant_symmetric=args.quant_scheme == "sym", quant_method=args.quant_method, stages=args.stages, stage_layers=args.stage_layers,
        return_hidden_states=args.return_hidden_states, lora_rank=args.lora_rank, lora_targets=args.lora_targets,
        max_loras=ExportOptions.max_loras if args.max_loras is None else args.max_loras))
    return 0


def _inspect(args) -> int:
    from graphkiln.summary import describe
    from graphkiln.manifest import Manifest

    root = Path(args.artifact)
    manifest, digest = Manifest.read_with_digest(root)  # validated, paths included, before anything is described
    print(manifest.to_json() if args.json else describe(root, manifest, digest))
    return 0


_IDS = re.compile(r"[0-9]+(?:\s*,\s*[0-9]+|\s+[0-9]+)*")


def _parse_ids(text: str) -> list[int]:
    """'1,2,3' or '1 2 3': ASCII digits only (int() would take '١٢' and ' 1', and '1,,2' was
    read as 1,2), separated by one comma or by spaces."""
    if not _IDS.fullmatch(text.strip()):
        raise GraphkilnError(f"--prompt-ids {text!r} is not a list of token ids: write ASCII integers separated by "
                             "commas or spaces, e.g. '1,2,3'")
    return [int(t) for t in re.split(r"[\s,]+", text.strip())]


def _int_at_least(low: int):
    """argparse type: an integer >= low (a negative --seed would crash numpy, --threads 0 would
    silently mean 'every core')."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value
    return parse


_SIZE = re.compile(r"([0-9]+)([KMG]i?B?|B)?", re.IGNORECASE)


def _byte_size(text: str) -> int:
    """argparse type: a number of bytes, plain or with a K/M/G suffix (powers of 1024: 512M, 2G)."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size: write bytes, or a number with K, M or G (e.g. 512M)")
    unit = (m.group(2) or "B")[0].upper()
    return int(m.group(1)) * {"B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit]


def _add_prefix_flags(p) -> None:
    """Prefix reuse (runtime.request.prefix): on by default."""
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="do not keep prompts' KV blocks for reuse by later requests (default: kept)")
    p.add_argument("--prefix-cache-bytes", type=_byte_size, default=None, metavar="SIZE",
                   help="the prefix cache's budget, e.g. 512M or 4G (default: 2G, at most a quarter of the memory "
                        "available)")


def _add_batched_int8_flag(p) -> None:
    """Quantized artifacts' batched-step graph (graphkiln.batched_int8): off by default."""
    p.add_argument("--batched-int8", action="store_true",
                   help="int4/int8 artifacts: run steps of 4 or more token rows (concurrent requests, prefill) with "
                        "int8 weights derived at load, ~1.6x the throughput at 16 streams for ~1%% higher perplexity "
                        "and twice the weight memory (default: the artifact's blocks for every step)")


def _prefix_kwargs(args) -> dict:
    """The prefix-cache and batched-int8 flags as ``Engine.load``'s arguments."""
    if args.no_prefix_cache and args.prefix_cache_bytes is not None:
        raise GraphkilnError("--prefix-cache-bytes sizes the prefix cache that --no-prefix-cache turns off: pass one")
    return {"prefix_cache": not args.no_prefix_cache, "prefix_cache_bytes": args.prefix_cache_bytes,
            "batched_int8": args.batched_int8}


def _number(low: float, high: float = math.inf, low_open: bool = False):
    """argparse type: a finite float in [low, high] ((low, high] with low_open); NaN and inf
    are refused (a NaN --temperature silently ran greedy)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
        if not (math.isfinite(value) and (value > low if low_open else value >= low) and value <= high):
            bound = f"> {low:g}" if low_open else f">= {low:g}"
            upper = f" and <= {high:g}" if high != math.inf else ""
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}{upper}, got {text}")
        return value
    return parse


def _stop_string(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("needs a non-empty string (an empty stop string would stop after the first token)")
    return text


def _lora_pair(text: str) -> tuple[str, str]:
    """argparse type of serve's --lora: NAME=DIR, both non-empty, NAME by the rule the load route
    applies too (``runtime.lora.check_adapter_name``: NAME is what clients send as model)."""
    from graphkiln.runtime.lora.targets import check_adapter_name

    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path:
        raise argparse.ArgumentTypeError(f"{show(text)} is not NAME=DIR: give the name clients send as 'model', "
                                         "'=', then the PEFT adapter directory, e.g. --lora sql=./adapters/sql")
    try:
        check_adapter_name(name)
    except GraphkilnError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name, path


def _sha256_hex(text: str) -> str:
    from graphkiln.artifact import is_sha256

    if not is_sha256(text):
        raise argparse.ArgumentTypeError(f"'{text}' is not a sha256 (64 hex digits): copy the digest line of 'graphkiln inspect'")
    return text.lower()


def _distributed(args):
    """--distributed and the Ray placement flags as ``Engine.load``'s ``distributed``."""
    given = {flag: value for flag, value in (("--ray-address", args.ray_address), ("--stage-dirs", args.stage_dirs),
                                              ("--stage-nodes", args.stage_nodes), ("--ray-timeout", args.ray_timeout))
             if value is not None}
    if args.distributed is None:
        if given:
            raise GraphkilnError(f"{next(iter(given))} places Ray stage actors: add --distributed ray, or drop it")
        return None
    if not given:
        return args.distributed
    if args.ray_timeout is not None and args.ray_address is None:
        raise GraphkilnError("--ray-timeout bounds joining the cluster at --ray-address, and none was given: add "
                             "--ray-address, or drop --ray-timeout")
    if args.ray_address is not None and not args.ray_address.strip():
        raise GraphkilnError("--ray-address is empty: give the head's address (e.g. auto, 10.0.0.1:6379), or drop it")
    from graphkiln.runtime.backends.distributed import CONNECT_TIMEOUT_S, RayOptions

    def split(flag: str, text: str | None) -> tuple[str, ...] | None:
        if text is None:
            return None
        parts = tuple(p.strip() for p in text.split(","))
        if not all(parts):  # "" or "a,,b" would silently mean "." or drop a stage
            raise GraphkilnError(f"{flag} '{text}' has an empty entry: give one non-empty entry per stage, "
                                 "separated by commas")
        return parts

    options = RayOptions(address=args.ray_address, stage_dirs=split("--stage-dirs", args.stage_dirs),
                         stage_nodes=split("--stage-nodes", args.stage_nodes),
                         connect_timeout_s=args.ray_timeout or CONNECT_TIMEOUT_S)
    if options.address is not None:  # Ray prints nothing of its own until it has connected, or given up
        print(f"connecting to Ray at {options.address} (up to {options.connect_timeout_s:g} s) ...", file=sys.stderr,
              flush=True)
    return options


def _add_ray_flags(p) -> None:
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --distributed ray: join this Ray cluster (e.g. auto) instead of starting a local one")
    p.add_argument("--ray-timeout", default=None, type=_number(0, low_open=True), metavar="SECONDS",
                   # the default is runtime.backends.distributed.CONNECT_TIMEOUT_S (not imported here: every
                   # command builds this parser, and that module pulls in numpy)
                   help="with --ray-address: how long joining the cluster may take before it fails (default 30)")
    p.add_argument("--stage-dirs", default=None, metavar="D0,D1,...",
                   help="with --distributed ray: per stage, the artifact directory as that stage's node sees it")
    p.add_argument("--stage-nodes", default=None, metavar="N0,N1,...",
                   help="with --distributed ray: per stage, the Ray node (id or IP address) that must run it")


# (flag, its argparse dest, the flag it only means something with, that flag's dest, what it does): given
# without that flag it would be accepted and do nothing
_NEEDS = (
    ("--draft-cost", "draft_cost", "--draft", "draft", "sets the cost of a --draft model's step"),
    ("--max-loras", "max_loras", "--lora-rank", "lora_rank", "sizes the adapter slots of --lora-rank"),
)
_SAMPLING_FLAGS = (("--temperature", "temperature"), ("--top-k", "top_k"), ("--top-p", "top_p"))


def _refuse_flags_without_their_parent(args) -> None:
    """Refuse, in one line naming both flags, a flag given where it would do nothing: without the
    flag it only means something with (``_NEEDS``, ``--speculative draft`` without ``--draft``), or
    beside one that overrides it (sampling flags with ``--greedy`` or ``--temperature 0``,
    ``--logprobs`` with ``--stream``, run's and chat's ``--draft`` with another speculation). Every
    command's flags are checked here, before anything is loaded; ``--system`` without ``--chat``,
    the Ray flags and the prefix-cache flags are checked where they are read."""
    for flag, dest, parent, parent_dest, what in _NEEDS:
        if getattr(args, dest, None) is not None and getattr(args, parent_dest, None) is None:
            raise GraphkilnError(f"{flag} {what}, and no {parent} was given: add {parent}, or drop {flag}")
    sampling = [flag for flag, dest in _SAMPLING_FLAGS if getattr(args, dest, None) is not None]
    if getattr(args, "greedy", False) and [f for f in sampling if f != "--temperature" or args.temperature > 0]:
        raise GraphkilnError(f"{sampling[0]} shapes sampling, which --greedy turns off: drop one")
    if getattr(args, "temperature", None) == 0 and [f for f in sampling if f != "--temperature"]:
        shaping = next(f for f in sampling if f != "--temperature")
        raise GraphkilnError(f"{shaping} shapes sampling, which --temperature 0 turns off: drop one")
    if getattr(args, "logprobs", None) is not None and getattr(args, "stream", False):
        raise GraphkilnError("--logprobs prints each token's log-probabilities once generation ends, which --stream "
                             "does not wait for: drop one")
    if getattr(args, "speculative", None) is not None:
        from graphkiln.runtime.request.speculate import parse_speculative

        chosen = parse_speculative(args.speculative)  # a bad value: one line, before the load
        source = chosen[0] if chosen else "off"
        if source == "draft" and args.draft is None:
            raise GraphkilnError(f"--speculative {show(args.speculative, 40)} verifies a draft model's tokens, and no "
                                 "--draft was given: add --draft DIR, or use --speculative ngram")
        if source != "draft" and args.draft is not None and args.command in ("run", "chat"):
            raise GraphkilnError(f"--draft loads a draft model that --speculative {show(args.speculative, 40)} does "
                                 "not use: use --speculative draft[:K], or drop --draft")


def _check_utf8(flag: str, text: str | None) -> None:
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # argv bytes that were not UTF-8 arrive as lone surrogates
        raise GraphkilnError(f"{flag} is not UTF-8 text (byte 0x{ord(text[exc.start]) - 0xDC00:02x} at "
                             f"character {exc.start}): convert it, e.g. with iconv -t UTF-8") from None


def _generation_config(args, logprobs: int | None = None):
    """The generation flags (``_add_generation_flags``) as a GenerationConfig."""
    from graphkiln.runtime import GenerationConfig

    # Any sampling flag asks for sampling; --temperature 0 or --greedy forces greedy.
    sampling = (args.temperature is not None and args.temperature > 0) or (
        args.temperature is None and (args.top_k is not None or args.top_p is not None))
    return GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        do_sample=True if sampling else (False if args.greedy else None),
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        stop_strings=tuple(args.stop or ()), logprobs=logprobs,
        stop_token_ids=() if args.ignore_eos else None,
        speculative=args.speculative if args.speculative is not None or args.draft is None else "draft",
    )


def _load_engine(args):
    """The engine flags (``_add_engine_flags``) as ``Engine.load``'s arguments."""
    from graphkiln.runtime import Engine

    return Engine.load(args.artifact, threads=args.threads, expected_digest=args.expect_digest, target=args.target,
                       backend=args.backend, device=args.device, distributed=_distributed(args), draft=args.draft,
                       draft_cost=args.draft_cost, **_prefix_kwargs(args))


def _add_generation_flags(p) -> None:
    """How each reply is generated: run's and chat's (``_generation_config`` reads them)."""
    p.add_argument("--max-new-tokens", type=_int_at_least(0), default=None)
    p.add_argument("--temperature", type=_number(0.0), default=None, help="> 0 samples; default greedy")
    p.add_argument("--top-k", type=_int_at_least(0), default=None)
    p.add_argument("--top-p", type=_number(0.0, 1.0, low_open=True), default=None)
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    p.add_argument("--greedy", action="store_true", help="force greedy even if the artifact defaults to sampling")
    p.add_argument("--stop", action="append", type=_stop_string, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop on the artifact's EOS tokens")
    p.add_argument("--speculative", default=None, metavar="ngram[:K]|draft[:K]",
                   help="speculative decoding, K drafts per step (default 4) verified in one run: prompt lookup "
                        "(faster on text that repeats its prompt) or the --draft model's; greedy output is unchanged, "
                        "sampled output keeps its distribution")


def _add_draft_cost_flag(p) -> None:
    p.add_argument("--draft-cost", type=_number(0.0), default=None, metavar="C",
                   help="a --draft step's cost relative to the target's, which decides whether and how far drafting "
                        "pays (default: measured at load; 0 drafts whatever it costs)")


def _add_engine_flags(p) -> None:
    """Which artifact graph runs, where and how: run's and chat's (``_load_engine`` reads them)."""
    p.add_argument("--threads", type=_int_at_least(1), default=None)
    p.add_argument("--draft", default=None, metavar="DIR",
                   help="a draft artifact of the same tokenizer (a smaller or int4 export) for --speculative draft")
    _add_draft_cost_flag(p)
    _add_prefix_flags(p)
    _add_batched_int8_flag(p)
    p.add_argument("--expect-digest", type=_sha256_hex, default=None, metavar="SHA256",
                   help="refuse the artifact unless its manifest has this sha256 (the digest 'graphkiln inspect' "
                        "prints; the manifest holds every file's sha256, so this pins the whole artifact)")
    p.add_argument("--target", default=None, choices=["portable", "onnxruntime", "tensorrt"],
                   help="run the graph exported for this target (default: the artifact's best graph for onnxruntime)")
    p.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "tensorrt"],
                   help="what runs the graph: onnxruntime (default) or the TensorRT engine 'graphkiln build' made")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="cpu (default for onnxruntime) or cuda (onnxruntime-gpu with CUDA graphs: pip install "
                        "'graphkiln[cuda]', see README; tensorrt always runs on cuda)")
    p.add_argument("--distributed", default=None, choices=["ray"],
                   help="run a pipeline-staged artifact (export --stages) with each stage in its own Ray actor "
                        "(pip install 'graphkiln[distributed]'; a local Ray cluster unless this process joins one)")
    _add_ray_flags(p)


def _run(args) -> int:
    for i, text in enumerate(args.prompt or []):
        _check_utf8(f"--prompt {i + 1}", text)
    _check_utf8("--system", args.system)
    if args.system is not None and not args.chat:
        raise GraphkilnError("--system is the system message of --chat: add --chat, or drop --system")
    if args.chat and args.prompt_ids:
        raise GraphkilnError("--chat renders --prompt text with the chat template, and --prompt-ids are already "
                             "tokens: give the text as --prompt, or drop --chat")
    prompts = list(args.prompt or []) + [_parse_ids(t) for t in args.prompt_ids or []]
    if not prompts:
        raise GraphkilnError("nothing to run: give --prompt TEXT or --prompt-ids IDS")
    if args.image and len(prompts) > 1:
        raise GraphkilnError(f"--image goes with one prompt (every --image belongs to it), but {len(prompts)} prompts "
                             "were given: run each prompt with its images separately")
    images = [list(args.image)] if args.image else None
    adapter = _lora_dir(args.lora)  # checked before the (long) load
    engine = _load_engine(args)
    if adapter is not None:
        engine.load_adapter(*adapter)  # an artifact without LoRA inputs: one line naming --lora-rank
    if args.chat:  # each prompt one user message of its own conversation, rendered to ids (see graphkiln.chat)
        from graphkiln.chat import Conversation, load_template

        template = load_template(engine)
        prompts = [template.encode(Conversation(args.system).messages(text)) for text in prompts]
    config = _generation_config(args, logprobs=args.logprobs)
    if adapter is not None:
        config = dataclasses.replace(config, adapter=adapter[0])
    show_ids = engine.tokenizer is None or args.show_ids
    if args.stream:
        last = None
        for ev in engine.stream(prompts, config, images=images):
            if len(prompts) > 1 and ev.request != last:
                print(f"\n[{ev.request}] ", end="")
                last = ev.request
            print(f" {ev.token_id}" if show_ids else ev.text, end="", flush=True)
        print()
        return 0
    for i, res in enumerate(engine.generate(prompts, config, images=images)):
        prefix = f"[{i}] " if len(prompts) > 1 else ""
        print(prefix + (" ".join(map(str, res.token_ids)) if show_ids else res.text))
        if args.logprobs is not None:
            for lp in res.logprobs:
                alts = ", ".join(f"{t}:{v:.3f}" for t, v in lp.top)
                print(f"  token {lp.token_id} logprob {lp.logprob:.4f}" + (f"  top: {alts}" if alts else ""))
    return 0


def _lora_dir(text: str | None) -> tuple[str, Path] | None:
    """run's --lora DIR as (adapter name: the directory's name, directory)."""
    if text is None:
        return None
    from graphkiln.runtime.lora.adapter_dir import adapter_directory

    _check_utf8("--lora", text)
    path = adapter_directory(text)  # only a stat: a FIFO or an over-long name is one line, never a hang
    name = path.resolve().name
    if not name:
        raise GraphkilnError(f"--lora {show(text)}: the adapter is named after its directory, and this one has no "
                             "name: give the adapter's own directory")
    return name, path


def _chat(args) -> int:
    from graphkiln.chat import load_template, run_chat

    _check_utf8("--system", args.system)
    config = _generation_config(args)  # refuses bad settings before the artifact is loaded
    engine = _load_engine(args)
    return run_chat(engine, load_template(engine), config, system=args.system)


def _verify(args) -> int:
    from graphkiln.export.verify import verify_artifact

    from graphkiln.runtime import Engine

    # every decoder graph the artifact carries (one per export target), each as onnxruntime runs it
    engine = Engine.load(args.artifact, target=args.target)
    # a staged artifact: its first stage's graph per target stands for that target's chain
    first = engine.manifest.stages[0].graph if engine.manifest.stages else "decoder"
    graphs = [engine.decoder.spec] + ([] if args.target else [
        g for g in engine.manifest.graphs if g.name == first and g.target != engine.decoder.spec.target])
    passed = True
    for i, graph in enumerate(graphs):
        if i:
            engine = Engine.load(args.artifact, target=graph.target, check_files=False)  # hashed by the first load
        report = verify_artifact(args.artifact, args.reference, steps=args.steps, seed=args.seed, atol=args.atol,
                                 engine=engine, text=args.text, streamed=True if args.streamed_reference else None)
        print((f"{graph.file} (target {graph.target}): " if len(graphs) > 1 else "") + report.summary())
        passed = passed and report.passed
    return 0 if passed else 1


def _check(args) -> int:
    from graphkiln.export.trt_check import check_artifact

    report = check_artifact(args.artifact)  # backend: tensorrt, the only choice
    print(report.summary())
    return 0 if report.passed else 1


def _build(args) -> int:
    from graphkiln.trt_build import build

    result = build(args.artifact, backend=args.backend, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                   log=lambda line: print(line, flush=True))
    print(result.summary())
    return 0


def _port(text: str) -> int:
    value = _int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port 0..65535, got {value}")
    return value


def _serve(args) -> int:
    import os

    try:
        from graphkiln.serve.server import ServeConfig, serve
    except ImportError as exc:
        raise GraphkilnError(f"graphkiln serve needs {exc.name}: pip install fastapi uvicorn prometheus_client jinja2") from None
    key, source = (args.api_key, "--api-key") if args.api_key is not None else (
        os.environ.get("GRAPHKILN_API_KEY"), "GRAPHKILN_API_KEY")
    if key is not None and not key.strip():
        raise GraphkilnError(f"{source} is empty: give a non-empty key, or unset it to serve without one")
    return serve(ServeConfig(
        artifact=args.artifact, host=args.host, port=args.port, api_key=key, model_name=args.model_name,
        max_queue=args.max_queue, max_batch=args.max_batch, step_tokens=args.step_tokens, threads=args.threads,
        drain_s=args.drain_timeout, expect_digest=args.expect_digest, target=args.target,
        distributed=_distributed(args), log_level=args.log_level, lora=_lora_pairs(args.lora),
        lora_updates=args.allow_lora_updates, speculative=args.speculative, draft=args.draft, draft_cost=args.draft_cost,
        **_prefix_kwargs(args)))


def _lora_pairs(pairs) -> tuple[tuple[str, str], ...]:
    """serve's --lora NAME=DIR values, each name once (checked before anything is loaded)."""
    pairs = tuple(pairs or ())
    for i, (name, path) in enumerate(pairs):
        _check_utf8(f"--lora {i + 1}", f"{name}={path}")
        if any(other == name for other, _ in pairs[:i]):
            raise GraphkilnError(f"--lora: the name {name!r} is given twice: give each adapter its own NAME")
    return pairs


def _demo(args) -> int:
    from graphkiln.demo.run import run_demo

    return run_demo(workdir=Path(args.workdir) if args.workdir else None, keep=args.keep)


# Top-level modules graphkiln imports that an extra of pyproject.toml brings, not the base install
# (which is all `pip install graphkiln` gives): a command needing one names the extra to install.
_EXTRA_OF = {"torch": "export", "transformers": "export", "safetensors": "export", "onnx": "export",
             "onnxscript": "export", "regex": "export", "triton": "tensorrt", "tensorrt": "tensorrt",
             "tensorrt_bindings": "tensorrt", "cuda": "cuda", "ray": "distributed"}


class StdoutFailed(Exception):
    """Standard output refused a write (closed pipe, full disk): ``errno`` says why."""

    def __init__(self, errno_: int) -> None:
        super().__init__(errno_)
        self.errno = errno_


class _Stdout:
    """sys.stdout whose failed writes raise ``StdoutFailed``, so an OSError of the output is
    told apart from one of the artifact or checkpoint being read."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise StdoutFailed(exc.errno or errno.EIO) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise StdoutFailed(exc.errno or errno.EIO) from None

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def _guarded_stdout():
    if sys.stdout is None or isinstance(sys.stdout, _Stdout):  # no stdout at all (>&-): print writes nothing
        yield
        return
    real, sys.stdout = sys.stdout, _Stdout(sys.stdout)
    try:
        yield
    finally:
        sys.stdout = real


def _flush_stdout() -> None:
    if sys.stdout is not None:
        sys.stdout.flush()


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.__stdout__.fileno())
        os.close(devnull)
    except (OSError, AttributeError, ValueError):
        pass


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
    e.add_argument("--quant", default=None, choices=["int4", "int8"],
                   help="weight-only quantization of the Linear layers and the embedding (block-wise, "
                        "com.microsoft.MatMulNBits / GatherBlockQuantized; onnxruntime target only). A GGUF or "
                        "GPTQ/AWQ checkpoint keeps its own blocks where they map exactly")
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
    e.add_argument("--lora-rank", type=int, default=None, metavar="R",
                   help="serve LoRA adapters: per targeted projection, adapter stacks of rank R (the largest "
                        "adapter rank accepted) become graph inputs, each request choosing its adapter or none")
    e.add_argument("--lora-targets", default=None, metavar="q,k,v,o,gate,up,down",
                   help="the projections adapters may change (default: all of these the model has)")
    e.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="adapter slots loaded at once (default 4; least recently used replaced)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    e.set_defaults(fn=_export)

    i = sub.add_parser("inspect", help="summarise an artifact")
    i.add_argument("artifact")
    i.add_argument("--json", action="store_true", help="print the raw manifest")
    i.set_defaults(fn=_inspect)

    r = sub.add_parser("run", help="generate from an artifact")
    r.add_argument("artifact")
    r.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    r.add_argument("--prompt-ids", action="append", help="prompt token ids, e.g. '1,2,3' (repeatable)")
    r.add_argument("--image", action="append", metavar="PATH",
                   help="an image for a vision-language artifact (repeatable, in the order of the prompt's image "
                        "tokens, e.g. <image> for LLaVA; all for the one prompt)")
    _add_generation_flags(r)
    r.add_argument("--logprobs", type=_int_at_least(0), default=None, metavar="N", help="print log-probabilities with N alternatives")
    r.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    r.add_argument("--show-ids", action="store_true", help="print token ids instead of text")
    r.add_argument("--chat", action="store_true",
                   help="apply the artifact's chat template: each --prompt is one user message (its reply's turn "
                        "opened), as 'graphkiln chat' sends it")
    r.add_argument("--system", default=None, metavar="TEXT", help="with --chat: the system message")
    r.add_argument("--lora", default=None, metavar="DIR",
                   help="generate with this PEFT LoRA adapter directory (adapter_config.json + "
                        "adapter_model.safetensors) applied; the artifact must be exported with --lora-rank")
    _add_engine_flags(r)
    r.set_defaults(fn=_run)

    t = sub.add_parser("chat", help="converse with an artifact over its chat template (a terminal, or lines on stdin)")
    t.add_argument("artifact")
    t.add_argument("--system", default=None, metavar="TEXT", help="the system message, kept by /reset")
    _add_generation_flags(t)
    _add_engine_flags(t)
    t.set_defaults(fn=_chat)

    v = sub.add_parser("verify", help="compare an artifact with its transformers reference")
    v.add_argument("artifact")
    v.add_argument("--reference", required=True, help="the checkpoint the artifact was exported from")
    v.add_argument("--steps", type=_int_at_least(1), default=32)
    v.add_argument("--seed", type=_int_at_least(0), default=0)
    v.add_argument("--atol", type=_number(0.0), default=None, help="default: 1e-4 for fp32 artifacts")
    v.add_argument("--target", default=None, choices=["portable", "onnxruntime", "tensorrt"],
                   help="verify only the graph exported for this target (default: every graph in the artifact)")
    v.add_argument("--text", default=None, metavar="FILE",
                   help="quantized artifacts: the UTF-8 text whose perplexity is compared with the reference's "
                        "(default: built-in English prose)")
    v.add_argument("--streamed-reference", action="store_true",
                   help="compare with graphkiln's torch decoder run one layer at a time from the checkpoint instead of "
                        "transformers' whole fp32 model (the default when that would not fit in memory)")
    v.set_defaults(fn=_verify)

    c = sub.add_parser("check", help="check an artifact's graphs against a backend's published operator support")
    c.add_argument("artifact")
    c.add_argument("--backend", required=True, choices=["tensorrt"],
                   help="tensorrt: every node against the TensorRT ONNX parser's operator list (vendored, with its "
                        "version); exit 1 if anything would fail")
    c.set_defaults(fn=_check)

    b = sub.add_parser("build", help="build a TensorRT engine for an artifact's tensorrt-target graph (NVIDIA GPU)")
    b.add_argument("artifact")
    b.add_argument("--backend", required=True, choices=["tensorrt"],
                   help="tensorrt: TensorRT 11 engine (plan + timing cache) written into the artifact's "
                        "engines/tensorrt/ and recorded in its manifest (which changes its digest)")
    b.add_argument("--max-batch", type=_int_at_least(1), default=None, metavar="N",
                   help="most requests served at once: the state pools' slots (default 8)")
    b.add_argument("--max-seq-len", type=_int_at_least(2), default=None, metavar="L",
                   help="most tokens per request, prompt included: the state pools' capacity (default and upper "
                        "bound: the artifact's max sequence length)")
    b.set_defaults(fn=_build)

    s = sub.add_parser("serve", help="serve an artifact over an OpenAI-compatible HTTP API (continuous batching)")
    s.add_argument("artifact")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000; 0: any free port)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: the "
                        "GRAPHKILN_API_KEY environment variable, else no key)")
    s.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model id clients send and /v1/models lists (default: the artifact directory's name)")
    s.add_argument("--max-queue", type=_int_at_least(1), default=64, metavar="N",
                   help="requests waiting for a slot before new ones get 429 (default 64)")
    s.add_argument("--max-batch", type=_int_at_least(1), default=None, metavar="N",
                   help="requests generating at once: the state pools' slots (default 16, fewer if memory is short)")
    s.add_argument("--step-tokens", type=_int_at_least(2), default=256, metavar="N",
                   help="tokens per scheduler step: one per generating request, the rest prefill new prompts in "
                        "chunks (default 256)")
    s.add_argument("--threads", type=_int_at_least(1), default=None, help="onnxruntime threads (default: every core)")
    _add_prefix_flags(s)
    _add_batched_int8_flag(s)
    s.add_argument("--drain-timeout", type=_number(0.0), default=30.0, metavar="SECONDS",
                   help="on SIGTERM/Ctrl-C, how long in-flight requests may run before they are cancelled (default 30)")
    s.add_argument("--expect-digest", type=_sha256_hex, default=None, metavar="SHA256",
                   help="refuse the artifact unless its manifest has this sha256 (as for run)")
    s.add_argument("--target", default=None, choices=["portable", "onnxruntime", "tensorrt"],
                   help="serve the graph exported for this target (default: the best one for onnxruntime)")
    s.add_argument("--distributed", default=None, choices=["ray"],
                   help="run a staged artifact's stages as Ray actors (pip install 'graphkiln[distributed]')")
    _add_ray_flags(s)
    s.add_argument("--lora", action="append", type=_lora_pair, default=None, metavar="NAME=DIR",
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
    _add_draft_cost_flag(s)
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(fn=_serve)

    d = sub.add_parser("demo", help="build, export, verify and run a small random Llama (no network)")
    d.add_argument("--workdir", default=None, metavar="DIR",
                   help="put the demo's files in a new DIR/graphkiln-demo-XXXXXXXX and keep them; nothing else "
                        "in DIR is touched (default: a temporary directory, removed unless --keep)")
    d.add_argument("--keep", action="store_true", help="keep the demo files")
    d.set_defaults(fn=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    from graphkiln.publish import Interrupted, interrupt_arrived, termination_signals_interrupt

    # SIGTERM and SIGHUP unwind like Ctrl-C, so the cleanup that removes a half-written
    # artifact runs for them too; the previous handlers are back once main returns.
    with termination_signals_interrupt(), _guarded_stdout():
        try:
            try:
                args = build_parser().parse_args(argv)
            except SystemExit as exc:  # --help, or a usage error already printed as one line
                _flush_stdout()
                return exc.code if isinstance(exc.code, int) else 2
            try:
                _refuse_flags_without_their_parent(args)
                code = args.fn(args)
                _flush_stdout()  # what is still buffered fails here, not at the interpreter's exit
                return code
            except GraphkilnError as exc:
                interrupted = interrupt_arrived()  # native code swallowed the interrupt and failed instead
                if interrupted is not None:
                    raise interrupted from None
                print(f"error: {exc}", file=sys.stderr)
                return 2
            except Exception as exc:
                # a signal's exception caught by library code and turned into its own (onnxruntime's
                # import makes an Interrupted in its native module an ImportError) is still the signal
                interrupted = interrupt_arrived()
                if interrupted is not None:
                    raise interrupted from None
                extra = _EXTRA_OF.get((exc.name or "").partition(".")[0]) if isinstance(exc, ModuleNotFoundError) else None
                if extra is None:  # a bug, or a module of the base install missing (a broken install)
                    raise
                print(f"error: graphkiln {args.command} needs {exc.name}, which graphkiln's '{extra}' extra "
                      f"installs: pip install 'graphkiln[{extra}]'", file=sys.stderr)
                return 2
        except Interrupted as exc:
            print(f"error: interrupted ({exc.signal_name})", file=sys.stderr)
            return 128 + exc.signum
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr)
            return 130
        except StdoutFailed as exc:
            _silence_stdout()  # the interpreter's last flush would fail (and print) again
            if exc.errno == errno.EPIPE:  # the reader left (`| head`): quiet, as Unix tools end on SIGPIPE
                return 128 + 13
            print(f"error: cannot write to standard output ({os.strerror(exc.errno)}): free space or "
                  "redirect the output elsewhere", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
