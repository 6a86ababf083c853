"""Module-name patterns a quantization_config gives (``modules_to_not_convert``, compressed-tensors'
``ignore`` and ``targets``), evaluated as the libraries that write them do, in bounded time.

A pattern is checkpoint text run as a regular expression, so it is untrusted code: ``re``'s
backtracking spins for minutes on ``(?:.|\\w|\\w)*y`` against a module name. Patterns therefore run
on the ``regex`` engine (the same syntax, checked by ``re``'s own parser first), whose matching
takes a timeout, under one ``MatchBudget`` per conversion; and since ``regex`` compiles a fixed
repeat by writing its body out (``(?:(?:a{100}){100}){100}``: 10**6 copies, seconds and GBs before
any match), a pattern is refused before it is compiled when it is longer than
``MAX_PATTERN_CHARS`` or its fixed repeats would write out more than ``MAX_WRITTEN_OUT`` elements.
Every refusal is one line naming the pattern (``untrusted.show``) and the fix.
"""

from __future__ import annotations

import re
import re._parser as re_parser  # re's own parser: what re.compile runs first; it writes no repeat out
import time

import regex

from graphkiln.errors import GraphkilnError
from graphkiln.models.hf_quantized.layout import refuse
from graphkiln.untrusted import show

MAX_PATTERN_CHARS = 1000  # real ones are tens of characters ("re:.*self_attn.(q|k|v)_proj$")
MAX_WRITTEN_OUT = 10_000  # regex compiles 10,000 written-out elements in ~40 ms (measured)
BUDGET_S = 0.25  # CPU seconds: a pattern that backtracks catastrophically is refused after this (measured)
PER_MATCH_S = 20e-6  # a real pattern takes 2-6 us of CPU per module name on regex with a timeout (measured)
_FIX = "in quantization_config in config.json"


class MatchBudget:
    """The time one conversion's pattern matching may take: ``BUDGET_S`` plus ``PER_MATCH_S`` for
    each match made so far, and ``BUDGET_S`` for any one match. Real patterns stay far inside it
    whatever the model's size; a pattern that backtracks (on one module name, or a little on each of
    many) exhausts it and is refused, so no checkpoint's patterns cost more than ``BUDGET_S`` plus
    ``PER_MATCH_S`` per match. Both are CPU time, as ``regex``'s timeout is (measured: a timeout of
    0.25 s ends after 0.25 s of CPU, 1 s of wall time at a load of 4 per core)."""

    def __init__(self) -> None:
        self.matches = 0
        self.spent = 0.0

    def match(self, compiled: regex.Pattern, module: str, method: str, key: str, pattern: str) -> bool:
        """Whether ``compiled`` (``key``'s ``pattern``) matches the start of ``module``."""
        self.matches += 1
        left = BUDGET_S + PER_MATCH_S * self.matches - self.spent
        start = time.process_time()  # regex's timeout is CPU time too (measured): a loaded machine's wait is not spent
        try:
            return compiled.match(module, timeout=min(max(left, PER_MATCH_S), BUDGET_S)) is not None
        except TimeoutError:
            raise refuse(method, f"the {show(key)} pattern {show(pattern)} takes too long to match module names (over "
                                 f"{BUDGET_S:g} s: it backtracks catastrophically, e.g. a repeat of overlapping "
                                 "alternatives)", "rewrite it without nested or overlapping repeats (e.g. '.*y' for "
                                 f"'(?:.|\\w)*y') {_FIX}") from None
        finally:
            self.spent += time.process_time() - start


def _written_out(pattern) -> int:
    """How many elements ``regex`` writes out for a parsed pattern: a fixed repeat's body (a
    repeat's minimum count) is copied that many times, nested repeats multiply."""
    size = 0
    for op, av in pattern:
        if op in (re_parser.MAX_REPEAT, re_parser.MIN_REPEAT, re_parser.POSSESSIVE_REPEAT):
            low, _, body = av
            size += max(low, 1) * _written_out(body)
        elif op is re_parser.SUBPATTERN:
            size += _written_out(av[3])
        elif op is re_parser.BRANCH:
            size += sum(_written_out(b) for b in av[1])
        elif op in (re_parser.ASSERT, re_parser.ASSERT_NOT):
            size += _written_out(av[1])
        elif op is re_parser.ATOMIC_GROUP:
            size += _written_out(av)
        elif op is re_parser.GROUPREF_EXISTS:
            size += sum(_written_out(b) for b in av[1:] if b is not None)
        else:
            size += 1
    return size


