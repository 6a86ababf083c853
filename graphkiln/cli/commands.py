"""The commands' bodies (``do_<command>``): each reads its parsed arguments, calls graphkiln and prints
what the command prints. Heavy modules are imported inside the bodies, so ``graphkiln --help`` stays
fast.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from graphkiln.cli.arg_types import check_utf8, parse_ids
from graphkiln.cli.flags import distributed, generation_config, load_engine, prefix_kwargs
from graphkiln.errors import GraphkilnError
from graphkiln.untrusted import show


def do_export(args) -> int:
    from graphkiln.export.pipeline import ExportOptions, export_model

    export_model(args.model, Path(args.output), ExportOptions(
        dtype=args.dtype, max_seq_len=args.max_seq_len, opset=args.opset, overwrite=args.overwrite,
        target=args.target, quant=args.quant, quant_block_size=args.quant_block_size,
        expert_quant=getattr(args, "expert_quant", None),
        quant_symmetric=args.quant_scheme == "sym", quant_method=args.quant_method, stages=args.stages, stage_layers=args.stage_layers,
        return_hidden_states=args.return_hidden_states, task=args.task, pooling=args.pooling,
        normalize=args.normalize, lora_rank=args.lora_rank, lora_targets=args.lora_targets,
        max_loras=ExportOptions.max_loras if args.max_loras is None else args.max_loras))
    return 0


def do_inspect(args) -> int:
    from graphkiln.summary import describe
    from graphkiln.manifest import Manifest

    root = Path(args.artifact)
    manifest, digest = Manifest.read_with_digest(root)  # validated, paths included, before anything is described
    print(manifest.to_json() if args.json else describe(root, manifest, digest))
    return 0


def do_run(args) -> int:
    for i, text in enumerate(args.prompt or []):
        check_utf8(f"--prompt {i + 1}", text)
    check_utf8("--system", args.system)
    if args.system is not None and not args.chat:
        raise GraphkilnError("--system is the system message of --chat: add --chat, or drop --system")
    if args.chat and args.prompt_ids:
        raise GraphkilnError("--chat renders --prompt text with the chat template, and --prompt-ids are already "
                             "tokens: give the text as --prompt, or drop --chat")
    prompts = list(args.prompt or []) + [parse_ids(t) for t in args.prompt_ids or []]
    if not prompts:
        raise GraphkilnError("nothing to run: give --prompt TEXT or --prompt-ids IDS")
    if args.image and len(prompts) > 1:
        raise GraphkilnError(f"--image goes with one prompt (every --image belongs to it), but {len(prompts)} prompts "
                             "were given: run each prompt with its images separately")
    images = [list(args.image)] if args.image else None
    adapter = _lora_dir(args.lora)  # checked before the (long) load
    engine = load_engine(args)
    if adapter is not None:
        engine.load_adapter(*adapter)  # an artifact without LoRA inputs: one line naming --lora-rank
    if args.chat:  # each prompt one user message of its own conversation, rendered to ids (see graphkiln.chat)
        from graphkiln.chat import Conversation, load_template

        template = load_template(engine)
        prompts = [template.encode(Conversation(args.system).messages(text)) for text in prompts]
    config = generation_config(args, logprobs=args.logprobs)
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

    check_utf8("--lora", text)
    path = adapter_directory(text)  # only a stat: a FIFO or an over-long name is one line, never a hang
    name = path.resolve().name
    if not name:
        raise GraphkilnError(f"--lora {show(text)}: the adapter is named after its directory, and this one has no "
                             "name: give the adapter's own directory")
    return name, path


def do_chat(args) -> int:
    from graphkiln.chat import load_template, run_chat

    check_utf8("--system", args.system)
    config = generation_config(args)  # refuses bad settings before the artifact is loaded
    engine = load_engine(args)
    return run_chat(engine, load_template(engine), config, system=args.system)


def do_verify(args) -> int:
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


def do_check(args) -> int:
    from graphkiln.export.trt_check import check_artifact

    report = check_artifact(args.artifact)  # backend: tensorrt, the only choice
    print(report.summary())
    return 0 if report.passed else 1


def do_build(args) -> int:
    from graphkiln.trt_build import build

    result = build(args.artifact, backend=args.backend, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                   log=lambda line: print(line, flush=True))
    print(result.summary())
    return 0


def do_serve(args) -> int:
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
        distributed=distributed(args), log_level=args.log_level, lora=_lora_pairs(args.lora),
        lora_updates=args.allow_lora_updates, speculative=args.speculative, draft=args.draft, draft_cost=args.draft_cost,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser, **prefix_kwargs(args)))


def _lora_pairs(pairs) -> tuple[tuple[str, str], ...]:
    """serve's --lora NAME=DIR values, each name once (checked before anything is loaded)."""
    pairs = tuple(pairs or ())
    for i, (name, path) in enumerate(pairs):
        check_utf8(f"--lora {i + 1}", f"{name}={path}")
        if any(other == name for other, _ in pairs[:i]):
            raise GraphkilnError(f"--lora: the name {name!r} is given twice: give each adapter its own NAME")
    return pairs


def do_demo(args) -> int:
    from graphkiln.demo.run import run_demo

    return run_demo(workdir=Path(args.workdir) if args.workdir else None, keep=args.keep)
