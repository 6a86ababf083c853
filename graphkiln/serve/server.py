"""``graphkiln serve``: load an artifact, start the scheduler, run the app on uvicorn, drain on exit.

Lifecycle: ``--speculative`` checked (``default_speculation``) -> ``Engine.load`` (every file's
sha256 checked; ``--draft``'s too) -> the ``--lora`` adapters loaded
(``load_adapters``) -> ``Scheduler`` -> listening socket bound here (so an address in use or a
privileged port is one error line, and port 0 works) -> ``scheduler.start()`` -> uvicorn serves
until SIGTERM / SIGINT (or ``should_exit`` when run in a thread, as the tests do). Shutdown
(``DrainingServer.shutdown``), within ``drain_s``: ``/health`` turns 503 and new requests on open
connections get 503; the scheduler stops admitting and lets in-flight and queued requests run to
their end, cancelling whatever is left at the deadline; uvicorn meanwhile closes the listener and
waits for the responses (streams get their last chunks) with a few seconds' grace beyond the
deadline, then the scheduler's thread is joined. A drained shutdown is a normal exit (status 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from graphkiln.errors import GraphkilnError

RESPONSE_GRACE_S = 5.0  # beyond the drain deadline: for cancelled streams to send their last chunk


@dataclass(frozen=True)
class ServeConfig:
    artifact: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None  # default: the artifact directory's name
    max_queue: int = 64
    max_batch: int | None = None
    step_tokens: int = 256
    threads: int | None = None
    drain_s: float = 30.0
    expect_digest: str | None = None
    target: str | None = None
    distributed: object = None  # "ray" or a runtime.backends.distributed.RayOptions: a staged artifact's stages as Ray actors
    log_level: str = "info"
    prefix_cache: bool = True  # --no-prefix-cache turns it off
    prefix_cache_bytes: int | None = None  # None: the runtime's default budget
    batched_int8: bool = False  # --batched-int8: quantized artifacts' batched-step graph (graphkiln.batched_int8)
    lora: tuple[tuple[str, str], ...] = ()  # --lora NAME=DIR: (name, adapter directory), loaded at startup
    lora_updates: bool = False  # --allow-lora-updates: the load/unload routes are open (API key still needed)
    speculative: str | None = None  # --speculative ngram[:K]|draft[:K]|off: requests' default (default_speculation)
    draft: str | None = None  # --draft DIR: the draft artifact loaded into the engine (runtime.draft_model)
    draft_cost: float | None = None  # --draft-cost C: Engine.load's draft_cost (None: measured at load)
    tool_call_parser: str | None = None  # --tool-call-parser NAME (runtime.tools; None: from the chat template)
    reasoning_parser: str | None = None  # --reasoning-parser NAME (runtime.reasoning; None: from the chat template)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); one-line GraphkilnError when the OS refuses."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET  # a host name: resolved by bind
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise GraphkilnError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): pick another --port or "
                             "--host") from None
    sock.set_inheritable(True)
    return sock


def _uvicorn_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn with the scheduler's drain folded into its graceful shutdown (module docstring)."""

        def __init__(self, config, scheduler, state, drain_s: float) -> None:
            super().__init__(config)
            self.scheduler, self.state, self.drain_s = scheduler, state, drain_s
            self.drained = False

        async def shutdown(self, sockets=None) -> None:
            self.state.draining = True
            # scheduler.shutdown blocks until drained or the deadline: off the event loop, which
            # must keep writing the streams being drained
            drain = asyncio.get_running_loop().run_in_executor(None, self.scheduler.shutdown, self.drain_s)
            try:
                await super().shutdown(sockets)
            finally:
                await drain
                self.state.lanes.shutdown()
            self.drained = True

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:
                    # uvicorn re-raises the captured SIGTERM/SIGINT after its shutdown, which
                    # graphkiln's CLI would report as an interruption; a drained stop is a normal exit
                    self.captured = list(getattr(self, "_captured_signals", []))
                    if hasattr(self, "_captured_signals"):
                        self._captured_signals.clear()

    return DrainingServer


def make_server(scheduler, engine, app_options, *, drain_s: float = 30.0, log_level: str = "info"):
    """A ``DrainingServer`` for ``create_app(scheduler, engine, app_options)``; run it with
    ``server.run(sockets=[bind(host, port)])`` after ``scheduler.start()``."""
    import uvicorn

    from graphkiln.serve.app import create_app

    app = create_app(scheduler, engine, app_options)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=drain_s + RESPONSE_GRACE_S,
                            lifespan="off", server_header=False)
    return _uvicorn_server_class()(config, scheduler, app.state.graphkiln, drain_s)


def check_adapter_names(adapters, served_name: str) -> None:
    """``--lora NAME=DIR`` names: each once, none the base model's (before anything is loaded)."""
    names = [name for name, _ in adapters]
    for name in names:
        if names.count(name) > 1:
            raise GraphkilnError(f"--lora: the name {name!r} is given twice: give each adapter its own NAME")
        if name == served_name:
            raise GraphkilnError(f"--lora: the name {name!r} is the base model's: give the adapter another NAME, "
                                 "or the base model another --model-name")


