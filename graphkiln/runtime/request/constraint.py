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
``advance``d after each token, ``close``d when the request leaves (its pending mask dropped). A
grammar that fails while the request generates (an engine limit met only at a later step) ends
that request with ``GrammarFailed``: the request's error (a 400 on the server), never the server's.

Untrusted grammars (see ``Grammars.compile``): llguidance builds a grammar recursively, one native
stack frame chain per level of rule, terminal or ``$ref`` nesting, and a chain deeper than the
thread's stack kills the process (SIGSEGV: a 3,000-rule Lark chain, a 5,000-``$ref`` schema on an
8 MiB stack). So no constraint reaches llguidance unbounded: its text is at most ``MAX_CHARS``
characters (a schema as compact JSON), and llguidance builds it only on the one compiler thread,
whose stack (``COMPILE_STACK``, 256 MiB of address space; pages are touched only as deep as a build
goes) is at least 8 times what the deepest chain that fits ``MAX_CHARS`` needs (measured for Lark
rule, terminal, ``?``/``*`` chains and ``$ref`` chains through ``$ref``, ``allOf``, ``anyOf``,
``properties`` and ``items``: the worst, bare Lark rules ``a:b``, 8,365 levels in 64 KiB, builds on 32
MiB and crashes on 16 MiB). Built once, a grammar's matcher is copied per request (``deep_copy``),
and copies, masks and token steps do not recurse by depth (the same worst cases run on a 1 MiB stack).

Why not build a new grammar in a child process, so that even an unknown crash could not take the
server: a fresh process (interpreter, llguidance, the tokenizer) costs 0.3 s per new grammar with a
400-token vocabulary and over 1 s with a 49,152-token one (llguidance's tokenizer load alone: 0.96
s), on every request with an uncached grammar, and it would guard the first build only: every
request's masks are computed here anyway. The one crash
known is the stack's, and it is removed by construction (bounds and a stack measured against them).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.untrusted import parse_json

# llguidance drops the GIL while it computes a mask: one worker per core keeps masks of several
# constrained rows in parallel with each other and with onnxruntime's own threads
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_COMPILER: ThreadPoolExecutor | None = None
FIELDS = ("json_schema", "regex", "grammar")
PROBE_STEPS = 3  # masks built (and tokens consumed between them) when a grammar is compiled
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# characters of a constraint's text (a schema as compact JSON): far above real schemas and grammars
# (OpenAI caps a schema's names and values at 120,000 characters), and what COMPILE_STACK is sized for
MAX_CHARS = {"json_schema": 128 << 10, "regex": 64 << 10, "grammar": 64 << 10}
MAX_FRAME_CHARS = 4096  # a constraint_frame: a few rules the server writes, never a user's text
COMPILE_STACK = 256 << 20  # the compiler thread's stack (see the module docstring)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="graphkiln-grammar")
        return _POOL


