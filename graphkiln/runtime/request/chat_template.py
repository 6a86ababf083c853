"""The artifact's chat template: messages -> prompt token ids.

Where the template comes from, as transformers saves it: ``chat_template.jinja`` (transformers
>= 4.43 writes it beside the tokenizer), else ``tokenizer_config.json``'s ``chat_template`` (a
string, or a list of named templates of which "default" is used). Both are tokenizer files the
export copies and the manifest hashes (``manifest.tokenizer_files``). The template is untrusted
code: it is compiled and rendered only in jinja2's ``ImmutableSandboxedEnvironment`` (no
attribute access to Python internals, no mutation of the messages), with the globals and
filters transformers gives templates (``raise_exception``, ``strftime_now``, ``tojson``).

Users: ``graphkiln serve``'s chat route (``graphkiln.serve.app``) and ``graphkiln chat`` /
``graphkiln run --chat`` (``graphkiln.chat``); it lives beside the tokenizer, below both, so the
CLI does not import the serving layer.

Lifecycle: ``ChatTemplate.load`` runs once (at server start, or when the chat command has loaded
its engine) and never raises for a missing or broken template; ``render`` then refuses with
``ChatTemplateError`` (the server's 400), so the completions route keeps working on an artifact
without a usable template. ``problem`` is None exactly when ``template`` is usable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from graphkiln.errors import GraphkilnError
from graphkiln.runtime.request.tokenizer import Tokenizer

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
MAX_TEMPLATE_BYTES = 1 << 20  # real templates are a few KB; this only bounds what an artifact can make us compile


class ChatTemplateError(GraphkilnError):
    """No usable chat template, or the template refused the messages (its raise_exception)."""


def _special(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return ""


@dataclass
class ChatTemplate:
    """A compiled chat template with the special tokens it may print, and the tokenizer that
    turns its output into ids (without adding special tokens: the template writes them)."""

    template: Any | None  # jinja2.Template; None when unusable (then ``problem`` says why)
    problem: str | None
    bos_token: str = ""
    eos_token: str = ""
    tokenizer: Tokenizer | None = None
    source: str | None = None  # the template's text, as GET /tokenizer_info hands it to clients

    @classmethod
    def load(cls, artifact_dir: Path, tokenizer_files: tuple[str, ...], tokenizer: Any | None = None) -> "ChatTemplate":
        """``tokenizer``: the artifact's tokenizer.json already loaded (the Engine's; else loaded here)."""
        config: dict = {}
        if CONFIG_FILE in tokenizer_files:
            try:
                loaded = json.loads((artifact_dir / CONFIG_FILE).read_text(encoding="utf-8"))
                config = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError, UnicodeDecodeError):
                config = {}
        source = problem = None
        if TEMPLATE_FILE in tokenizer_files:
            path = artifact_dir / TEMPLATE_FILE
            if path.stat().st_size > MAX_TEMPLATE_BYTES:
                problem = f"its {TEMPLATE_FILE} is over {MAX_TEMPLATE_BYTES} bytes"
            else:
                try:
                    source = path.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError) as exc:
                    problem = f"its {TEMPLATE_FILE} cannot be read ({exc})"
        else:
            raw = config.get("chat_template")
            if isinstance(raw, list):  # named templates: [{"name": "default", "template": "..."}, ...]
                raw = next((t.get("template") for t in raw if isinstance(t, dict) and t.get("name") == "default"), None)
            if isinstance(raw, str) and len(raw.encode()) <= MAX_TEMPLATE_BYTES:
                source = raw
            elif raw is not None:
                problem = f"the chat_template in its {CONFIG_FILE} is not a template string"
        if source is None and problem is None:
            problem = f"it has neither {TEMPLATE_FILE} nor a chat_template in {CONFIG_FILE}"
        if tokenizer is None and "tokenizer.json" in tokenizer_files:
            tokenizer = Tokenizer(artifact_dir / "tokenizer.json")
        if tokenizer is None and problem is None:
            problem = "it has no tokenizer.json to encode the rendered prompt"
        template = None
        if problem is None:
            try:
                template = _environment().from_string(source)
            except Exception as exc:  # jinja2.TemplateSyntaxError and anything else a hostile template triggers
                problem = f"its chat template does not compile ({type(exc).__name__}: {_one_line(exc)})"
        return cls(template, problem, _special(config.get("bos_token")), _special(config.get("eos_token")), tokenizer,
                   source if template is not None else None)

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text for ``messages`` with the assistant's turn opened."""
        if self.template is None:
            raise ChatTemplateError(f"this model has no usable chat template ({self.problem}): use /v1/completions "
                                    "with a prompt you format yourself, or export a checkpoint that has one")
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                        eos_token=self.eos_token, tools=None, documents=None)
        except ChatTemplateError:
            raise
        except Exception as exc:  # a sandbox SecurityError, a TypeError inside the template, ...
            raise ChatTemplateError(f"the chat template failed on these messages ({type(exc).__name__}: "
                                    f"{_one_line(exc)}): check the roles and their order") from None

    def encode(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt's token ids; the template already wrote any BOS, so none is added."""
        return self.tokenizer.encode(self.render(messages), add_special_tokens=False)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def _raise_exception(message: str):
    raise ChatTemplateError(f"the chat template refused the messages: {_one_line(Exception(message))}")


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
    # transformers' tojson (jinja2's escapes HTML, which would change the prompt)
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # the options transformers renders chat templates with, so prompts match its apply_chat_template
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
