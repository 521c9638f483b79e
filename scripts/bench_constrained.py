"""Constrained decoding cost: per-token mask time and engine tokens/s with and without a grammar.

    python scripts/bench_constrained.py [--model DIR | --size SIZE --dtype D] [--tokens N]
                                        [--repeats R] [--streams S]

Why: constrained streams are held to >= 80% of the unconstrained
tokens/s. A constrained token costs its grammar mask (llguidance, then the
bitmask applied to the MLX logits) and its look-ahead: the engine cannot
queue a constrained sequence's next token before reading the current one.
Both sides run through the engine's step loop on the same model and prompt,
greedy, counted from the first generated token to the last, in R pairs (one
free run, then one constrained). The headline gives the medians and the
median of the pairs' ratios: on a machine shared with other work, load
drifts slower than a pair takes, so a pair sees one load and the median of
ratios is steadier than best-of (the best runs are printed too). CPU time
per token (process_time) is printed as well: it counts the work each token
costs and hardly moves with other processes' load. The JSON Schema has free
strings, so a random-weight model writes until the budget's wrap-up closes
the object: the wrap-up's dry runs are inside the figure.

The mask cost is measured apart: the constrained outputs are replayed on a
fresh constraint, timing `mask()` + evaluating the masked logits per token.
Without --model a 16 MiB float32 model is generated (MLX's CPU backend decodes
float32 fastest). Last line: `constrained decoding: X tok/s vs Y tok/s
unconstrained (Z%), mask p50 A µs`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

try:
    from modelfiles.modelgen import make_model
except ImportError:  # run as a file from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from modelfiles.modelgen import make_model

import mlx.core as mx

from shared import protocol as p
from shared.limits import Limits
from shared.protocol import Failed, Finished, TokenOut
from shared.sizes import parse_size

PROMPT = "Answer with a JSON record of a person who lives in a small town by the sea:"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "street": {"type": "string"}},
                    "required": ["city", "street"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string"}},
        "bio": {"type": "string"},
    },
    "required": ["name", "age", "color", "address", "tags", "bio"],
    "additionalProperties": False,
}
SPEC = p.JsonSchema(schema=json.dumps(SCHEMA), name="person")


def run_engine(engine, prompt: list[int], tokens: int, streams: int, constrained: bool):
    """(tokens/s over all streams after the first token, token ids per stream, CPU s per token)."""
    for i in range(streams):
        engine.submit(f"s{i}", prompt, max_tokens=tokens, constraint=SPEC if constrained else None)
    limits = Limits(max_concurrency=streams)
    ids: dict[str, list[int]] = {f"s{i}": [] for i in range(streams)}
    first = last = cpu_first = cpu_last = 0.0
    count = ended = 0
    while ended < streams:
        for event in engine.step(limits, _zero):
            if isinstance(event, TokenOut):
                now, cpu = time.perf_counter(), time.process_time()
                first, cpu_first = first or now, cpu_first or cpu
                last, cpu_last = now, cpu
                count += 1
                ids[event.request_id].append(event.token_id)
            elif isinstance(event, Failed):
                raise SystemExit(f"benchmark request failed: {event.message}")
            elif isinstance(event, Finished):
                ended += 1
    return (count - streams) / (last - first), list(ids.values()), (cpu_last - cpu_first) / (count - streams)


def mask_cost(engine, outputs: list[list[int]]) -> list[float]:
    """Microseconds per `mask()` (grammar + bitmask on the logits, evaluated), replaying outputs."""
    factory = engine._constraints
    vocab = factory.vocab_size
    logits = mx.random.normal((1, vocab), key=mx.random.key(0))
    mx.eval(logits)
    times = []
    for output in outputs:
        constraint = factory.build(SPEC, len(output))
        for token in output:
            start = time.perf_counter()
            mx.eval(constraint.mask(logits))
            times.append((time.perf_counter() - start) * 1e6)
            if not constraint.accept(token):
                break
    return sorted(times)


def _zero() -> int:
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--size", default="16MiB")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--streams", type=int, default=1)
    args = parser.parse_args(argv)
    import mlx_lm

    from worker.engine import Engine

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            path = Path(tmp) / "bench-model"
            make_model(path, parse_size(args.size), 0, dtype=args.dtype)
        loaded = mlx_lm.load(str(path))  # (model, tokenizer): no config asked
        model, tokenizer = loaded[0], loaded[1]
    engine = Engine(model, tokenizer, own_usage_fn=_zero)
    prompt = engine.encode_prompt(PROMPT)
    # warm up both paths (and compile the grammar once), with a budget the schema can close in
    run_engine(engine, prompt, args.tokens, 1, False)
    run_engine(engine, prompt, args.tokens, 1, True)
    free, bound, outputs, free_cpu, bound_cpu = [], [], [], [], []
    for _ in range(args.repeats):
        rate, _, cpu = run_engine(engine, prompt, args.tokens, args.streams, False)
        free.append(rate)
        free_cpu.append(cpu)
        rate, out, cpu = run_engine(engine, prompt, args.tokens, args.streams, True)
        bound.append(rate)
        bound_cpu.append(cpu)
        outputs.extend(out)
    times = mask_cost(engine, outputs)
    p50, p99 = times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.99))]
    valid = sum(_valid(tokenizer.decode(out)) for out in outputs)
    f, b = statistics.median(free), statistics.median(bound)
    paired = statistics.median(c / u for c, u in zip(bound, free))
    print(f"{path.name}: {args.streams} stream(s), {args.tokens} tokens x {args.repeats} pairs; "
          f"best {max(bound):.1f} / {max(free):.1f} tok/s = {max(bound) / max(free):.1%}; "
          f"ratio of medians {b / f:.1%}")
    fc, bc = statistics.median(free_cpu) * 1e3, statistics.median(bound_cpu) * 1e3
    print(f"CPU time per token (all threads of this process; steadier than wall time under "
          f"load): constrained {bc:.2f} ms vs {fc:.2f} ms unconstrained ({fc / bc:.1%} as a rate)")
    print(f"mask per token over {len(times)} tokens: p50 {p50:.0f} µs, p99 {p99:.0f} µs "
          f"(p99: the wrap-up's dry runs); constrained outputs valid for the schema: "
          f"{valid}/{len(outputs)}")
    print(f"constrained decoding: {b:.1f} tok/s vs {f:.1f} tok/s unconstrained ({paired:.1%}), "
          f"mask p50 {p50:.0f} µs")
    return 0


def _valid(text: str) -> bool:
    try:
        import jsonschema

        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except Exception:  # noqa: BLE001 - any failure is "not valid" in the count
        return False


if __name__ == "__main__":
    sys.exit(main())
