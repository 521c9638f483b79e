"""The configured models and what their files say, read off the loop.

Before a model is loaded, fitted or asked for a request, the supervisor
needs facts from its folder: A2's weight estimate, the KV bytes per token of
context (a dry run's fit), the context window (a request's max_tokens is
checked against it), and whether it embeds rather than chats. Reading them
touches a disk, so it runs on a thread with a time bound (`off_loop`); the
loop never waits on a file. Concurrent callers share one read, and a model
whose files are refused is said once as a `refused` event and counted.

A `.gguf` path loads from the MLX folder imported from it on first load.
"""

from __future__ import annotations

import asyncio
import errno
import logging

import msgspec

from shared.embedding import EmbeddingSpec, read_embedding_spec
from shared.gguf import is_gguf_path
from shared.modelinfo import FileRefused, context_length
from shared.weights import WeightsError, estimate_weight_bytes, kv_bytes_per_token
from supervisor.config import Config, ModelConfig
from supervisor.doors.refusals import LoadError, ModelUnreadable
from supervisor.guard.counters import SupervisorCounters
from supervisor.guard.eventlog import Emit
from supervisor.models.discovery import refusal
from supervisor.wiring.offloop import MODEL_FILES_TIMEOUT, OffLoopTimeout, off_loop

log = logging.getLogger("memvisor.catalog")

# An OSError that says nothing about the file (out of descriptors or memory): 503, retry.
PASSING_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM, errno.EINTR})


class ReadFailed(LoadError):
    """A model's files could not be read for a passing reason (an OSError such as
    EMFILE), as opposed to files that were read and refused."""


