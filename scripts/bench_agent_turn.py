#!/usr/bin/env python
"""An agent turn's first-token latency through ``graphkiln serve``'s ``/v1/responses`` on the real
checkpoint (SmolLM2-135M-Instruct, scripts/real_checkpoint.py, exported with 4,096 positions), with
a Hermes-style tool template that writes every tool's JSON schema into the prompt (as Qwen2.5's
does) and a tool list of ~2k tokens.

Each round: a fresh prompt head (a distinct first line, so nothing of an earlier round is reused)
-> turn 1: instructions + tools + the user's question, ``tool_choice: required`` (the call grammar
over all tools compiled for the request) -> turn 2: the same plus the call and its output as input
items (``function_call``, ``function_call_output``), the tool result turn. Each turn is timed as a
request for one output token (``max_output_tokens: 1``): the prefill, one step, the HTTP and
template work, i.e. the first-token latency a client sees. Turn 2 runs with prefix reuse (the
server's default) and again on a server without it (``--no-prefix-cache``), same prompts.

    .venv/bin/python scripts/bench_agent_turn.py [--work /work/bench-tmp/agent] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import exported, real_checkpoint  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m.role == 'system' %}<|im_start|>system\n{{ m.content }}"
    "{% if tools %}\n\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Call a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>{% endif %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}"
    "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tools(count: int) -> list[dict]:
    """``count`` realistic function tools (a description and 3-4 typed, described parameters)."""
    out = []
    for i in range(count):
        out.append({"type": "function", "name": f"service_{i}_lookup",
                    "description": f"Look up records in internal service number {i}: returns matching entries with "
                                   "their identifiers, owners and last-modified dates.",
                    "parameters": {"type": "object", "properties": {
                        "query": {"type": "string", "description": "free-text search terms", "maxLength": 24},
                        "limit": {"type": "integer", "minimum": 1, "maximum": 50, "description": "entries at most"},
                        "order": {"enum": ["newest", "oldest", "relevance"], "description": "sort order"}},
                        "required": ["query", "limit"], "additionalProperties": False},
                    "strict": True})
    return out


def with_template(art: Path) -> Path:
    """The artifact with TEMPLATE as its chat_template.jinja (listed and hashed in its manifest)."""
    (art / "chat_template.jinja").write_text(TEMPLATE)
    manifest = json.loads((art / "manifest.json").read_text())
    if "chat_template.jinja" not in manifest["tokenizer_files"]:
        manifest["tokenizer_files"].append("chat_template.jinja")
    manifest["files"]["chat_template.jinja"] = hashlib.sha256(TEMPLATE.encode()).hexdigest()
    (art / "manifest.json").write_text(json.dumps(manifest))
    return art


@contextmanager
def serving(art: Path, threads: int, prefix_cache: bool):
    from graphkiln.runtime import Engine
    from graphkiln.runtime.request.scheduler import Scheduler
    from graphkiln.serve.app import AppOptions
    from graphkiln.serve.server import bind, make_server

    engine = Engine.load(art, threads=threads, prefix_cache=prefix_cache)
    scheduler = Scheduler(engine, max_batch=2)
    sock = bind("127.0.0.1", 0)
    server = make_server(scheduler, engine, AppOptions(model_name="smol", tool_call_parser="hermes"), drain_s=5,
                         log_level="warning")
    scheduler.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def turn(client, head: str, offered: list[dict], call=None) -> tuple[float, object]:
    items = [{"role": "user", "content": "Find the three newest entries about invoices in service 7."}]
    if call is not None:
        items += [call, {"type": "function_call_output", "call_id": call["call_id"], "output": "[]"}]
    kw = dict(model="smol", instructions=head + "You are an operations assistant. Use the tools.", input=items,
              tools=offered, temperature=0)
    t = time.perf_counter()
    r = client.responses.create(max_output_tokens=1, **kw)
    elapsed = time.perf_counter() - t
    return elapsed, r, kw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/work/bench-tmp/agent"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tools", type=int, default=16)
    args = ap.parse_args()
    import openai

    ckpt = real_checkpoint(args.work)
    art = with_template(exported(ckpt, args.work / "art-4k", max_seq_len=4096))
    offered = tools(args.tools)
    from graphkiln.runtime.request.tokenizer import Tokenizer

    tok = Tokenizer(art / "tokenizer.json")
    tool_tokens = len(tok.encode("".join(json.dumps(t) + "\n" for t in offered), add_special_tokens=False))
    print(f"{len(offered)} tools, {tool_tokens} tokens as the template writes them")
    results = {True: ([], [], []), False: ([], [], [])}
    calls = {}
    for cache in (True, False):
        with serving(art, args.threads, cache) as url:
            client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)
            turn(client, "Warm-up round.\n", offered)  # the template worker, the grammar's tokenizer
            for k in range(args.rounds):
                head = f"Session {k} of the benchmark.\n"
                first, r1, kw = turn(client, head, offered)
                if k not in calls:  # the call the model makes (the same for both servers: greedy)
                    made = client.responses.create(max_output_tokens=200, tool_choice="required", **kw).output[-1]
                    calls[k] = made.model_dump(exclude_none=True)
                second, r2, _ = turn(client, head, offered, calls[k])
                results[cache][0].append(first)
                results[cache][1].append(second)
                results[cache][2].append((r1.usage.input_tokens, r2.usage.input_tokens,
                                          r2.usage.input_tokens_details.cached_tokens))
    for cache in (True, False):
        t1, t2, usage = results[cache]
        print(f"prefix cache {'on ' if cache else 'off'}: turn 1 {statistics.median(t1):.3f} s "
              f"(prompt {usage[0][0]} tokens), turn 2 {statistics.median(t2):.3f} s (prompt {usage[0][1]} tokens, "
              f"{usage[0][2]} cached); runs {[f'{x:.3f}' for x in t1]} / {[f'{x:.3f}' for x in t2]}")


if __name__ == "__main__":
    main()
