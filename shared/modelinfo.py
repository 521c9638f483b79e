"""What a model folder's config.json says about its context window and its attention
shape, read without MLX; and the one bounded way the supervisor reads a small file from
a models folder.

Why: the supervisor refuses a request whose `max_tokens` cannot fit the
model's context before any worker exists (it never imports MLX), and the
worker refuses a prompt that, tokenized, leaves no room for `max_tokens`
(a 200k-token prompt, 49x the context, was accepted).

Why the bounds: a models folder is input. A named pipe called
`config.json` or `model.safetensors` froze the supervisor for good at its
`open()`, and a 1 GiB sparse config.json took it to 2.2 GB. Every read of a
model's files goes through `open_regular`: it refuses what is not a regular
file (checked on the opened descriptor, opened with O_NONBLOCK so a FIFO never
blocks the open) and what is larger than the caller's cap.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

# Where model families keep their context length, most common first.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx",
                 "max_seq_len")
CONFIG_MAX_BYTES = 4 * 1024 * 1024  # a real config.json is a few KB; tokenizer-sized ones are not read here


class FileRefused(OSError):
    """A model file that is not read: not a regular file, or over its size cap."""


def open_regular(path: str | os.PathLike[str], max_bytes: int, *, flags: int = 0,
                 check: Callable[[os.stat_result], str | None] | None = None) -> BinaryIO:
    """`path` opened for reading, when it is a regular file of at most `max_bytes`.

    The check is on the descriptor itself (fstat after an O_NONBLOCK open), so
    a file swapped for a pipe between a check and the open is still refused.
    `flags` are added to the open's (the caches folder adds O_NOFOLLOW), and
    `check` may refuse the file from its fstat: a reason, or None to accept
    (shared/private_files.py refuses a file another user owns)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | flags)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):  # as open() says it
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        if not stat.S_ISREG(info.st_mode):
            raise FileRefused(f"{path}: not a regular file ({file_kind(info.st_mode)}); refused")
        if info.st_size > max_bytes:
            raise FileRefused(f"{path}: {info.st_size} bytes, over the {max_bytes}-byte cap for this file; refused")
        refused = check(info) if check is not None else None
        if refused is not None:
            raise FileRefused(refused)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_small(path: str | os.PathLike[str], max_bytes: int = CONFIG_MAX_BYTES) -> bytes:
    """The whole of a regular file of at most `max_bytes` (never more is read,
    even when the file grows after the check)."""
    with open_regular(path, max_bytes) as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise FileRefused(f"{path}: grew past the {max_bytes}-byte cap while being read; refused")
    return data


def file_kind(mode: int) -> str:
    """What a file of `mode` is, in words (for a refusal's message)."""
    for test, name in ((stat.S_ISREG, "a file"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


def read_config_json(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The model folder's config.json as an object, or None when it is missing,
    refused, unreadable or not an object."""
    try:
        data = json.loads(read_small(Path(path) / "config.json"))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def config_refusal(path: str | os.PathLike[str]) -> str | None:
    """Why the model folder's config.json is refused (not a regular file, over
    CONFIG_MAX_BYTES, not a JSON object), or None when it is fine or absent.

    Why: `read_config_json` answers None for a refused file as for a
    missing one, so a 1 GiB sparse config.json passed every check and the
    worker read it (2 GiB RSS, killed as wedged). Whoever decides whether a
    model can be loaded asks this instead. A passing failure (EMFILE) is
    raised, not taken for the file's fault."""
    file = Path(path) / "config.json"
    try:
        data = json.loads(read_small(file))
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        return f"{file}: a folder, not a file; refused"
    except FileRefused as exc:
        return str(exc)
    except (ValueError, RecursionError) as exc:
        return f"{file}: not valid JSON ({str(exc)[:200]}); refused"
    if not isinstance(data, dict):
        return f"{file}: not a JSON object; refused"
    return None


class AttentionShape(msgspec.Struct, frozen=True, kw_only=True):
    """The dimensions of a standard attention model that its KV cache and activations scale with.

    Why one struct: the supervisor (\"will it fit with N tokens of context?\") and the
    worker's prefill guard (G1's prior) both cost a token of KV; the formula lives here,
    once. A dimension the config does not give is 0, and so is the cost built on it.
    """

    layers: int = 0
    hidden: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0

    def kv_bytes_per_token(self, width: int) -> int:
        """Keys and values (2) x layers x KV heads x head width x bytes per element."""
        return 2 * self.layers * self.kv_heads * self.head_dim * width


def attention_shape(config: Mapping[str, Any], *, layers: int | None = None) -> AttentionShape:
    """The shape from a config.json object (or a loaded model's arguments, which use its keys).

    A multimodal config's `text_config` overrides the top level; `num_key_value_heads`
    defaults to the heads (no GQA) and `head_dim` to hidden / heads. `layers` replaces
    `num_hidden_layers` where the caller counted them itself (a loaded model's layers).
    """
    text = config.get("text_config")
    if isinstance(text, Mapping):
        config = {**config, **text}
    heads, hidden = _positive(config.get("num_attention_heads")), _positive(config.get("hidden_size"))
    return AttentionShape(
        layers=_positive(config.get("num_hidden_layers")) if layers is None else max(0, layers),
        hidden=hidden, heads=heads,
        kv_heads=_positive(config.get("num_key_value_heads")) or heads,
        head_dim=_positive(config.get("head_dim")) or (hidden // heads if heads else 0),
    )


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def dtype_bytes(config: Mapping[str, Any]) -> int:
    """Bytes of one activation (and KV) element, from the config's dtype (the text model's
    where it has one); 2 (float16) when the config does not say."""
    text = config.get("text_config")
    merged = {**config, **text} if isinstance(text, Mapping) else config
    return _DTYPE_BYTES.get(str(merged.get("torch_dtype") or merged.get("dtype") or ""), 2)


def _positive(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def context_length(path: str | os.PathLike[str]) -> int | None:
    """The model's context window in tokens, or None when its folder does not say
    (a missing or unreadable config.json, a GGUF file, no known key)."""
    data = read_config_json(path)
    if data is None:
        return None
    for section in (data, data.get("text_config")):
        if not isinstance(section, dict):
            continue
        for key in _CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31:
                return value
    return None
