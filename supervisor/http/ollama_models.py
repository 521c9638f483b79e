"""The Ollama API's model routes: `/api/version`, `/api/tags`, `/api/ps`, `/api/show`,
and the store's routes memvisor cannot serve (`/api/push`, `/api/create`, ...).
`/api/pull` and `/api/delete` (models from the Hugging Face hub) are
http/ollama_pull.py.

Each model is described from its folder's small files and its weights'
headers (http/modelfacts.py, read off the loop) and what the supervisor knows
of it (`ModelInfo`). `size` is what Ollama gives: the model's weight files on
disk, fixed whatever the worker holds now (the worker's memory is `ps`'s and
`/status`'s); `/api/ps` lists the loaded ones with when they expire and
`size_vram` as Ollama means it (docs/api.md). A model may be named with Ollama's `:latest` tag
("a:latest" is "a"), since clients append it. The generation routes are
http/ollama.py.
"""

from __future__ import annotations

import sys
from datetime import datetime, timedelta, timezone
from typing import Any, Union

from msgspec import Struct

from shared.states import SERVING_STATES
from supervisor.doors.api import Supervisor
from supervisor.doors.refusals import ServeError
from supervisor.http.errors import ApiError
from supervisor.http.modelfacts import ModelFacts, capabilities, digest, facts_of, parameter_size
from supervisor.http.openai_types import BodyError, decode_body
from supervisor.policy.snapshot import Snapshot

# Why 0.6.4: VS Code's Ollama provider (and Open WebUI's version check) refuse a server
# older than 0.6.4, the release whose /api/show reports `capabilities`; we serve that shape.
VERSION = "0.6.4"
# A model that never expires: Ollama's keep_alive -1 is Go's longest time.Duration, and its
# `ps` answers now + that (about 292 years; its own CLI shows "Forever" past 20 years).
FOREVER = timedelta(microseconds=(2**63 - 1) // 1000)


class ShowRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: Union[str, None] = None
    name: Union[str, None] = None  # the older spelling
    verbose: Union[bool, None] = None


def now_rfc3339() -> str:
    return rfc3339(datetime.now(timezone.utc))


def rfc3339(when: datetime) -> str:
    return when.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


def resolve(sup: Supervisor, name: str) -> str:
    """The model id a request names: an id or alias, also with Ollama's ":latest" tag."""
    if sup.config.model(name) is None and name.endswith(":latest"):
        name = name.removesuffix(":latest")
    try:
        return sup.model_config(name).id
    except ServeError as exc:
        raise ApiError(404, f"model '{name}' not found: {exc}", code=exc.code) from None


def details(facts: ModelFacts, estimated_bytes: int) -> dict[str, Any]:
    return {"parent_model": "", "format": facts.format, "family": facts.family,
            "families": [facts.family] if facts.family else None,
            "parameter_size": parameter_size(estimated_bytes, facts),
            "quantization_level": facts.quantization_level}


def size_of(info, facts: ModelFacts) -> int:
    """Bytes, as Ollama gives them: the weight files' size, else A2's estimate."""
    return facts.file_bytes or info.estimated_bytes


def _entry(info, facts: ModelFacts) -> dict[str, Any]:
    return {"name": info.id, "model": info.id, "modified_at": modified_at(facts), "size": size_of(info, facts),
            "digest": digest(info.id, info.path), "details": details(facts, info.estimated_bytes),
            "capabilities": capabilities(facts)}  # an embedding model says so in the list


async def tags(sup: Supervisor) -> dict[str, Any]:
    infos = [sup.model_info(m.id) for m in sup.config.models]
    facts = await facts_of([i.path for i in infos])
    return {"models": [_entry(i, facts[i.path]) for i in infos]}


async def ps(sup: Supervisor) -> dict[str, Any]:
    """Loaded models, each with `expires_at` (P10's timer, or FOREVER) and `size_vram`."""
    infos = [i for i in (sup.model_info(m.id) for m in sup.config.models) if i.state in SERVING_STATES]
    facts = await facts_of([i.path for i in infos])
    snapshot = sup.last_snapshot()
    out = []
    now = datetime.now(timezone.utc)
    for i in infos:
        entry = _entry(i, facts[i.path])
        expires = now + (FOREVER if i.expires_in is None else timedelta(seconds=i.expires_in))
        entry.update(expires_at=rfc3339(expires), size_vram=size_vram(entry["size"], i.worker, snapshot),
                     context_length=facts[i.path].context_length or 0)
        out.append(entry)
    return {"models": out}


def size_vram(size: int, worker: str, snapshot: Snapshot | None) -> int:
    """How much of `size` the GPU holds, as Ollama reports it: all of it on Apple's unified
    memory (Metal reads the weights where they are), the device's share on a discrete GPU (the
    worker's device bytes, at most `size`), 0 on the CPU."""
    if sys.platform == "darwin":
        return size
    if snapshot is None or snapshot.device_total <= 0:
        return 0
    held = next((w.device_bytes for w in snapshot.workers if w.worker == worker), 0)
    return min(size, held)


def modified_at(facts: ModelFacts) -> str:
    """When the model's files last changed (config.json's mtime); now when unknown."""
    if not facts.modified:
        return now_rfc3339()
    return rfc3339(datetime.fromtimestamp(facts.modified, timezone.utc))


async def show(sup: Supervisor, body: bytes) -> dict[str, Any]:
    req = decode_body(body, ShowRequest)
    name = req.model or req.name
    if not name:
        raise BodyError("model: required (the model to show)", param="model")
    info = sup.model_info(resolve(sup, name))
    facts = (await facts_of([info.path]))[info.path]
    arch = facts.family or "unknown"
    model_info: dict[str, Any] = {"general.architecture": arch, "general.basename": info.id}
    if facts.context_length:
        model_info[f"{arch}.context_length"] = facts.context_length
    if facts.embedding is not None:  # Ollama's key for a vector's length
        model_info[f"{arch}.embedding_length"] = facts.embedding.dims
        model_info[f"{arch}.pooling_type"] = facts.embedding.pooling
    if facts.parameters:
        model_info["general.parameter_count"] = facts.parameters
    elif info.estimated_bytes and facts.bytes_per_parameter:
        model_info["general.parameter_count"] = int(info.estimated_bytes / facts.bytes_per_parameter)
    return {"license": "", "modelfile": "", "parameters": "", "template": facts.template,
            "details": details(facts, info.estimated_bytes), "model_info": model_info,
            "capabilities": capabilities(facts), "modified_at": modified_at(facts)}


# Ollama's routes that manage its own model store; memvisor serves folders on disk
# (and pulls from the Hugging Face hub: /api/pull, /api/delete).
NO_HUB = {"/api/push": "push", "/api/create": "create", "/api/copy": "copy", "/api/blobs": "upload blobs"}


def no_hub(path: str) -> ApiError:
    """A clear 501 for routes that need Ollama's model store or hub."""
    what = next((v for k, v in NO_HUB.items() if path == k or path.startswith(k + "/")), "manage models")
    return ApiError(501, f"memvisor cannot {what} models: it has no model store of its own. It serves model "
                         "folders on disk (add one under [[models]] or a models_dirs folder, then `python -m supervisor "
                         "reload`) and pulls from the Hugging Face hub (/api/pull ORG/NAME)", code="not_implemented")
