"""The Ollama API's model routes: `/api/version`, `/api/tags`, `/api/ps`, `/api/show`,
and the store's routes memvisor cannot serve (`/api/push`, `/api/create`, ...).
`/api/pull` and `/api/delete` (models from the Hugging Face hub) are
http/ollama_pull.py.

Each model is described from its folder's small files (http/modelfacts.py,
read off the loop) and what the supervisor knows of it (`ModelInfo`): the
size measured once loaded, else A2's estimate; `/api/ps` lists the loaded
ones with when they expire. A model may be named with Ollama's `:latest` tag
("a:latest" is "a"), since clients append it. The generation routes are
http/ollama.py.
"""

from __future__ import annotations

import sys
from datetime import datetime, timedelta, timezone
from typing import Any, Union

from msgspec import Struct

from shared.states import SERVING_STATES
from supervisor.api import Supervisor
from supervisor.errors import ServeError
from supervisor.http.errors import ApiError
from supervisor.http.modelfacts import ModelFacts, capabilities, digest, facts_of, parameter_size
from supervisor.http.openai_types import BodyError, decode_body

# Why 0.6.4: VS Code's Ollama provider (and Open WebUI's version check) refuse a server
# older than 0.6.4, the release whose /api/show reports `capabilities`; we serve that shape.
VERSION = "0.6.4"
NEVER = datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone.utc)  # expires_at of a model that never expires


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
    """Bytes: measured when loaded, else A2's estimate (a .gguf file's size before it is read)."""
    return info.usage or info.estimated_bytes or facts.file_bytes


def _entry(info, facts: ModelFacts) -> dict[str, Any]:
    return {"name": info.id, "model": info.id, "modified_at": modified_at(facts), "size": size_of(info, facts),
            "digest": digest(info.id, info.path), "details": details(facts, info.estimated_bytes),
            "capabilities": capabilities(facts)}  # an embedding model says so in the list


async def tags(sup: Supervisor) -> dict[str, Any]:
    infos = [sup.model_info(m.id) for m in sup.config.models]
    facts = await facts_of([i.path for i in infos])
    return {"models": [_entry(i, facts[i.path]) for i in infos]}


async def ps(sup: Supervisor) -> dict[str, Any]:
    """Loaded models. size_vram: all of it on Apple's unified memory, 0 elsewhere (the CPU;
    a discrete GPU's share is not in ModelInfo yet)."""
    infos = [i for i in (sup.model_info(m.id) for m in sup.config.models) if i.state in SERVING_STATES]
    facts = await facts_of([i.path for i in infos])
    out = []
    for i in infos:
        entry = _entry(i, facts[i.path])
        expires = NEVER if i.expires_in is None else datetime.now(timezone.utc) + timedelta(seconds=i.expires_in)
        entry.update(expires_at=rfc3339(expires), size_vram=entry["size"] if sys.platform == "darwin" else 0,
                     context_length=facts[i.path].context_length or 0)
        out.append(entry)
    return {"models": out}


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
    if info.estimated_bytes and facts.bytes_per_parameter:
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
