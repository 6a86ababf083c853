"""What every route family shares: ``AppOptions`` (the server's settings), ``ServerState`` (the
engine, scheduler, tokenizer, chat template, lanes, metrics and the served model names) and
``RouteFamily`` (how a family of routes plugs into ``app.create_app``)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from fastapi import APIRouter
from pydantic import BaseModel

from graphkiln.runtime import reasoning, tools
from graphkiln.runtime.request.chat_template import ChatTemplate
from graphkiln.serve import schemas as S
from graphkiln.serve.admission import DEFAULT_BIG_LANE_BYTES, Lanes, chars_per_token_bound, min_tokens
from graphkiln.serve.errors import ApiError, shutting_down, unknown_model
from graphkiln.serve.metrics import ServerMetrics

DEFAULT_MAX_BODY_BYTES = 8 << 20


@dataclass(frozen=True)
class AppOptions:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    big_lane_bytes: int = DEFAULT_BIG_LANE_BYTES  # bodies over 64 KiB being prepared at once (admission)
    # LoRA adapters already loaded into the engine at startup, (name, path as given): their
    # /v1/models root (server.load_adapters loads them)
    lora_adapters: tuple[tuple[str, str], ...] = ()
    # the load/unload routes read a directory on this machine that the client names: open only when
    # the operator says so (serve --allow-lora-updates), as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING
    lora_updates: bool = False
    # requests' default speculative decoding, already checked (serve --speculative/--draft:
    # server.default_speculation); None: off unless a request asks
    speculative: str | None = None
    # the tool-call format (serve --tool-call-parser: a name runtime.tools.by_name takes, "none"
    # refuses tools); None: the one the chat template writes (runtime.tools.detect), if any
    tool_call_parser: str | None = None
    # the reasoning format (serve --reasoning-parser: a name runtime.reasoning.by_name takes, "none"
    # splits nothing); None: the one the chat template writes (runtime.reasoning.detect), if any
    reasoning_parser: str | None = None


class ServerState:
    """What the routes share. ``draining`` turns on when shutdown begins (new requests: 503)."""

    def __init__(self, scheduler, engine, options: AppOptions) -> None:
        self.scheduler, self.engine, self.options = scheduler, engine, options
        self.metrics = ServerMetrics(scheduler.stats)
        files = tuple(engine.manifest.tokenizer_files)
        self.tokenizer = engine.tokenizer  # encodes with the GIL released (runtime.request.tokenizer)
        self.chars_per_token = chars_per_token_bound(self.tokenizer.backend) if self.tokenizer is not None else None
        self.chat = ChatTemplate.load(engine.artifact_dir, files, tokenizer=self.tokenizer)
        # the chat route's tool calls (runtime.tools): checked by the CLI before the app is made
        self.tool_format = tools.load(options.tool_call_parser, self.chat.source,
                                      self.tokenizer.backend if self.tokenizer is not None else None)
        # the chat and responses routes' reasoning split (runtime.reasoning), checked like tool_format
        self.reasoning = reasoning.load(options.reasoning_parser, self.chat.source,
                                        self.tokenizer.backend if self.tokenizer is not None else None)
        self.lanes = Lanes(options.big_lane_bytes)
        self.created = int(time.time())
        self.draining = False
        self.lora = engine.manifest.lora  # LoraSpec, or None: exported without LoRA
        # adapter name -> (path as given, when loaded): /v1/models' root and created. The engine's
        # adapter_names() is what is served; loads and unloads through the routes (serve.admin) are
        # serialized by adapters_lock (the slot check and the load are one step, so a load never evicts)
        self.adapter_info = {name: (path, self.created) for name, path in options.lora_adapters}
        self.adapters_lock = threading.Lock()

    # -- models and LoRA adapters ----------------------------------------------------------

    def adapter_names(self) -> list[str]:
        return list(self.engine.adapter_names()) if self.lora is not None else []

    def model_names(self) -> tuple[str, ...]:
        """Every model id a request may name: the base model's, then the loaded adapters'."""
        return (self.options.model_name, *self.adapter_names())

    def model_cards(self) -> list[S.ModelCard]:
        base = self.options.model_name
        cards = [S.ModelCard(id=base, created=self.created, root=base, max_model_len=self.engine.max_seq_len)]
        for name in self.adapter_names():
            root, created = self.adapter_info.get(name, (None, self.created))
            cards.append(S.ModelCard(id=name, created=created, root=root, parent=base,
                                     max_model_len=self.engine.max_seq_len))
        return cards

    def resolve_model(self, name: str) -> str | None:
        """The adapter a request's ``model`` selects (None: the base model); any other name is a 404."""
        if name == self.options.model_name:
            return None
        if name in self.adapter_names():
            return name
        raise unknown_model(name, self.options.model_name, self.lora is not None)

    # -- prompts ---------------------------------------------------------------------------

    def check_open(self) -> None:
        if self.draining:
            raise shutting_down()

    def check_chars(self, chars: int, param: str) -> None:
        """Refuse a text that provably has more tokens than the artifact takes, before tokenizing."""
        m, limit = self.chars_per_token, self.engine.max_seq_len
        if m is not None and chars > (limit - 1) * m:
            raise ApiError(400, f"{param} has {chars} characters, so at least {min_tokens(chars, m)} tokens, but the "
                                f"artifact's maximum sequence length is {limit}: shorten it or re-export with a larger "
                                "--max-seq-len", param=param, code="context_length_exceeded")

    def check_tokens(self, count: int, param: str) -> None:
        limit = self.engine.max_seq_len
        if count >= limit:
            raise ApiError(400, f"{param} has {count} tokens but the artifact's maximum sequence length is {limit}: "
                                "shorten it or re-export with a larger --max-seq-len", param=param,
                           code="context_length_exceeded")

    def encode(self, text: str, *, special: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=special)


@dataclass(frozen=True)
class RouteFamily:
    """One family of routes (completions, chat, tokenize, ...), as ``app.create_app`` plugs it in.

    ``register(api, state)`` adds the family's routes to ``api`` (the router behind the API key).
    ``bodies``: path -> the request model its POST route parses itself (the routes read their
    bodies, so FastAPI cannot see them): ``routes.openapi_document`` documents them. ``streamed``:
    the models of its server-sent events' ``data`` (referenced by ``routes.generation_route``).
    ``text_ok``: its paths whose 200 is text/plain only."""

    register: Callable[[APIRouter, ServerState], None]
    bodies: Mapping[str, type[BaseModel]] = field(default_factory=dict)
    streamed: tuple[type[BaseModel], ...] = ()
    text_ok: tuple[str, ...] = ()