class Catalog:
    def __init__(self, config: Config, *, emit: Emit, counters: SupervisorCounters,
                 discovered_refused: dict[str, tuple[str, str]]) -> None:
        self.config = config
        self.emit = emit
        self.counters = counters
        # id -> (path, why): models in a models folder whose files discovery refused
        self.discovered_refused = discovered_refused
        self._reads: dict[str, asyncio.Task] = {}  # model path -> its files being read off the loop
        self._said: set[tuple[str, str]] = set()  # (path, why) already said as an event
        self._estimates: dict[str, int] = {}  # model path -> A2 weight estimate (0: refused)
        self._kv: dict[str, int] = {}  # model path -> KV bytes per token of context
        self._context: dict[str, int] = {}  # model id -> context tokens from config.json (-1: unknown)
        self._embedding: dict[str, EmbeddingSpec | None] = {}  # model id -> how it embeds (None: it chats)

    # -- which model ---------------------------------------------------------------------

    def model(self, name: str) -> ModelConfig:
        """The configured model by id or alias, or LoadError 404 (saying why, when discovery refused it)."""
        model = self.config.model(name)
        if model is None:
            refused = self.discovered_refused.get(name)
            if refused is not None:
                raise LoadError(f"the model {name!r} is not served: its files in {refused[0]} were refused "
                                f"when the models folder was scanned: {refused[1]}", code="model_not_found",
                                http_status=404)
            raise LoadError(f"the model {name!r} does not exist", code="model_not_found", http_status=404)
        return model

    def renew(self, config: Config, discovered_refused: dict[str, tuple[str, str]]) -> None:
        """A reload: the new models, each read afresh."""
        self.config = config
        self.discovered_refused = discovered_refused
        self._estimates.clear()
        self._kv.clear()
        self._context.clear()
        self._embedding.clear()
        self.say_refused()
        self.read_all()

    def say_refused(self) -> None:
        """A `refused` event (and a count) for each model discovery refused, once per file and reason."""
        for model_id, (path, why) in self.discovered_refused.items():
            if (path, why) not in self._said:
                self._said.add((path, why))
                self.counters.model_files_refused += 1
                log.warning("Models folder: %s (%s) is not served: %s", model_id, path, why)
                self.emit("refused", f"not a model, not served: {why}", model_id=model_id)

    # -- what was read (never a read on the loop) ----------------------------------------

    def known(self, model: ModelConfig) -> bool:
        """Its files have been read (or refused) since the last reload."""
        return model.id in self._context

    def estimate(self, model: ModelConfig) -> int:
        """A2's weight estimate as last read (0 until it has been, or when refused)."""
        return self._estimates.get(model.path, 0)

    def estimate_soon(self, model: ModelConfig) -> int:
        """`estimate`, starting a read when none was made (status never reads files itself)."""
        if model.path not in self._estimates and model.path not in self._reads:
            self.read_soon(model)
        return self.estimate(model)

    def kv_per_token(self, model: ModelConfig) -> int:
        return self._kv.get(model.path, 0)

    def context(self, model: ModelConfig) -> int:
        """Context tokens from its config.json (0: not read yet; -1: unknown)."""
        return self._context.get(model.id, 0)

    def embedding(self, model: ModelConfig) -> EmbeddingSpec | None:
        """How it embeds, None for a model that generates text (or not read yet)."""
        return self._embedding.get(model.id)

    # -- reading -------------------------------------------------------------------------

    def read_all(self) -> None:
        for model in self.config.models:
            self.read_soon(model)

    def read_soon(self, model: ModelConfig) -> None:
        async def quietly() -> None:
            try:
                await self.read(model)
            except LoadError:
                pass  # said as an event by the read

        asyncio.get_running_loop().create_task(quietly())

    async def read(self, model: ModelConfig) -> None:
        """The model's facts, read on a thread with a time bound, before anything on the
        loop needs them (shared.weights answers from what was read after that).
        Concurrent callers share one read; LoadError when refused."""
        task = self._reads.get(model.path)
        joined = task is not None
        if task is None:
            task = asyncio.get_running_loop().create_task(self._read(model))
            self._reads[model.path] = task
            task.add_done_callback(lambda _t: self._reads.pop(model.path, None))
        try:
            await asyncio.shield(task)
        except ReadFailed:
            if not joined:
                raise
            await self.read(model)  # a read begun earlier failed for a passing reason: read anew

    async def _read(self, model: ModelConfig) -> None:
        def read() -> tuple[int | None, int | str, int, EmbeddingSpec | None]:
            why = refusal(model.path)  # discovery's test: what it refuses in a folder is refused here too
            if why is not None:  # the files themselves are refused
                return None, why, 0, None
            context, kv = context_length(model.path), kv_bytes_per_token(model.path)
            embedding = read_embedding_spec(model.path)
            if embedding is not None:
                context = embedding.max_tokens
            try:
                return context, estimate_weight_bytes(model.path) + self._draft_bytes(model), kv, embedding
            except (WeightsError, FileRefused, ModelUnreadable) as exc:  # changed since refusal() looked
                return context, str(exc), kv, embedding

        try:
            context, size, kv, embedding = await off_loop(read, MODEL_FILES_TIMEOUT, f"reading {model.id}'s files")
        except OffLoopTimeout as exc:
            size, context, kv, embedding = f"{exc} (a slow disk, or not a plain file?)", None, 0, None
        except OSError as exc:  # out of descriptors, a vanished folder: not the files' fault
            raise ReadFailed(f"model {model.id!r}: cannot read {model.path}: {exc}", code="model_unreadable",
                             http_status=503, retry_after=1) from None
        self._context[model.id] = context or -1
        self._embedding[model.id] = embedding
        self._kv[model.path] = kv
        if isinstance(size, int):
            self._estimates[model.path] = size
            return
        self._estimates[model.path] = 0
        if (model.path, size) not in self._said:  # said once, counted once
            self._said.add((model.path, size))
            self.counters.model_files_refused += 1
            log.error("Model %s: cannot read %s: %s", model.id, model.path, size)
            self.emit("refused", f"cannot read {model.path}: {size}", model_id=model.id)
        raise ModelUnreadable(f"model {model.id!r} cannot be loaded from {model.path}: {size}")

    def _draft_bytes(self, model: ModelConfig) -> int:
        """A2: the draft model's weights load in the same worker, so the model's estimate holds them."""
        if not model.draft:
            return 0
        draft = self.draft_of(model)
        why = refusal(draft.path)
        if why is not None:
            raise ModelUnreadable(f"its draft {draft.id!r}: {why}")
        return estimate_weight_bytes(draft.path)

    async def loadable(self, model: ModelConfig) -> ModelConfig:
        """The model as its worker loads it: a `.gguf` path becomes the MLX folder
        imported from it (imported now, in a child process, on its first load), and
        `draft` (a model's id in the config) becomes the folder its worker loads the
        draft model from (worker/draft.py)."""
        if model.draft:
            draft = self.draft_of(model)
            folder = await self._folder(msgspec.structs.replace(draft, draft=""))
            model = msgspec.structs.replace(model, draft=folder)
        return msgspec.structs.replace(model, path=await self._folder(model))

    def draft_of(self, model: ModelConfig) -> ModelConfig:
        """The model `draft` names; ModelUnreadable when it names none."""
        draft = self.config.model(model.draft)
        if draft is None:
            raise ModelUnreadable(f"model {model.id!r}: its draft {model.draft!r} names no model")
        return draft

    async def _folder(self, model: ModelConfig) -> str:
        from supervisor.models.gguf_import_cache import GGUFImportError, cache_folder, ensure_imported, is_imported

        if not is_gguf_path(model.path):
            return model.path
        try:
            if not is_imported(cache_folder(model.path)):
                self.emit("import", f"importing {model.path} into the cache (first load)", model_id=model.id)
            folder = await ensure_imported(model.path)
        except (GGUFImportError, OSError) as exc:
            self.emit("refused", f"cannot import {model.path}: {exc}", model_id=model.id)
            words = f"model {model.id!r}: cannot import {model.path}: {exc}"
            if isinstance(exc, OSError) and exc.errno in PASSING_ERRNOS:
                raise LoadError(words, code="model_unreadable", http_status=503, retry_after=1) from None
            raise ModelUnreadable(words) from None
        return str(folder)
