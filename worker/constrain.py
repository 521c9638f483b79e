"""Constrained decoding: a grammar per sequence that masks the logits.

The engine asks three things of a constrained sequence, once per token:
`mask(logits)` (disallowed tokens become -inf before sampling), `accept(token)`
(advance the grammar; False when it refuses the token) and `done` (the grammar
is complete: the engine finishes the request with finish_reason "stop" rather
than waiting for the model's EOS; "length" when the budget wrap-up, below, had
to close it). A `ConstraintFactory` per tokenizer turns a
wire spec (`shared.protocol.ConstraintSpec`) into a `Constraint`, keeping compiled
grammars in a small LRU cache so a repeated schema costs a copy, not a compile.

Library: llguidance. Compared on our demo tokenizer (byte-level BPE, 4096
tokens, as `mlx_lm.load` gives it) with MLX logits on CPU by
`scripts/compare_constraint_libs.py` (20 sequences per schema, random logits,
greedy over the mask; µs per token; "apply" = bitmask onto the mx.array,
the same code for all; "valid" = parses with json.loads AND validates with
jsonschema; one noisy run on a shared 2-core machine, compare rows):

    library        tok. setup  schema         compile  fill p50  fill p99  apply p50  valid
    llguidance         31 ms   person          1.0 ms     43       240        56      20/20
                               tool_required   1.3 ms     40       228        58      20/20
    xgrammar         2.9 s     person          3.4 ms     22        84        56      10/20
                               tool_required   3.3 ms     21       110        55      20/20
    outlines-core      13 ms   person           61 ms     12        44        60       1/20
                               tool_required    54 ms     13        43        91       3/20

With a bigger vocabulary (`--vocab 32000`: the offline corpus yields 17330
tokens; 10 sequences, an even busier machine): llguidance fill p50 112/136 µs
(person/tool_required), compile 1.1/2.0 ms, 10/10 valid; xgrammar 35/55 µs,
15/12 ms, 8/10 and 9/10; outlines-core 20/26 µs, 431/256 ms, 0/10 and 3/10.
Tokenizer setup: llguidance 0.5 s, xgrammar 10 s, outlines-core 0.2 s.

(xgrammar's 10/20: raw control characters (U+0000, U+0008) inside strings,
which JSON forbids; outlines-core's misses: integer minimum/maximum are not
enforced, so "age" runs to hundreds of digits.)

What each supports, for us:
  * llguidance: JSON Schema incl. anyOf/oneOf, $ref and recursion, enum/const,
    pattern, numeric bounds, additionalProperties; Lark CFGs (with %json
    inside), regex. Grammar errors are values (`is_error`/`get_error`) naming
    the keyword, never a crash; unsupported keywords refused unless lenient
    (our `strict`). A wheel with no dependencies; builds its tokenizer from
    the `tokenizer.json` text. Its `mlx.py` helper is a Metal kernel, so on
    CPU we apply the bitmask with plain MLX ops (`apply_bitmask`).
  * xgrammar: JSON Schema, EBNF, regex, structural tags for tool calls; fast
    masks after an up-front compile. But it requires torch, transformers,
    triton and pydantic (torch alone is 1.2 GB) for a worker that has no other
    use for them, and errors are C++ RuntimeErrors with source paths.
  * outlines-core: regular languages only: a JSON Schema becomes one regex,
    then a DFA over the whole vocabulary. Per-token cost is a table lookup,
    but the compile grows with schema size x vocabulary, recursion is not
    expressible, there is no CFG, and a byte-level vocabulary must be decoded
    by hand (its `from_pretrained` downloads).
Chosen: llguidance: the only one whose outputs were valid every time, the
widest schema support with clear errors, compile in milliseconds (lazy
lexer, so a request's new schema does not stall the step), and no heavy
dependencies. xgrammar's masks are 2-3x cheaper per token, but at ~0.1 ms
llguidance's are already far below a decode step (see
scripts/bench_constrained.py for the whole cost in the engine).

Whitespace is compact (no free whitespace between tokens): a model with
random weights would otherwise pad with whitespace forever, and compact JSON
is what OpenAI's strict mode emits as well.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import llguidance as llg
import mlx.core as mx
import numpy as np

from shared.protocol import ConstraintSpec, JsonObject, JsonSchema, LarkGrammar, ToolCallConstraint
from shared.vocab import FailureCode
from worker.closing import Closers, closers_for, closing_cost, in_free_string, pick

INVALID_CONSTRAINT: FailureCode = "invalid_constraint"  # the front door names its param (a 400)
CACHE_SIZE = 64  # compiled grammars kept per tokenizer
WRAP_WINDOW = 256  # tokens before max_tokens where the wrap-up starts checking (see Constraint)
PROBE_TOKENS = 32  # tokens of the closing policy's dry run at compile (see _probe)
# every mask and every probe step is bounded by llguidance's lexer fuel (its defaults:
# 1M initial, 200k a step, 250k lexer states): `(a|aa){1000}` exhausts them in ~60 ms and is
# refused; tighter bounds also refused `(a|aa){200}`, a pattern that works.
# llguidance's error texts when a grammar exceeds a bound rather than the model misbehaving
_LIMIT_ERRORS = ("lexer error", "fuel", "too many", "limit", "too large", "too big")


class ConstraintError(ValueError):
    """A constraint the worker cannot enforce; `code` goes on the wire."""

    def __init__(self, message: str, code: FailureCode = INVALID_CONSTRAINT):
        super().__init__(message)
        self.code: FailureCode = code
        self.message = message


# One row per byte value: the 8 tokens it covers as 0 (allowed) or -inf,
# lowest bit first, as llguidance lays its bitmask out.
_BYTE_ROWS = np.array([row[::-1] for row in itertools.product((float("-inf"), 0.0), repeat=8)],
                      dtype=np.float32)
_tables: dict[Any, mx.array] = {}


def apply_bitmask(logits: mx.array, words: np.ndarray) -> mx.array:
    """Logits with -inf where the 32-bit-word bitmask has a 0 (lazy, stays in the graph).

    A table lookup per mask byte then one add: on CPU half the cost of
    unpacking the bits with numpy then `mx.where` at a 150k vocabulary.
    """
    table = _tables.get(logits.dtype)
    if table is None:
        table = _tables[logits.dtype] = mx.array(_BYTE_ROWS).astype(logits.dtype)
    vocab = logits.shape[-1]
    bias = table[mx.array(words.view(np.uint8))].reshape(-1)
    if bias.shape[0] < vocab:  # logits wider than the tokenizer: padding ids are never allowed
        bias = mx.concatenate([bias, mx.full((vocab - bias.shape[0],), float("-inf"), logits.dtype)])
    return logits + bias[:vocab]


class Constraint:
    """One sequence's grammar state (not shared: each request gets its own copy).

    Wrap-up: a grammar guarantees every prefix is valid, not that the output
    ends before max_tokens; a model with random weights writes strings and
    numbers forever. So near the end of the budget a dry run on a copy of the
    grammar counts how many tokens a fixed closing policy needs from here:
    EOS if the output may end; in a free string its closing quote; else the
    first allowed of `] } , " 0 : [ {` (close, move on, or start the shortest
    value); else (a key, an enum, a pattern) the longest allowed token.

    One free token can raise that count by more than one (`{"` opens a key that
    needs `"`, `:`, a value and `}`), so checking the count alone let json_object
    with max_tokens 4-6 end as `{"":""`. So `_cost` is an upper bound of the
    count (exact after each dry run; each token adds at most its bound, the
    policy's own token takes one off), and once the margin `left - _cost` is
    within the largest bound a token has, the mask keeps only the tokens whose
    bound still fits, and the policy's: the output then ends complete at or
    before max_tokens, from any state that could close within the budget. The
    bounds hold for JSON (json_object, and a schema's own structure); a schema
    whose optional parts open required ones can still outgrow them, as a
    grammar (Lark) can. Dry runs are spaced by a third of the margin they found,
    so a long budget costs a handful. `wrapped` tells the engine the budget
    shaped the output (it then finishes with "length").
    """

    __slots__ = ("_closers", "_cost", "_free", "_left", "_matcher", "_next_check", "_policy", "_words", "error",
                 "error_code", "wrapped")

    def __init__(self, matcher: llg.LLMatcher, vocab: int, closers: Closers, max_tokens: int, cost: int):
        self._matcher = matcher
        self._words = np.zeros((vocab + 31) // 32, dtype=np.int32)
        self._closers = closers
        self._left = max_tokens
        self._cost = cost  # tokens the closing policy needs from here, at most
        self._next_check = WRAP_WINDOW  # a margin at or below which the cost is measured again
        self._free = False  # the state the token being chosen leaves is a free string
        self._policy: int | None = None  # the closing policy's token in that state, when the mask kept it
        self.error = ""
        self.error_code: FailureCode = "engine_error"  # a refused token is our bug unless a grammar bound was hit
        self.wrapped = False

    def mask(self, logits: mx.array) -> mx.array:
        """Disallow every token the grammar refuses next, and near the end of the budget every
        token that could leave it too short to close (synchronous: reads grammar state)."""
        words = self._words
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        margin = self._left - self._cost
        if margin <= self._next_check:
            self._cost = closing_cost(self._matcher, self._closers, len(words), self._left)
            margin = self._left - self._cost
            self._next_check = margin - max(1, margin // 3)
        self._free = in_free_string(self._closers, words)
        self._policy = None
        if margin - 1 < self._closers.reach:
            self._keep_within(words, margin - 1)
        return apply_bitmask(logits, words)

    def _keep_within(self, words: np.ndarray, room: int) -> None:
        """Keep the tokens that add at most `room` to the closing cost, and the policy's own."""
        policy = pick(self._closers, words)
        kept = words & self._closers.fits(room, self._free, len(words))
        if policy is not None:
            kept[policy >> 5] |= np.uint32(1 << (policy & 31)).view(np.int32)
        elif not kept.any():
            return  # no token the policy knows, none that fits: the grammar's own choice is all there is
        if not np.array_equal(kept, words):
            self.wrapped = True  # the budget shaped the output
        words[:] = kept
        self._policy = policy

    def accept(self, token: int) -> bool:
        """Advance by one token; False (and `error` set) when the grammar refuses it."""
        self._left -= 1
        if self._matcher.consume_token(token):
            if token == self._policy:
                self._cost -= 1  # the policy's own token: one fewer to close, by its definition
            elif not (self._free and self._closers.content[token]):
                self._cost += int(self._closers.bounds[token])
            return True
        reason = _first_line(self._matcher.get_error())
        self.error = f"token {token} broke the output constraint: {reason}"
        if any(word in reason.lower() for word in _LIMIT_ERRORS):
            self.error = f"the output constraint is too complex to enforce: {reason}"
            self.error_code = INVALID_CONSTRAINT
        return False

    @property
    def done(self) -> bool:
        """The output is complete: nothing but EOS could follow (a refused token is not done)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()


class ConstraintFactory:
    """Builds constraints for one tokenizer, compiling each distinct spec once."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = CACHE_SIZE):
        """`tokenizer`: mlx_lm's TokenizerWrapper (or any HF fast tokenizer)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ConstraintError("this model's tokenizer is not a fast (tokenizers) one; "
                                  "constrained decoding needs its tokenizer.json")
        eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
        self.vocab_size = vocab_size
        self._tokenizer = llg.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
        self._limits = llg.LLParserLimits()
        self.closers = closers_for(backend, eos, self._tokenizer, vocab_size)
        # each spec's matcher and the closing policy's tokens from its start (or why it is refused),
        # by (prompt-cache partition, spec): a compile one API key paid is never another's fast path,
        # whose time would say that someone sent that schema (SPEC H7 as proposed)
        self._cache: OrderedDict[tuple[str, ConstraintSpec], tuple[llg.LLMatcher, int] | ConstraintError] = \
            OrderedDict()
        self._cache_size = cache_size
        self.compiles = 0

    def build(self, spec: ConstraintSpec, max_tokens: int, partition: str = "") -> Constraint:
        """A fresh constraint for one request; ConstraintError names what is wrong.

        A refusal is cached like a grammar: a client resending a schema whose
        probe exhausts the lexer fuel costs the worker that probe once."""
        key = (partition, spec)
        proto = self._cache.get(key)
        if proto is None:
            try:
                proto = self._compile(spec)
            except ConstraintError as exc:
                proto = exc
            self._cache[key] = proto
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        if isinstance(proto, ConstraintError):
            raise ConstraintError(proto.message, proto.code)
        matcher, shortest = proto
        if isinstance(spec, (JsonObject, JsonSchema)) and max_tokens < shortest <= WRAP_WINDOW:
            raise ConstraintError(f"max_tokens ({max_tokens}) is too small for {_describe(spec)}: the shortest "
                                  f"JSON the worker can close takes {shortest} tokens, so the reply could not "
                                  f"parse; ask for at least {shortest}")
        return Constraint(matcher.deep_copy(), self.vocab_size, self.closers, max_tokens, shortest)

    def _compile(self, spec: ConstraintSpec) -> tuple[llg.LLMatcher, int]:
        """The spec's matcher, refused here (before any token) when it cannot be enforced.

        Why: llguidance builds its lexer lazily, so a pattern whose regex
        explodes (`(a|aa){1000}`) compiled fine and failed on the first token
        inside it, mid-stream. So each regex of a JSON Schema is entered once
        on its own, and the whole grammar is walked a few tokens by the closing
        policy; a state that allows no token at all is an unsatisfiable spec.
        Each step is bounded by the lexer fuel above, so the probe is too."""
        grammar = grammar_for(spec)
        matcher = self._matcher(grammar, spec)
        patterns = dict(_patterns(spec))  # regex -> where
        try:  # all at once (one matcher); one by one only to name the culprit
            self._probe_patterns(list(patterns), spec)
        except ConstraintError:
            for pattern, where in patterns.items():
                self._probe_patterns([pattern], spec, f"{where} {pattern!r}")
            raise
        self._probe(matcher.deep_copy(), f"{_describe(spec)} cannot be enforced")
        self.compiles += 1
        return matcher, closing_cost(matcher, self.closers, (self.vocab_size + 31) // 32, WRAP_WINDOW)

    def _probe_patterns(self, patterns: list[str], spec: ConstraintSpec, where: str = "a pattern") -> None:
        """Enter the lexer of a string matching any of `patterns` (where a regex explodes)."""
        if patterns:
            schema = {"anyOf": [{"type": "string", "pattern": pattern} for pattern in patterns]}
            probe = self._matcher(_json_grammar(schema, strict=False), spec)
            self._probe(probe, f"{_describe(spec)} cannot be enforced: {where}")

    def _matcher(self, grammar: str, spec: ConstraintSpec) -> llg.LLMatcher:
        matcher = llg.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise ConstraintError(f"{_describe(spec)} cannot be enforced: {_first_line(matcher.get_error())}")
        return matcher

    def _probe(self, sim: llg.LLMatcher, what: str) -> None:
        """Dry-run the closing policy for PROBE_TOKENS tokens; ConstraintError on a dead end."""
        words = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
        for _ in range(PROBE_TOKENS):
            if sim.is_stopped():
                break
            sim.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            if sim.is_error():
                raise ConstraintError(f"{what}: {_first_line(sim.get_error())}")
            if not words.any():
                raise ConstraintError(f"{what}: no output satisfies it (no token is allowed"
                                      f"{' at the start' if not sim.is_accepting() else ''})")
            token = pick(self.closers, words)
            if token is None:
                return  # only tokens the policy does not rank: nothing known to be wrong
            if not sim.consume_token(token):
                raise ConstraintError(f"{what}: {_first_line(sim.get_error())}")


def _first_line(error: str) -> str:
    """llguidance's error without the grammar dump that follows its first line."""
    return error.split("\n", 1)[0]


def _patterns(spec: ConstraintSpec) -> list[tuple[str, str]]:
    """(regex, where it is) for every regex in the spec's JSON Schemas."""
    match spec:
        case JsonSchema(schema=text):
            return list(_schema_patterns(_parse_schema(text, "response_format.json_schema.schema"), "pattern"))
        case ToolCallConstraint(functions=functions):
            return [found for fn in functions
                    for found in _schema_patterns(_parse_schema(fn.parameters, f"tools[{fn.name}].parameters"),
                                                  f"tools[{fn.name}].parameters pattern")]
        case _:
            return []


_VALUES = frozenset({"enum", "const", "default", "examples"})  # JSON values, not schemas
_NAMED = frozenset({"properties", "$defs", "definitions", "dependentSchemas"})  # name -> schema


def _schema_patterns(node: object, where: str) -> Iterator[tuple[str, str]]:
    """(regex, where) for each `pattern` and `patternProperties` name below `node`."""
    if isinstance(node, list):
        for item in node:
            yield from _schema_patterns(item, where)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                yield value, where
            elif key in _NAMED and isinstance(value, dict):
                yield from _schema_patterns(list(value.values()), where)
            elif key == "patternProperties" and isinstance(value, dict):
                yield from ((name, where) for name in value)
                yield from _schema_patterns(list(value.values()), where)
            elif key not in _VALUES:
                yield from _schema_patterns(value, where)


def grammar_for(spec: ConstraintSpec) -> str:
    """The llguidance grammar text of a wire spec (no tokenizer needed)."""
    match spec:
        case JsonObject():
            return _json_grammar({"type": "object"}, strict=False)
        case JsonSchema(schema=text, strict=strict):
            return _json_grammar(_parse_schema(text, "response_format.json_schema.schema"), strict)
        case ToolCallConstraint():
            schema, strict = tool_call_schema(spec)
            return _json_grammar(schema, strict)
        case LarkGrammar(lark=lark):
            return llg.LLMatcher.grammar_from_lark(lark)
        case _:
            raise ConstraintError(f"unknown constraint {type(spec).__name__}")


def tool_call_schema(spec: ToolCallConstraint) -> tuple[dict, bool]:
    """JSON Schema of the call list: `[{"name": F, "arguments": <F's parameters>}, ...]`."""
    if not spec.functions:
        raise ConstraintError("tools must not be empty when a tool call is required")
    names = [fn.name for fn in spec.functions]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConstraintError(f"tools name the function {duplicates[0]!r} more than once")
    chosen = spec.functions
    if spec.mode == "named":
        chosen = tuple(fn for fn in spec.functions if fn.name == spec.name)
        if not chosen:
            raise ConstraintError(f"tool_choice names {spec.name!r}, which is not among the tools "
                                  f"({', '.join(names)})")
    calls = [{
        "type": "object",
        "properties": {"name": {"const": fn.name},
                       "arguments": closed_properties(_parse_schema(fn.parameters, f"tools[{fn.name}].parameters"))},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for fn in chosen]
    many = spec.parallel and spec.mode == "required"
    schema: dict = {"type": "array", "minItems": 1,
                    "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not many:
        schema["maxItems"] = 1
    return schema, all(fn.strict for fn in chosen)


# Keys whose value is a schema, and those whose value maps names (or positions) to schemas:
# where `closed_properties` looks for more objects. `allOf` is left alone: closing each of its
# parts would forbid the properties the other parts declare.
_SUBSCHEMA = frozenset({"items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
                        "additionalProperties", "unevaluatedItems"})
_SUBSCHEMAS = frozenset({"anyOf", "oneOf", "prefixItems"})
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_properties(schema: Any) -> Any:
    """A tool's parameters with every object that declares `properties` closed to them.

    Why: JSON Schema lets an object carry any property it does not declare, and a
    small model given a schema copies it into the arguments: SmolLM2, asked for a
    required call whose one parameter was `{"success": {"const": true}}`, wrote
    `{"success":true,"description":"test","type":"object","properties":{...` until
    max_tokens. llama.cpp's grammar admits only the declared properties, and OpenAI's
    strict mode asks for `additionalProperties: false`; so does this, unless the
    schema itself allows more (`additionalProperties` true or a schema for them,
    `patternProperties`, `unevaluatedProperties`). A copy: the caller's schema stays
    as it was (the compiled grammar is cached by the wire spec)."""
    if isinstance(schema, list):
        return [closed_properties(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA or key in _SUBSCHEMAS:
            out[key] = closed_properties(value)
        elif key in _NAMED and isinstance(value, dict):
            out[key] = {name: closed_properties(sub) for name, sub in value.items()}
        else:
            out[key] = value  # values (enum, const, default), allOf, and keywords about this node
    if isinstance(schema.get("properties"), dict) and not any(key in schema for key in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def _parse_schema(text: str, where: str) -> dict:
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise ConstraintError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ConstraintError(f"{where} must be a JSON object (a JSON Schema), got {type(schema).__name__}")
    return schema


def _json_grammar(schema: dict, strict: bool) -> str:
    try:
        return llg.LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": False, "lenient": not strict})
    except ValueError as exc:
        raise ConstraintError(f"schema rejected: {exc}") from None


def _describe(spec: ConstraintSpec) -> str:
    match spec:
        case JsonSchema(name=name):
            return f"response_format json_schema {name!r}" if name else "response_format json_schema"
        case ToolCallConstraint():
            return "the tools' parameters"
        case LarkGrammar():
            return "the grammar"
        case _:
            return "response_format json_object"
