"""What a model folder's config.json says about its context window, read without MLX.

Why: the supervisor refuses a request whose `max_tokens` cannot fit the
model's context before any worker exists (it never imports MLX), and the
worker refuses a prompt that, tokenized, leaves no room for `max_tokens`
(issue 16: a 200k-token prompt, 49x the context, was accepted).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# Where model families keep their context length, most common first.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx",
                 "max_seq_len")
_CONFIG_MAX_BYTES = 4 * 1024 * 1024


def context_length(path: str | os.PathLike[str]) -> int | None:
    """The model's context window in tokens, or None when its folder does not say
    (a missing or unreadable config.json, a GGUF file, no known key)."""
    config = Path(path) / "config.json"
    try:
        if config.stat().st_size > _CONFIG_MAX_BYTES:
            return None
        data = json.loads(config.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    for section in (data, data.get("text_config")):
        if not isinstance(section, dict):
            continue
        for key in _CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31:
                return value
    return None
