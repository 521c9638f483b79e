"""A local model folder loaded for the engine: its weights' size, the model and its tokenizer
as `mlx_lm.load` gives them (never a download; W3's phases timed on a `LoadMeter`,
worker/loader.py), and the draft model (worker/draft.py) that guesses for it when one is named.

Apart from worker/engine.py because none of it needs an engine: it runs before one is built,
and what fails here is a `load_failed` that names the folder and why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared.weights import WeightsError, estimate_weight_bytes
from worker.draft import DraftModel, same_vocabulary
from worker.loader import LoadMeter, load_generator
from worker.request import EngineError

NO_TOKENIZER_LIMIT = int(1e30)  # transformers' own "no limit" (VERY_LARGE_INTEGER): it never warns past it


def load_folders(directory: Path, meter: LoadMeter | None, draft_path: str = "") -> tuple[int, Any, Any, DraftModel | None]:
    """(weight bytes, model, tokenizer, draft) of `directory` and, when named, of the draft model at
    `draft_path` (its bytes counted in); EngineError `load_failed` saying why."""
    weight_bytes, (model, tokenizer) = _load(directory, meter)
    draft = None
    if draft_path:
        draft_bytes, (draft_model, draft_tokenizer) = _load(Path(draft_path), None, what="draft model ")
        problem = same_vocabulary(tokenizer, draft_tokenizer)
        if problem is not None:
            raise EngineError("load_failed", f"draft model {draft_path} cannot guess for {directory}: {problem}")
        draft, weight_bytes = DraftModel(draft_model, draft_path), weight_bytes + draft_bytes
    # The context limit is the engine's (config.json's, set by Engine.load): a prompt over it is refused,
    # not run. The tokenizer's own model_max_length only made transformers log "Token indices
    # sequence length is longer than the specified maximum ... indexing errors" for such a
    # prompt, which reads like our crash; we never ask it to truncate, so it gets no limit.
    tokenizer.model_max_length = NO_TOKENIZER_LIMIT
    return weight_bytes, model, tokenizer, draft


def _load(directory: Path, meter: LoadMeter | None, what: str = "") -> tuple[int, tuple[Any, Any]]:
    """(weight bytes, (model, tokenizer)) of a local folder, as mlx_lm.load gives them (W3's phases
    on `meter`); EngineError `load_failed` saying why."""
    if not (directory / "config.json").is_file():
        raise EngineError("load_failed", f"no {what}at {directory}: config.json not found")
    try:
        return estimate_weight_bytes(directory), load_generator(directory, meter)
    except WeightsError as exc:
        raise EngineError("load_failed", str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - any loader failure is a load error
        raise EngineError("load_failed", f"cannot load {what}{directory}: {exc}") from exc


