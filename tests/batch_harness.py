"""What the batched-decode tests share (no tests here): prompts of different lengths, the tiny
model in float16 and in float32, the real model counting its forward passes, and each request's
tokens alone or joined at its own step. Batching must change how fast tokens come, never which.
"""

from __future__ import annotations

from shared.sizes import MiB
from tests.engine_harness import OPEN, Run, drive
from worker.engine import Engine

PROMPTS = {  # different lengths, so rows are left-padded differently
    "a": "Once upon a time",
    "b": "The memory guard watches every model and steps in early, before the machine swaps.",
    "c": "def main():",
    "d": "A worker holds one model; the supervisor holds the workers and the memory they may use. "
         "When a prompt is long, its prefill is cut into chunks.",
    "e": "x",
}

DTYPES = ["float16", "float32"]


def load_tiny(dtype: str, tiny_model, tmp_path_factory):
    """(model, tokenizer): the session's tiny model as it is (float16), or made again in float32."""
    import mlx_lm

    if dtype == "float16":
        return mlx_lm.load(str(tiny_model))
    from modelfiles.modelgen import make_model

    path = tmp_path_factory.mktemp("f32") / "tiny-f32"
    make_model(path, 4 * MiB, 5, dtype="float32")
    return mlx_lm.load(str(path))


class Counting:
    """The real model, counting forward passes and the batch size of each."""

    def __init__(self, model):
        self.model = model
        self.batches: list[int] = []

    def __call__(self, inputs, *args, **kwargs):
        self.batches.append(inputs.shape[0])
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def alone(engine: Engine, prompts: dict[str, list[int]], max_tokens: int, **sampling) -> dict[str, list[int]]:
    """Each request run by itself, one after another: what batching must not change."""
    out = {}
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, max_tokens=max_tokens, **sampling)
        out[rid] = drive(engine).tokens(rid)
    return out


def staggered(engine: Engine, prompts: dict[str, list[int]], joins: dict[str, int], max_tokens,
               **sampling) -> Run:
    """Submit each request at its step (so it joins a batch already decoding), drive to the end."""
    run = Run()
    for step in range(4000):
        for rid, at in joins.items():
            if at == step:
                tokens = max_tokens[rid] if isinstance(max_tokens, dict) else max_tokens
                engine.submit(rid, prompts[rid], max_tokens=tokens, **sampling)
        if step > max(joins.values()) and not engine.has_work:
            return run
        run.add(engine.step(OPEN, lambda: 0))
    raise AssertionError("engine still busy")
