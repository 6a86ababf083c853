#!/usr/bin/env python
"""Tool-call cost on the real checkpoint (SmolLM2-135M-Instruct, scripts/real_checkpoint.py).

Decode tokens/s after the prefill (timed alone and taken off), greedy, one request, the same chat
prompt offering three tools:
1. tool_choice required: the Hermes call grammar (graphkiln.runtime.tools, what the server
   constrains with) over the three tools, beside the same request unconstrained for as many
   tokens (end-of-text ignored);
2. tool_choice auto: the grammar that lets free text run until a call opens, on an answer that
   opens none, beside the same free generation (what every auto request pays per token of text);
3. the grammar's compile time (the first request with a tool list pays it; cached per engine).

    .venv/bin/python scripts/bench_tools.py [--work /work/bench-tmp/tools] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import exported, real_checkpoint, timed_generate  # noqa: E402

TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "required": ["city", "unit", "days"], "properties": {
        "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}}}},
    {"name": "search_flights", "parameters": {"type": "object", "required": ["origin", "destination", "date"],
                                              "properties": {"origin": {"type": "string", "maxLength": 3},
                                                             "destination": {"type": "string", "maxLength": 3},
                                                             "date": {"type": "string", "maxLength": 10},
                                                             "passengers": {"type": "integer", "minimum": 1}}}},
    {"name": "send_email", "parameters": {"type": "object", "required": ["to", "subject", "body"], "properties": {
        "to": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
        "subject": {"type": "string", "maxLength": 60}, "body": {"type": "string", "maxLength": 400}}}},
]
SYSTEM = ("You can call these functions; call one as <tool_call>\n{\"name\": ..., \"arguments\": {...}}\n"
          "</tool_call>.\n" + "\n".join(json.dumps(t) for t in TOOLS))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/work/bench-tmp/tools"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    from graphkiln.runtime import Engine, GenerationConfig
    from graphkiln.runtime import tools as T

    art = exported(real_checkpoint(args.work), args.work / "fp32", max_seq_len=1024, overwrite=True)
    engine = Engine.load(art, threads=args.threads)
    tools = [T.Tool(t["name"], t["parameters"], strict=True) for t in TOOLS]  # strict: no unlisted keys
    fmt = T.FORMATS["hermes"](T.base.special_tokens(engine.tokenizer.backend))
    from graphkiln.runtime.request.chat_template import ChatTemplate

    chat = ChatTemplate.load(art, tuple(engine.manifest.tokenizer_files), tokenizer=engine.tokenizer)
    prompt = chat.render([{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": "What is the weather in Paris for the next three days?"}])
    required, auto = fmt.grammar(tools, True, False), fmt.grammar(tools, False, True)
    for name, lark in (("required", required), ("auto", auto)):
        t = time.perf_counter()
        engine.prep.resolve(GenerationConfig(grammar=lark))
        print(f"{name} grammar ({len(lark):,} characters) compiled in {(time.perf_counter() - t) * 1e3:.0f} ms")
    print(f"SmolLM2-135M fp32, {args.threads} threads, prompt {len(engine.tokenizer.encode(prompt, False))} tokens")

    for name, lark, budget in (("required", required, 160), ("auto", auto, 96)):
        constrained, free, n = [], [], 0
        cfg = GenerationConfig(max_new_tokens=budget, grammar=lark, do_sample=False)
        timed_generate(engine, [prompt], cfg)  # warm-up
        for _ in range(args.repeats):
            rate, out = timed_generate(engine, [prompt], cfg)
            n = len(out[0].token_ids)
            constrained.append(rate)
            free.append(timed_generate(engine, [prompt], GenerationConfig(max_new_tokens=n, stop_token_ids=(),
                                                                          do_sample=False))[0])
        parsed = T.parse_all(fmt.parser(tools), [(out[0].text, -1)])
        c, f = statistics.median(constrained), statistics.median(free)
        print(f"{name:9s} {n:4d} tokens: constrained {c:.1f} tok/s, free {f:.1f} tok/s ({c / f:.3f}x, "
              f"{(f / c - 1) * 100:.1f}% per token); calls {[(k.name, k.arguments) for k in parsed.calls]}, "
              f"content {parsed.content[:60]!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
