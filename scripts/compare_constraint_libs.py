"""Compare the grammar libraries for constrained decoding on our own tokenizer and MLX logits.

    pip install llguidance xgrammar outlines-core   # only llguidance is a dependency
    python scripts/compare_constraint_libs.py [--model DIR] [--sequences N] [--vocab V]

Why: which library should the worker build on? This runs each
one the way the worker would: a tokenizer built from the model's
`tokenizer.json` (a byte-level BPE as `mlx_lm.load` gives it), schemas
compiled once, and per generated token: fill the allowed-token bitmask, apply
it to an `mx.array` of logits on the CPU, pick a token, advance. Logits are
random (as from our random-weight demo models), so every sequence walks a
different path through the grammar. A library that is not installed is
skipped. Figures are noisy on a shared machine: compare the rows of one run.
With --vocab, a bigger tokenizer is trained (no model needed) to see how the
mask cost grows with the vocabulary; the demo models have 4096 tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

try:
    from modelfiles.modelgen import make_model
except ImportError:  # run as a file from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from modelfiles.modelgen import make_model

import mlx.core as mx

from worker.constrain import apply_bitmask

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "address", "tags", "member"],
    "additionalProperties": False,
}


def _fn(name: str, params: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


TOOLS = {  # "required" over three functions: one call to any of them
    "type": "array", "minItems": 1, "maxItems": 1,
    "items": {"anyOf": [
        _fn("get_weather", {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"], "additionalProperties": False}),
        _fn("add", {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
            "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
            "required": ["a", "b"], "additionalProperties": False}),
        _fn("search", {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 20}, "limit": {"type": "integer", "minimum": 1, "maximum": 50}},
            "required": ["query", "limit"], "additionalProperties": False}),
    ]},
}

SCHEMAS = {"person": PERSON, "tool_required": TOOLS}


class Lib:
    """One library behind the three calls the engine makes per token."""

    name = ""
    supports = ""

    def compile(self, schema: dict):  # returns a fresh matcher
        raise NotImplementedError

    def fill(self, matcher, words: np.ndarray) -> None:
        raise NotImplementedError

    def accept(self, matcher, token: int) -> bool:
        raise NotImplementedError

    def done(self, matcher) -> bool:
        raise NotImplementedError


class LLGuidance(Lib):
    name = "llguidance"
    supports = ("JSON Schema (anyOf/oneOf/$ref/recursion, enum/const, pattern, min/max, "
                "additionalProperties), Lark CFG with embedded %json, regex; "
                "errors as values; no dependencies")

    def __init__(self, tokenizer_json: str, vocab: int, eos: list[int]):
        import llguidance as llg

        self.llg = llg
        self.tok = llg.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        matcher = self.llg.LLMatcher(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def fill(self, matcher, words):
        matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def accept(self, matcher, token):
        return matcher.consume_token(token)

    def done(self, matcher):
        return matcher.is_stopped()


class XGrammar(Lib):
    name = "xgrammar"
    supports = ("JSON Schema (anyOf, $ref, enum/const, pattern, min/max), EBNF, regex, "
                "structural tags for tool calls; needs torch + transformers + triton")

    def __init__(self, hf_tokenizer, vocab: int, eos: list[int]):
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.torch_mask = xgr.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, words):
        matcher.fill_next_token_bitmask(self.torch_mask)
        words[:] = self.torch_mask.numpy()[0]

    def accept(self, matcher, token):
        return matcher.accept_token(token)

    def done(self, matcher):
        return matcher.is_terminated()


class OutlinesCore(Lib):
    name = "outlines-core"
    supports = ("regular languages only: JSON Schema -> regex -> DFA over the whole vocabulary "
                "(no recursion, nesting unrolled), regex; no CFG; no dependencies")

    def __init__(self, hf_tokenizer, vocab: int, eos: list[int]):
        import outlines_core as oc

        self.oc = oc
        self.eos = eos[0]
        self.vocabulary = oc.Vocabulary(self.eos, _byte_vocab(hf_tokenizer, set(eos)))

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    def fill(self, matcher, words):
        matcher.write_mask_into(words.ctypes.data, words.size, words.itemsize)

    def accept(self, matcher, token):
        if token == self.eos:
            return matcher.is_finished()
        matcher.advance(token, return_tokens=False)
        return True

    def done(self, matcher):
        return False  # outlines-core's final state still allows EOS; the run ends on EOS


def _byte_vocab(hf_tokenizer, skip: set[int]) -> dict[bytes, list[int]]:
    """outlines-core wants token bytes; byte-level BPE stores them as GPT-2 unicode stand-ins."""
    table = {i: b for i, b in _unicode_to_bytes().items()}
    special = set(getattr(hf_tokenizer, "all_special_ids", []))
    out: dict[bytes, list[int]] = {}
    for text, idx in hf_tokenizer.get_vocab().items():
        if idx in skip or idx in special:
            continue
        out.setdefault(bytes(table[ch] for ch in text), []).append(idx)
    return out


def _unicode_to_bytes() -> dict[str, int]:
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = visible[:]
    n = 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(visible, chars)}


def run_sequences(lib: Lib, schema: dict, vocab: int, eos: set[int], sequences: int,
                  max_tokens: int = 400) -> dict:
    """Compile once per sequence (as a cache miss would), then time fill + apply per token."""
    compile_s, fill_us, apply_us, lengths, valid = [], [], [], [], 0
    words = np.zeros((vocab + 31) // 32, dtype=np.int32)
    for seed in range(sequences):
        start = time.perf_counter()
        matcher = lib.compile(schema)
        compile_s.append(time.perf_counter() - start)
        key = mx.random.key(seed)
        produced: list[int] = []
        for _ in range(max_tokens):
            key, sub = mx.random.split(key)
            raw = mx.random.normal((1, vocab), key=sub)
            mx.eval(raw)
            t0 = time.perf_counter()
            lib.fill(matcher, words)
            t1 = time.perf_counter()
            logits = apply_bitmask(raw, words)
            mx.eval(logits)
            t2 = time.perf_counter()
            fill_us.append((t1 - t0) * 1e6)
            apply_us.append((t2 - t1) * 1e6)
            token = mx.argmax(logits, axis=-1).item()
            assert isinstance(token, int)  # an index
            if token in eos:
                break
            if not lib.accept(matcher, token):
                break
            produced.append(token)
            if lib.done(matcher):
                break
        lengths.append(len(produced))
        valid += 1 if _valid(produced, schema) else 0
    return {"compile_ms": statistics.median(compile_s) * 1e3, "fill_p50": _pct(fill_us, 50),
            "fill_p99": _pct(fill_us, 99), "apply_p50": _pct(apply_us, 50),
            "tokens": statistics.median(lengths), "valid": valid, "n": sequences}


_DECODE: Callable[[list[int]], str] = lambda ids: ""


def _valid(tokens: list[int], schema: dict) -> bool:
    """Parses as JSON (raw control characters refused, as json.loads does) and validates."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(_DECODE(tokens)), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def _pct(values: list[float], p: int) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))]


