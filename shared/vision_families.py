"""Which model folders are vision-language models memvisor runs (docs/vision.md).

Read by both sides from the folder's config.json, without MLX: the supervisor to
say `vision` on a model's card and to refuse images for a text model
(`model_lacks_vision`), the worker to pick its engine (worker/vision.py).

Why a list of families and not "any config with a vision_config": the worker's
vision engine runs a family's vision tower through mlx-vlm and its text half
through mlx-lm's batched decode, which holds only where the text half is an
ordinary decoder with 1-D positions (Idefics3 and SmolVLM: a llama). A family
whose text half places image tokens on 2-D or 3-D positions (Qwen2-VL's M-RoPE)
or attends across the image both ways (Gemma 3, PaliGemma) is not claimed until
it is served and tested.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from shared.modelinfo import read_config_json

VISION_FAMILIES = ("smolvlm", "idefics3")


def vision_family(config: Mapping[str, Any]) -> str | None:
    """The family of a config.json that describes a vision model we serve, else None."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type.lower() not in VISION_FAMILIES:
        return None
    return model_type.lower() if isinstance(config.get("vision_config"), dict) else None


def is_vision_model(path: str | os.PathLike[str]) -> bool:
    """Whether the folder at `path` holds a vision model we serve (a missing or unreadable config: no)."""
    config = read_config_json(path)
    return config is not None and vision_family(config) is not None