def load_adapters(engine, adapters, served_name: str) -> tuple[tuple[str, str], ...]:
    """Load each (name, directory) of ``adapters`` into ``engine`` (``--lora NAME=DIR``); every
    refusal is one GraphkilnError line. Returns them, for ``AppOptions.lora_adapters``."""
    adapters = tuple((str(name), str(path)) for name, path in adapters)
    if not adapters:
        return ()
    check_adapter_names(adapters, served_name)
    spec = engine.manifest.lora
    if spec is None:
        raise GraphkilnError("--lora: this artifact was exported without LoRA support: re-export it with "
                             "--lora-rank R (and --max-loras N) to serve adapters")
    if len(adapters) > spec.max_loras:  # the engine would evict the first ones to make room for the last
        raise GraphkilnError(f"--lora: {len(adapters)} adapters, but the artifact holds at most {spec.max_loras} at "
                             "once: serve fewer, or re-export with a larger --max-loras")
    for name, path in adapters:
        engine.load_adapter(name, path)
    return adapters


def default_speculation(speculative: str | None, draft: str | None) -> str | None:
    """Requests' default ``speculative`` (a request's own field overrides it): ``--speculative``,
    else "draft" when ``--draft`` loads one, else none; "off" is None. A value the engine refuses,
    or draft drafts without ``--draft``, is one GraphkilnError line, before anything is loaded."""
    from graphkiln.runtime.request.speculate import parse_speculative

    value = speculative if speculative is not None or draft is None else "draft"
    try:
        setting = parse_speculative(value)
    except GraphkilnError as exc:
        raise GraphkilnError(f"--{exc}") from None  # the engine's line names the config field: "speculative ..."
    if setting is not None and setting[0] == "draft" and draft is None:
        raise GraphkilnError(f"--speculative {value} drafts with a draft model: load one with --draft DIR (an "
                             "artifact of the same tokenizer, e.g. an int4 export), or use ngram[:K]")
    return value if setting is not None else None


def serve(cfg: ServeConfig) -> int:
    from graphkiln.runtime import Engine
    from graphkiln.runtime.request.scheduler import Scheduler
    from graphkiln.serve.app import AppOptions

    name = cfg.model_name or Path(cfg.artifact).resolve().name
    check_adapter_names(cfg.lora, name)
    speculative = default_speculation(cfg.speculative, cfg.draft)
    if cfg.tool_call_parser is not None:  # a name it does not know: one line, before the load
        from graphkiln.runtime.tools import by_name

        by_name(cfg.tool_call_parser)
    if cfg.reasoning_parser is not None:
        from graphkiln.runtime import reasoning

        reasoning.by_name(cfg.reasoning_parser)
    sock = bind(cfg.host, cfg.port)  # first: a taken port fails before a long load
    try:
        engine = Engine.load(cfg.artifact, threads=cfg.threads, expected_digest=cfg.expect_digest, target=cfg.target,
                             distributed=cfg.distributed, prefix_cache=cfg.prefix_cache,
                             prefix_cache_bytes=cfg.prefix_cache_bytes, batched_int8=cfg.batched_int8,
                             draft=cfg.draft, draft_cost=cfg.draft_cost,
                             # the scheduler's pool, counted before the load: never more slots than a
                             # step has tokens for (a --max-batch beyond that is the Scheduler's refusal)
                             slots=min(cfg.max_batch or 1, max(1, cfg.step_tokens - 1)))
        adapters = load_adapters(engine, cfg.lora, name)
        scheduler = Scheduler(engine, max_queue=cfg.max_queue, max_batch=cfg.max_batch, step_tokens=cfg.step_tokens)
    except BaseException:
        sock.close()
        raise
    server = make_server(scheduler, engine, AppOptions(model_name=name, api_key=cfg.api_key, lora_adapters=adapters,
                                                       lora_updates=cfg.lora_updates, speculative=speculative,
                                                       tool_call_parser=cfg.tool_call_parser,
                                                       reasoning_parser=cfg.reasoning_parser),
                         drain_s=cfg.drain_s, log_level=cfg.log_level)
    scheduler.start()  # sizes the slots, before they are reported
    announce(cfg, name, sock, scheduler.stats().total_slots, speculative)
    try:
        server.run(sockets=[sock])
    finally:
        if not server.drained:  # startup failed or the loop died: never leave the stepping thread behind
            scheduler.shutdown(0)
        sock.close()
    print("graphkiln serve: stopped" + (" (drained)" if server.drained else ""), file=sys.stderr, flush=True)
    return 0


def announce(cfg: ServeConfig, name: str, sock: socket.socket, slots: int, speculative: str | None = None) -> None:
    """The startup lines on stderr: a warning when listening beyond loopback without a key, then
    the base URL (an IPv6 literal in brackets, as URLs write it)."""
    host, port = sock.getsockname()[:2]
    if cfg.api_key is None and not _is_loopback(cfg.host):
        print(f"warning: serving on {_url_host(cfg.host)} without an API key: anyone who can reach it can use it "
              "(set --api-key or GRAPHKILN_API_KEY)", file=sys.stderr)
    adapters = f", LoRA adapters {', '.join(repr(n) for n, _ in cfg.lora)}" if cfg.lora else ""
    spec = f", speculative {speculative}" if speculative else ""
    print(f"graphkiln serve: model '{name}' on http://{_url_host(host)}:{port}/v1 ({slots} slots, "
          f"queue {cfg.max_queue}{adapters}{spec}{', API key required' if cfg.api_key else ''})", file=sys.stderr,
          flush=True)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