def main(argv: list[str] | None = None) -> int:
    global _DECODE
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="an MLX model folder (default: a generated 2 MiB one)")
    parser.add_argument("--sequences", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=0, help="train a tokenizer of this size instead")
    args = parser.parse_args(argv)
    from transformers import PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as tmp:
        if args.vocab:
            from modelfiles.modelgen import train_tokenizer

            backend = train_tokenizer(args.vocab)
            hf = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
        else:
            model = args.model or Path(tmp) / "model"
            if args.model is None:
                make_model(model, 2 * 1024 * 1024, 0)
            hf = PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"), eos_token="</s>")
        vocab = hf.backend_tokenizer.get_vocab_size(with_added_tokens=True)
        eos = [hf.eos_token_id]

        def decode(ids: list[int]) -> str:
            text = hf.decode(ids)
            assert isinstance(text, str)  # one sequence in, one string out
            return text

        _DECODE = decode
        libs: list[Lib] = []
        makers: list[Callable[[], Lib]] = [lambda: LLGuidance(hf.backend_tokenizer.to_str(), vocab, eos),
                                           lambda: XGrammar(hf, vocab, eos), lambda: OutlinesCore(hf, vocab, eos)]
        for make in makers:
            try:
                start = time.perf_counter()
                lib = make()
                print(f"{lib.name}: tokenizer setup {(time.perf_counter() - start) * 1e3:.1f} ms; {lib.supports}")
                libs.append(lib)
            except ImportError as exc:
                print(f"skipped: {exc}")
        print(f"vocab {vocab}, {args.sequences} sequences per schema, random logits, greedy over the mask")
        print(f"{'library':<14} {'schema':<14} {'compile ms':>10} {'fill p50 us':>11} {'fill p99 us':>11} "
              f"{'apply p50 us':>12} {'tokens':>6} {'valid':>8}")
        for name, schema in SCHEMAS.items():
            for lib in libs:
                r = run_sequences(lib, schema, vocab, set(eos), args.sequences)
                print(f"{lib.name:<14} {name:<14} {r['compile_ms']:>10.2f} {r['fill_p50']:>11.1f} "
                      f"{r['fill_p99']:>11.1f} {r['apply_p50']:>12.1f} {r['tokens']:>6.0f} "
                      f"{r['valid']:>4}/{r['n']:<3}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