def compile_pattern(pattern: str, template: str, method: str, key: str, strict: bool) -> regex.Pattern | None:
    """``template.format(pattern)`` compiled for ``MatchBudget.match``, ``pattern`` being ``key``'s
    checkpoint text; a pattern too long or too big to compile is refused in one line, as is an
    invalid one with ``strict`` (else None: the caller's rule treats it as plain text)."""
    def refused(what: str, fix: str) -> GraphkilnError:
        return refuse(method, f"the {show(key)} pattern {show(pattern)} {what}", f"{fix} {_FIX}")

    if len(pattern) > MAX_PATTERN_CHARS:
        raise refused(f"is {len(pattern):,} characters long, more than the {MAX_PATTERN_CHARS:,} a module-name "
                      "pattern may have", "shorten it")
    text = template.format(pattern)
    try:
        size = _written_out(re_parser.parse(text))
        compiled = regex.compile(text) if size <= MAX_WRITTEN_OUT else None
    except (re.error, regex.error, RecursionError, OverflowError, ValueError):
        if not strict:
            return None
        raise refused("is not a valid regular expression", "fix it") from None
    if compiled is None:
        raise refused(f"repeats too much ({size:,} elements once its fixed repeats are written out, more than "
                      f"{MAX_WRITTEN_OUT:,})", "write it without nested counted repeats")
    return compiled


class NotConverted:
    """transformers' rule for ``modules_to_not_convert`` (quantizers_utils.should_convert_module):
    a name lists a module when, as a regex, it matches from the module's start up to a module
    boundary, or when it is a suffix of the module's name (an invalid regex: the suffix rule alone)."""

    _BOUNDARY = r"(?:{})(?:(?<=\.)|(?=\.|$))"

    def __init__(self, method: str, key: str, names: list[str], budget: MatchBudget) -> None:
        self.method, self.key, self.budget = method, key, budget
        self.names = [(n, compile_pattern(n, self._BOUNDARY, method, key, strict=False)) for n in names if n]

    def first(self, module: str) -> str | None:
        """The first name that lists ``module``, or None."""
        for name, compiled in self.names:
            if compiled is not None and self.budget.match(compiled, module, self.method, self.key, name):
                return name
            if module.endswith(name):
                return name
        return None


class Targets:
    """compressed-tensors' match_name for ``targets`` and ``ignore``: ``re:``-prefixed entries are
    regexes matched at the module's start, others the module's name; a class name target
    (``Linear``) matches every packed module, each of which is a Linear."""

    def __init__(self, method: str, key: str, targets: list[str], budget: MatchBudget) -> None:
        self.method, self.key, self.budget = method, key, budget
        self.targets = [(t, compile_pattern(t[3:], "{}", method, key, strict=True) if t.startswith("re:") else None)
                        for t in targets]

    def first(self, module: str, classes: bool = True) -> str | None:
        """The first target naming ``module``, or None; ``classes=False`` passes over ``Linear``."""
        for target, compiled in self.targets:
            if compiled is not None:
                if self.budget.match(compiled, module, self.method, self.key, target[3:]):
                    return target
            elif target == module or (classes and target == "Linear"):
                return target
        return None


def refuse_not_converted(method: str, modules: dict, names: list[str], key: str) -> None:
    """Refuse packed modules that ``key`` (modules_to_not_convert) says stay float."""
    listed = NotConverted(method, key, names, MatchBudget())
    for module in modules:
        hit = listed.first(module)
        if hit is not None:
            raise refuse(method, f"{show(module)} stores packed weights but {key} lists {show(hit)}",
                         f"remove it from {key} in config.json, or re-quantize the checkpoint")
