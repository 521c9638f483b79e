"""Ollama's `options` as the worker's sampling settings (http/ollama.py, and /api/embed's check).

Each option Ollama documents that changes the tokens maps to the `Generate` field
of the same meaning, with Ollama's defaults; the placement and context options
are accepted and change nothing; any other option with a value is a 400 naming
it, never silently dropped.
"""

from __future__ import annotations

from typing import Any, Union

from msgspec import Struct

from supervisor.http.openai_types import DEFAULT_CHAT_MAX_TOKENS, MAX_STOP_SEQUENCES, WHOLE_CONTEXT, BodyError

# Accepted with no effect on the output, truthfully: the model runs with its whole
# context and the guard (not a window size) bounds its memory; the others place or
# pace the work (threads, batches, GPUs, mmap), which the worker decides, and leave
# the tokens as they are. Continue and Open WebUI send some of them.
REPEAT_LAST_N = 64  # Ollama's default look-back of the penalties
NEUTRAL_OPTIONS = frozenset({"num_ctx", "num_thread", "num_batch", "num_gpu", "main_gpu", "low_vram", "numa",
                             "use_mmap", "use_mlock"})


class Sampling(Struct, kw_only=True):
    """The `Generate` fields Ollama's options set (same names), with Ollama's defaults."""

    max_tokens: int = DEFAULT_CHAT_MAX_TOKENS
    temperature: float = 0.8  # Ollama's default
    top_p: float = 0.9  # Ollama's default
    stop: list[str] = []
    seed: Union[int, None] = None
    # The penalties are off unless asked for: Ollama's documented repeat_penalty
    # default (1.1) is not what its newer engine applies, and a default that changes
    # the tokens is one a client cannot see.
    top_k: int = 40  # Ollama's default
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_context_size: int = REPEAT_LAST_N  # Ollama's repeat_last_n: one look-back for all three
    presence_context_size: int = REPEAT_LAST_N
    frequency_context_size: int = REPEAT_LAST_N

    def look_back(self, tokens: int) -> None:
        self.repetition_context_size = self.presence_context_size = self.frequency_context_size = tokens


def sampling(options: dict[str, Any] | None) -> Sampling:
    """Ollama `options` -> the worker's sampling settings; any other option with a value
    is a 400 naming it (`options.top_k`), never silently dropped."""
    out = Sampling()
    for key, value in (options or {}).items():
        where = f"options.{key}"
        if value is None or key in NEUTRAL_OPTIONS:
            continue
        if key == "temperature":
            out.temperature = _number(value, where, 0.0, 2.0)
        elif key == "top_p":
            out.top_p = _number(value, where, 0.0, 1.0)
            if out.top_p == 0.0:
                raise BodyError(f"{where}: must be above 0", param=where)
        elif key == "num_predict":
            if isinstance(value, bool) or not isinstance(value, int) or not (value in (-1, -2) or 1 <= value <= 1_000_000):
                raise BodyError(f"{where}: a whole number of tokens from 1 to 1000000, or -1 (the default "
                                f"limit, {DEFAULT_CHAT_MAX_TOKENS})", param=where)
            out.max_tokens = value if value > 0 else DEFAULT_CHAT_MAX_TOKENS
        elif key == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise BodyError(f"{where}: a list of non-empty strings", param=where)
            if len(stops) > MAX_STOP_SEQUENCES:
                raise BodyError(f"{where}: at most {MAX_STOP_SEQUENCES} sequences", param=where)
            out.stop = list(stops)
        elif key == "seed":
            if isinstance(value, bool) or not isinstance(value, int) or not -(2**63) <= value < 2**64:
                raise BodyError(f"{where}: a whole number that fits in 64 bits", param=where)
            out.seed = value
        elif key in _PENALTIES:
            setattr(out, _PENALTIES[key], _penalty(key, value, where))
        elif key == "top_k":
            out.top_k = max(0, _whole(value, where, -1, WHOLE_CONTEXT))  # Ollama: 0 or less is off
        elif key == "min_p":
            out.min_p = _number(value, where, 0.0, 1.0)
        elif key == "repeat_last_n":
            look_back = _whole(value, where, -1, WHOLE_CONTEXT)
            out.look_back(WHOLE_CONTEXT if look_back == -1 else look_back)  # -1: the whole context
        else:
            raise BodyError(f"{where}: not supported by this server (it honours temperature, top_p, top_k, "
                            "min_p, num_predict, stop, seed, repeat_penalty, repeat_last_n, presence_penalty "
                            "and frequency_penalty, and accepts num_ctx and the thread/GPU placement "
                            "options, which change no output)", param=where)
    return out


_PENALTIES = {"repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
              "frequency_penalty": "frequency_penalty"}


def _penalty(key: str, value: Any, where: str) -> float:
    """repeat_penalty multiplies (above 0; 1 is off), presence and frequency subtract (-2 to 2)."""
    if key == "repeat_penalty":
        number = _number(value, where, 0.0, 10.0)
        if number == 0.0:
            raise BodyError(f"{where}: must be above 0 (1 is no penalty)", param=where)
        return number
    return _number(value, where, -2.0, 2.0)


def _whole(value: Any, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BodyError(f"{where}: a whole number from {low} to {high}, got {value!r}", param=where)
    return value


def _number(value: Any, where: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BodyError(f"{where}: a number from {low:g} to {high:g}, got {value!r}", param=where)
    return float(value)