def _compiler() -> ThreadPoolExecutor:
    """The one thread that builds grammars, with a ``COMPILE_STACK`` stack. ``threading.stack_size``
    is process-wide: it is set only while this executor's single thread is started (a thread some
    other code starts at that moment gets the big stack too, which costs it address space only)."""
    global _COMPILER
    with _POOL_LOCK:
        if _COMPILER is None:
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="graphkiln-grammar-compile")
            previous = threading.stack_size(COMPILE_STACK)
            try:
                executor.submit(int).result()  # its thread starts now; with one worker it is never replaced
            except RuntimeError as exc:  # no address space for the stack (strict overcommit, a ulimit -v)
                raise GraphkilnError(f"structured output needs a thread with a {COMPILE_STACK >> 20} MiB stack and "
                                     f"none could start ({exc}): allow the process more virtual memory") from None
            finally:
                threading.stack_size(previous)
            _COMPILER = executor
        return _COMPILER


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
        """llguidance's tokenizer: the artifact's tokens (their bytes as llguidance reads them from
        tokenizer.json, special tokens marked), with text tokenized as text. llguidance's own
        tokenizer splits a special token's text out of any text it tokenizes, so where a grammar
        forces text such as ``</s>`` or ``<|im_end|>`` it allowed only that special token, which the
        grammar then refused ("the grammar failed at token 2"); here that text is written with
        ordinary tokens, as the constraint asked, and a special token is never text."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance
                from llguidance._tokenizer import TokenizerWrapper

                if self.path is None:
                    raise GraphkilnError("structured output (json_schema, regex, grammar) needs the artifact's "
                                         "tokenizer.json, and this artifact has none")
                eos = list(self.eos) or None
                plain = llguidance.LLTokenizer(str(self.path), n_vocab=self.vocab_size, eos_token=eos)
                self._tokenizer = llguidance.LLTokenizer(TokenizerWrapper(_TextTokenizer(plain, self.path)),
                                                         n_vocab=self.vocab_size, eos_token=eos)
            return self._tokenizer

    @staticmethod
    def text(field: str, value) -> str:
        """The constraint's text as llguidance gets it (a schema as compact JSON, its keys in the
        order given: the order of an object's properties), checked against ``MAX_CHARS``; it is also
        the key of a compiled grammar. A GraphkilnError line for a value that is not one."""
        if field == "json_schema":
            schema = parse_json(value, "json_schema: the text", f"pass a valid {_WHAT[field]}") if isinstance(value, str) else value
            if schema is True:  # the schema every JSON value satisfies
                schema = {}
            if not isinstance(schema, dict):
                raise GraphkilnError(f"json_schema: {'false is the schema nothing satisfies' if schema is False else 'must be a JSON object (a schema)'}: "
                                     f"pass a valid {_WHAT[field]}")
            try:
                value = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError, RecursionError) as exc:  # a dict from Python: a set, NaN, 10,000 deep
                raise GraphkilnError(f"json_schema: not JSON ({_line(exc)}): pass a valid {_WHAT[field]}") from None
        elif not isinstance(value, str):
            raise GraphkilnError(f"{field} must be a string, got {type(value).__name__}")
        if len(value) > MAX_CHARS[field]:
            raise GraphkilnError(f"{field}: {len(value):,} characters{' as compact JSON' if field == 'json_schema' else ''} "
                                 f"is more than the {MAX_CHARS[field]:,} a constraint may have: simplify the {_WHAT[field]}")
        return value

    def compile(self, field: str, value, frame: str | None = None) -> "Grammar":
        """The grammar for one constraint (``text``'s bounds first, then built on the compiler
        thread); a GraphkilnError line for one it cannot compile. ``frame``: Lark text whose
        ``start`` places the constraint as ``@constraint`` (GenerationConfig.constraint_frame)."""
        text = self.text(field, value)
        if frame is not None and len(frame) > MAX_FRAME_CHARS:
            raise GraphkilnError(f"constraint_frame: {len(frame):,} characters is more than {MAX_FRAME_CHARS:,}: "
                                 "a frame is a few rules around @constraint")
        tokenizer = self.tokenizer()
        return _compiler().submit(self._build, field, text, tokenizer, frame).result()

    def _build(self, field: str, text: str, tokenizer, frame: str | None = None) -> "Grammar":
        from llguidance import LLMatcher

        try:
            if field == "json_schema":
                # no free whitespace between JSON tokens: a model may otherwise pad forever (a known
                # failure of flexible-whitespace grammars); json.dumps's separators keep it readable
                grammar = LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
            elif field == "regex":
                grammar = LLMatcher.grammar_from_regex(text)
            else:
                grammar = LLMatcher.grammar_from_lark(text)
        except (ValueError, TypeError, RecursionError) as exc:
            raise GraphkilnError(f"{field}: {_line(exc)}: pass a valid {_WHAT[field]}") from None
        if frame is not None:
            grammar = _framed(frame, grammar)
        matcher = LLMatcher(tokenizer, grammar, log_level=0)  # builds and checks it: an error is a state
        if matcher.is_error():
            raise GraphkilnError(f"{field}: {_line(matcher.get_error())}: pass a valid {_WHAT[field]}")
        compiled = Grammar(field, matcher)
        # Some limits (a regex's size, say) are only met when the first masks are built or the first
        # tokens consumed (a{1000000} failed at its second token), and a grammar no text satisfies only
        # shows there: a few steps here, along the lowest allowed token ids, so neither fails a running request.
        probe = Constraint(self, compiled)
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
        return compiled

    def constraint(self, grammar: "Grammar") -> "Constraint":
        """A started ``Constraint`` over a grammar ``compile`` returned."""
        c = Constraint(self, grammar)
        c.start()
        return c


def _framed(frame: str, grammar: str) -> str:
    """llguidance's top-level grammar of ``frame`` (Lark, first: its ``start`` is the whole output's)
    with the constraint's own grammar beside it, named ``constraint`` (what ``@constraint`` refers
    to: a nested grammar with its own lexer, so its rule names never meet the frame's). The
    constraint's grammar is llguidance's JSON (schema, regex) or, from a Lark grammar, its text."""
    inner = json.loads(grammar)["grammars"][0] if grammar.lstrip().startswith("{") else {"lark_grammar": grammar}
    inner = dict(inner, name="constraint")
    return json.dumps({"grammars": [{"lark_grammar": frame}, inner]})


class GrammarFailed(GraphkilnError):
    """A request's grammar failed while it generated (a limit of the grammar engine met only at a
    later step: ``[a-z]{1,3}a{1000000}`` after its first letters): the request's error, not the
    server's (the server answers 400 ``invalid_response_format``, or that error event once
    streaming). Its line starts with the constraint's field, as compile's refusals do."""


class Grammar:
    """A compiled constraint: ``field`` (json_schema, regex, grammar) and its matcher before any
    token, which each request copies (building it again would cost what compiling did)."""

    def __init__(self, field: str, matcher) -> None:
        self.field, self.matcher = field, matcher


class _TextTokenizer:
    """What llguidance's ``TokenizerWrapper`` wraps: ``plain``'s tokens and special ids, and text
    encoded with special tokens' text kept as text (``Grammars.tokenizer``)."""

    def __init__(self, plain, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        ids = range(plain.vocab_size)
        self.tokens = [plain.decode_bytes([i]) for i in ids]
        self.special_token_ids = [i for i in ids if plain.is_special_token(i)]
        self.eos_token_id, self.bos_token_id = plain.eos_token, None
        self._tok = HFTokenizer.from_file(str(path))
        self._tok.encode_special_tokens = True

    def __call__(self, text):
        if not isinstance(text, str):  # llguidance asks once whether bytes are taken: only text is
            raise TypeError("text only")
        return self._tok.encode(text, add_special_tokens=False).ids


_WHAT = {"json_schema": "JSON schema", "regex": "regular expression", "grammar": "Lark grammar"}


def _line(text) -> str:
    text = str(text).strip()
    return (text.splitlines() or [""])[0][:300]


class Constraint:
    """One request's matcher (a copy of its ``Grammar``'s) and its next-step mask (see the module
    docstring)."""

    def __init__(self, grammars: Grammars, grammar: Grammar) -> None:
        import llguidance.numpy as lln

        self._lln = lln
        self.field = grammar.field
        self.matcher = grammar.matcher.deep_copy()
        self.tokens = 0  # consumed so far
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
        if self.matcher.is_error():  # a limit met at this step: its mask allows nothing
            raise self._failed()
        masked = np.array(logits, dtype=np.float32, copy=True).reshape(1, -1)
        self._lln.apply_token_bitmask_inplace(masked, self.bitmask)
        return masked[0]

    def advance(self, token: int, finished: bool) -> bool:
        """Consume the chosen token; returns whether the grammar is complete (nothing more may
        follow). Unless the request is ``finished``, the next step's mask starts computing now."""
        if not self.matcher.consume_token(token):
            raise self._failed()
        self.tokens += 1
        done = self.matcher.is_stopped()
        if not (done or finished):
            self.start()
        return done

    def _failed(self) -> "GrammarFailed":
        return GrammarFailed(f"{self.field}: the grammar engine failed at generated token {self.tokens + 1} "
                             f"({_line(self.matcher.get_error())}): simplify the {_WHAT[self.field]}")

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
