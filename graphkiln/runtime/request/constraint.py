"""Structured output: a request's grammar (JSON schema, regex, Lark) as a token mask per step.

The grammar engine is llguidance (Microsoft's, what onnxruntime-genai and vLLM's "guidance"
backend use): torch-free, its matcher computes the set of tokens that keep the output inside the
grammar with the GIL released. ``Grammars`` (one per engine) compiles a request's constraint
against the artifact's tokenizer when the request is prepared, so a schema it cannot compile is
refused before anything runs. ``Constraint`` (one per request) holds the matcher and the mask of
the next step.

Off the critical path: the mask for step t+1 is computed in a worker thread as soon as token t is
committed (``advance``), while the graph runs step t+1; the sampler waits for it only if it is not
ready yet (``mask``). The first mask is computed while the prompt is prefilled. A constrained row
needs its logits (the folded greedy ``next_token`` cannot be masked): only such rows fall back to
logits (``RequestState.folds``). Requests without a constraint pay nothing.

Lifecycle: made by ``Grammars.constraint`` when the request is created, ``start``ed at once,
``advance``d after each token, ``close``d when the request leaves (its pending mask dropped).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError

# llguidance drops the GIL while it computes a mask: one worker per core keeps masks of several
# constrained rows in parallel with each other and with onnxruntime's own threads
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
FIELDS = ("json_schema", "regex", "grammar")
PROBE_STEPS = 3  # masks built (and tokens consumed between them) when a grammar is compiled
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="graphkiln-grammar")
        return _POOL


def constraint_field(cfg) -> tuple[str, object] | None:
    """(field name, value) of the one constraint a GenerationConfig sets, or None."""
    for name in FIELDS:
        value = getattr(cfg, name)
        if value is not None:
            return name, value
    return None


class Grammars:
    """The artifact's tokenizer as llguidance sees it (built on first use) and grammar compilation.

    ``vocab_size`` is the model's (logits rows may be longer than the tokenizer's vocabulary: the
    extra ids are never allowed); ``eos`` the ids that end generation (allowed once the grammar is
    complete)."""

    def __init__(self, tokenizer_json: Path | None, vocab_size: int, eos: tuple[int, ...]) -> None:
        self.path, self.vocab_size, self.eos = tokenizer_json, vocab_size, tuple(eos)
        self._tokenizer = None
        self._lock = threading.Lock()

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                if self.path is None:
                    raise GraphkilnError("structured output (json_schema, regex, grammar) needs the artifact's "
                                         "tokenizer.json, and this artifact has none")
                self._tokenizer = llguidance.LLTokenizer(str(self.path), n_vocab=self.vocab_size,
                                                         eos_token=list(self.eos) or None)
            return self._tokenizer

    def compile(self, field: str, value) -> str:
        """The llguidance grammar for one constraint; a GraphkilnError line for one it cannot compile."""
        from llguidance import LLMatcher

        try:
            if field == "json_schema":
                schema = json.loads(value) if isinstance(value, str) else value
                if schema is True:  # the schema every JSON value satisfies
                    schema = {}
                if not isinstance(schema, dict):
                    raise ValueError("must be a JSON object (a schema)" if schema is not False
                                     else "false is the schema nothing satisfies")
                # no free whitespace between JSON tokens: a model may otherwise pad forever (a known
                # failure of flexible-whitespace grammars); json.dumps's separators keep it readable
                grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            elif field == "regex":
                grammar = LLMatcher.grammar_from_regex(value)
            else:
                grammar = LLMatcher.grammar_from_lark(value)
        except (ValueError, TypeError, RecursionError) as exc:
            raise GraphkilnError(f"{field}: {_line(exc)}: pass a valid {_WHAT[field]}") from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer())
        if is_error:
            raise GraphkilnError(f"{field}: {_line(messages[0] if messages else 'invalid')}: pass a valid {_WHAT[field]}")
        # Some limits (a regex's size, say) are only met when the first masks are built or the first
        # tokens consumed (a{1000000} failed at its second token), and a grammar no text satisfies only
        # shows there: a few steps here, along the lowest allowed token ids, so neither fails a running request.
        probe = Constraint(self, grammar)
        for _ in range(PROBE_STEPS):
            probe._fill()
            error = _line(probe.matcher.get_error()) if probe.matcher.is_error() else ""
            if (probe.matcher.is_stopped() and not probe.matcher.is_accepting()) or error.startswith("NoExtension"):
                raise GraphkilnError(f"{field}: no text satisfies it: pass a {_WHAT[field]} that some text matches")
            if error:
                raise GraphkilnError(f"{field}: {error}: simplify the {_WHAT[field]}")
            allowed = np.flatnonzero(np.unpackbits(probe.bitmask.view(np.uint8), bitorder="little"))
            allowed = allowed[(allowed < self.vocab_size) & ~np.isin(allowed, self.eos)]  # text, not the end
            if probe.matcher.is_stopped() or not allowed.size:
                break
            if not probe.matcher.consume_token(int(allowed[0])):
                raise GraphkilnError(f"{field}: {_line(probe.matcher.get_error())}: simplify the {_WHAT[field]}")
        return grammar

    def constraint(self, grammar: str) -> "Constraint":
        """A started ``Constraint`` over a grammar ``compile`` returned."""
        c = Constraint(self, grammar)
        c.start()
        return c


_WHAT = {"json_schema": "JSON schema", "regex": "regular expression", "grammar": "Lark grammar"}


def _line(text) -> str:
    text = str(text).strip()
    return (text.splitlines() or [""])[0][:300]


class Constraint:
    """One request's matcher and its next-step mask (see the module docstring)."""

    def __init__(self, grammars: Grammars, grammar: str) -> None:
        import llguidance
        import llguidance.numpy as lln

        self._lln = lln
        self.matcher = llguidance.LLMatcher(grammars.tokenizer(), grammar, log_level=0)
        self.bitmask = lln.allocate_token_bitmask(1, grammars.vocab_size)
        self._pending: Future | None = None

    def start(self) -> None:
        """Compute the first step's mask in the background (while the prompt is prefilled)."""
        self._pending = _pool().submit(self._fill)

    def _fill(self) -> None:
        self._lln.fill_next_token_bitmask(self.matcher, self.bitmask, 0)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` (one row) with every token the grammar forbids at this step set to -inf (a copy)."""
        if self._pending is None:
            self._fill()
        else:
            self._pending.result()
            self._pending = None
        masked = np.array(logits, dtype=np.float32, copy=True).reshape(1, -1)
        self._lln.apply_token_bitmask_inplace(masked, self.bitmask)
        return masked[0]

    def advance(self, token: int, finished: bool) -> bool:
        """Consume the chosen token; returns whether the grammar is complete (nothing more may
        follow). Unless the request is ``finished``, the next step's mask starts computing now."""
        if not self.matcher.consume_token(token):
            raise GraphkilnError(f"the grammar failed at token {token} ({_line(self.matcher.get_error())}): simplify "
                                 "the request's json_schema, regex or grammar")
        done = self.matcher.is_stopped()
        if not (done or finished):
            self.start()
        return done

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
