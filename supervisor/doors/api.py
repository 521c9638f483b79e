"""What the doors see of the supervisor: one narrow, typed interface.

The HTTP front door, the control socket and the metrics talk to the supervisor
only through `Supervisor` (a `typing.Protocol`): they set nothing on it and
probe nothing with getattr. Tests may hand them any object with these
methods. Refusals come back as `supervisor.doors.refusals.ServeError`s. What it
returns are frozen views (supervisor.doors.views), never a worker's handle;
`supervisor.doors.service.Service` implements it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

from shared import protocol as p

if TYPE_CHECKING:
    from shared.embedding import EmbeddingSpec
    from supervisor.config import Config, ModelConfig
    from supervisor.doors.views import ModelView, WorkerView
    from supervisor.guard.readiness import Health, Readiness
    from supervisor.policy.admission import FitReport
    from supervisor.policy.pressure import TickResult
    from supervisor.policy.snapshot import Snapshot
    from supervisor.policy.status import DiskCacheStatus, ModelInfo, ServerStatus
    from supervisor.wiring.fanout import Subscription
    from supervisor.workers.streams import RequestStream


# An idle timer that has run out: P10 unloads the model as soon as it is idle (keep_alive 0).
UNLOAD_WHEN_IDLE = 1e-3


class Supervisor(Protocol):
    @property
    def config(self) -> Config: ...

    def model_config(self, model_id: str) -> ModelConfig:
        """The configured model, or LoadError 404."""
        ...

    def model_view(self, model_id: str) -> ModelView: ...

    def model_info(self, model_id: str) -> ModelInfo:
        """What `ps` shows of one model (by id or alias)."""
        ...

    async def load(self, model_id: str, *, explicit: bool = ...) -> WorkerView: ...

    async def fit(self, model_id: str, context_tokens: int = ...) -> FitReport:
        """"Will it fit?" without spawning anything (LoadError 404 for an unknown model,
        422 for one whose files are refused); the files are read off the loop."""
        ...

    async def reload(self, why: str) -> str:
        """Re-read the config; what changed, in words (ServeError when it is refused)."""
        ...

    async def unload(self, model_id: str, reason: str = ..., *, admin: bool) -> bool:
        """Every door's unload (ServeError 403 when `admin` is False and the model is pinned;
        a non-admin's unload is the idle timer running out, P10). True when a worker was there."""
        ...

    async def generate(self, model_id: str, gen: p.Generate, max_wait: float | None = ...) -> RequestStream:
        """`max_wait`: the most seconds the request may wait for a load, the memory
        queue or a silent worker before it is refused (None: as long as they take)."""
        ...

    async def embedding_spec(self, model_id: str) -> EmbeddingSpec | None:
        """How the model embeds (its folder's files, read off the loop), None for a chat model."""
        ...

    async def embed(self, model_id: str, cmd: p.Embed, max_wait: float | None = ...) -> RequestStream:
        """Like `generate` (`max_wait` too); the stream gets one `Embedded` or one `Failed`."""
        ...

    async def tokens(self, model_id: str, cmd: p.Tokenize | p.Detokenize) -> p.TokensReply:
        """The model's tokenizer, asked through its worker (loaded on demand)."""
        ...

    def cancel(self, stream: RequestStream, reason: str = ...) -> None: ...

    def keep_alive(self, model_id: str, seconds: float) -> None:
        """A request's keep_alive/ttl becomes the loaded model's idle timer (P10;
        0 = never expires) until its worker stops."""
        ...

    def server_status(self, recent_events: int = ...) -> ServerStatus: ...

    def disk_cache(self) -> DiskCacheStatus:
        """The prompt cache's disk tier and shrink before drop (H5, H6 as proposed), per model and in all."""
        ...

    # -- routing signals: what a router in front reads -------------------------

    def readiness(self, name: str) -> Readiness:
        """What a request for the model would meet now (LoadError 404 for an unknown model)."""
        ...

    def health(self) -> Health:
        """The host as GET /health says it: 503 while a pinned model is on its way up."""
        ...

    def update_guard(self, update: p.GuardUpdate) -> None:
        """SPEC T6; ValueError names what is wrong with the update."""
        ...

    def start_drill(self, request: p.DrillRequest) -> str:
        """A fire drill on a loaded model; the words for the reply, or ServeError."""
        ...

    def add_event_hook(self, hook: Callable[[p.GuardEvent], None]) -> None: ...

    def subscribe(self, topics: frozenset[str], *, since: float | None = ...,
                  after_id: int | None = ...) -> Subscription:
        """A bounded queue of the PUB topics with its replay (supervisor.wiring.fanout; GET /v1/events)."""
        ...

    # -- what the metrics read at scrape time --------------------------------

    def last_tick(self) -> TickResult | None: ...

    def last_snapshot(self) -> Snapshot | None:
        """The inputs of that tick: per worker, the figures the policy decided with."""

    @property
    def admission_paused(self) -> bool: ...

    def workers(self) -> list[WorkerView]: ...

    def counters(self) -> dict[str, int]: ...

    def malformed_frames(self) -> dict[tuple[str, str], int]: ...
