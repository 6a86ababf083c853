"""Flag groups several commands share (generation, engine, prefix cache, batched int8, Ray
placement, draft cost): how each group is added to a parser and how its values are read, and the
refusal of a flag given where it would do nothing.
"""

from __future__ import annotations

import sys

from graphkiln.cli.arg_types import byte_size, int_at_least, number, sha256_hex, stop_string
from graphkiln.errors import GraphkilnError
from graphkiln.untrusted import show


def add_prefix_flags(p) -> None:
    """Prefix reuse (runtime.request.prefix): on by default."""
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="do not keep prompts' KV blocks for reuse by later requests (default: kept)")
    p.add_argument("--prefix-cache-bytes", type=byte_size, default=None, metavar="SIZE",
                   help="the prefix cache's budget, e.g. 512M or 4G (default: 2G, at most a quarter of the memory "
                        "available)")


def add_batched_int8_flag(p) -> None:
    """Quantized artifacts' batched-step graph (graphkiln.batched_int8): off by default."""
    p.add_argument("--batched-int8", action="store_true",
                   help="int4/int8 artifacts: run steps of 4 or more token rows (concurrent requests, prefill) with "
                        "int8 weights derived at load, ~1.6x the throughput at 16 streams for ~1%% higher perplexity "
                        "and twice the weight memory (default: the artifact's blocks for every step)")


def prefix_kwargs(args) -> dict:
    """The prefix-cache and batched-int8 flags as ``Engine.load``'s arguments."""
    if args.no_prefix_cache and args.prefix_cache_bytes is not None:
        raise GraphkilnError("--prefix-cache-bytes sizes the prefix cache that --no-prefix-cache turns off: pass one")
    return {"prefix_cache": not args.no_prefix_cache, "prefix_cache_bytes": args.prefix_cache_bytes,
            "batched_int8": args.batched_int8}


def distributed(args):
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


def add_ray_flags(p) -> None:
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --distributed ray: join this Ray cluster (e.g. auto) instead of starting a local one")
    p.add_argument("--ray-timeout", default=None, type=number(0, low_open=True), metavar="SECONDS",
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


def refuse_flags_without_their_parent(args) -> None:
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

        try:  # a bad value: one line, before the load, naming the flag
            chosen = parse_speculative(args.speculative)
        except GraphkilnError as exc:
            raise GraphkilnError(f"--{exc}") from None  # the engine's line names the field: "speculative ..."
        source = chosen[0] if chosen else "off"
        if source == "draft" and args.draft is None:
            raise GraphkilnError(f"--speculative {show(args.speculative, 40)} verifies a draft model's tokens, and no "
                                 "--draft was given: add --draft DIR, or use --speculative ngram")
        if source != "draft" and args.draft is not None and args.command in ("run", "chat"):
            raise GraphkilnError(f"--draft loads a draft model that --speculative {show(args.speculative, 40)} does "
                                 "not use: use --speculative draft[:K], or drop --draft")


def generation_config(args, logprobs: int | None = None):
    """The generation flags (``add_generation_flags``) as a GenerationConfig."""
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


def load_engine(args):
    """The engine flags (``add_engine_flags``) as ``Engine.load``'s arguments."""
    from graphkiln.runtime import Engine

    return Engine.load(args.artifact, threads=args.threads, expected_digest=args.expect_digest, target=args.target,
                       backend=args.backend, device=args.device, distributed=distributed(args), draft=args.draft,
                       draft_cost=args.draft_cost, **prefix_kwargs(args))


def add_generation_flags(p) -> None:
    """How each reply is generated: run's and chat's (``generation_config`` reads them)."""
    p.add_argument("--max-new-tokens", type=int_at_least(0), default=None)
    p.add_argument("--temperature", type=number(0.0), default=None, help="> 0 samples; default greedy")
    p.add_argument("--top-k", type=int_at_least(0), default=None)
    p.add_argument("--top-p", type=number(0.0, 1.0, low_open=True), default=None)
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--greedy", action="store_true", help="force greedy even if the artifact defaults to sampling")
    p.add_argument("--stop", action="append", type=stop_string, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop on the artifact's EOS tokens")
    p.add_argument("--speculative", default=None, metavar="ngram[:K]|draft[:K]",
                   help="speculative decoding, K drafts per step (default 4) verified in one run: prompt lookup "
                        "(faster on text that repeats its prompt) or the --draft model's; greedy output is unchanged, "
                        "sampled output keeps its distribution")


def add_draft_cost_flag(p) -> None:
    p.add_argument("--draft-cost", type=number(0.0), default=None, metavar="C",
                   help="a --draft step's cost relative to the target's, which decides whether and how far drafting "
                        "pays (default: measured at load; 0 drafts whatever it costs)")


def add_engine_flags(p) -> None:
    """Which artifact graph runs, where and how: run's and chat's (``load_engine`` reads them)."""
    p.add_argument("--threads", type=int_at_least(1), default=None)
    p.add_argument("--draft", default=None, metavar="DIR",
                   help="a draft artifact of the same tokenizer (a smaller or int4 export) for --speculative draft")
    add_draft_cost_flag(p)
    add_prefix_flags(p)
    add_batched_int8_flag(p)
    p.add_argument("--expect-digest", type=sha256_hex, default=None, metavar="SHA256",
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
    add_ray_flags(p)
