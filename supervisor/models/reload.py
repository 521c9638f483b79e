"""A reload (SIGHUP, `reload`): re-read the config and the models folders, apply
what changed, keep what runs.

A config that does not validate is refused whole and the old one stays. New
models appear; removed ones are drained and stopped; pinned, ttl,
max_concurrency, max_queue and aliases of a running model change in place; a
changed path restarts only that model. Each change is an event with its
reason. The file and the folders are read on a thread (a rescan of 150,000
folders on the loop once blocked it past the heartbeat window): the loop runs
on meanwhile, and the reload is applied when the read completes, or refused,
the running config kept, past RELOAD_TIMEOUT.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import msgspec

from shared.modelinfo import FileRefused, open_regular
from shared.vocab import ErrorCode
from supervisor.config import Config, guard_settings
from supervisor.config_file import ConfigError
from supervisor.doors.refusals import ServeError
from supervisor.guard.counters import SupervisorCounters
from supervisor.guard.enforcer import Enforcer
from supervisor.guard.eventlog import Emit
from supervisor.models.catalog import Catalog
from supervisor.models.discovery import last_refused
from supervisor.models.life import Models
from supervisor.wiring.offloop import OffLoopTimeout, off_loop
from supervisor.workers.pool import Pool

log = logging.getLogger("memvisor.reload")

RELOAD_TIMEOUT = 60.0  # seconds for the config file and every models folder
CONFIG_FILE_MAX = 16 * 1024 * 1024  # a config file larger than this is refused, not read
# What a reload changes in a running supervisor; any other [supervisor] key needs a restart.
LIVE_SETTINGS = frozenset({"idle_timeout", "models_dirs", "admin_token", "queue_deadline", "restart_max",
                           "restart_period", "stop_grace", "heartbeat_timeout", "load_timeout", "max_body",
                           "host_name"})


class Reloader:
    def __init__(self, config: Config, *, build: Callable[[], Config] | None, config_file: Path | None,
                 catalog: Catalog, models: Models, pool: Pool, enforcer: Enforcer, emit: Emit,
                 counters: SupervisorCounters, configure: Callable[[Config], None],
                 wake: Callable[[], None]) -> None:
        self.config = config
        self.build = build  # re-reads the file and the models folders (None: there is nothing to re-read)
        self.config_file = config_file  # bounded in size before the parser reads it
        self.catalog = catalog
        self.models = models
        self.pool = pool
        self.enforcer = enforcer
        self.emit = emit
        self.counters = counters
        self.configure = configure  # hands the new config to every part
        self.wake = wake
        self.since: float | None = None  # a reload's thread is reading

    async def quietly(self, why: str) -> None:
        """A reload nobody waits for (SIGHUP): its outcome goes to the log."""
        try:
            log.info("%s: %s", why, await self.reload(why))
        except ServeError as exc:
            log.error("%s: %s", why, exc)
        except Exception:  # never a reload that vanishes without a word
            log.exception("%s: the reload failed", why)

    async def reload(self, why: str) -> str:
        """The reload; what changed, in words (ServeError when it is refused)."""
        if self.build is None:
            raise ServeError("this supervisor has no config file to re-read", code="reload_unsupported",
                             http_status=409)
        if self.since is not None:
            raise ServeError(f"a reload is still reading the config and the models folders (for "
                             f"{time.monotonic() - self.since:.0f} s); try again when it has finished",
                             code="reload_busy", http_status=409)
        new = await self._read(why)
        changes = self._apply_models(new) + self._apply_settings(new)
        self.configure(new)
        self.catalog.renew(new, last_refused())  # and what that build's scan of the folders refused
        summary = "; ".join(changes) if changes else "no change"
        self.emit("reload", f"{why}: {summary}")
        self.wake()
        return f"configuration reloaded: {summary}"

    async def _read(self, why: str) -> Config:
        build = self.build
        assert build is not None
        config_file = self.config_file

        def read() -> Config:
            if config_file is not None:  # bounded here; the parser reads what it is given
                try:
                    open_regular(config_file, CONFIG_FILE_MAX).close()
                except FileRefused as exc:
                    raise ConfigError(str(exc)) from None
                except OSError:
                    pass  # missing or unreadable: the loader says so in its own words
            return build()

        def ended_late() -> None:
            self.since = None

        self.since = time.monotonic()
        late = False
        try:
            return await off_loop(read, RELOAD_TIMEOUT, "re-reading the config", on_late=ended_late)
        except OffLoopTimeout as exc:
            late = True
            words = f"{exc}; the running config stays"
            code: ErrorCode = "reload_timeout"
            status = 504
        except ConfigError as exc:
            words = f"{exc}; the running config stays"
            code, status = "invalid_config", 400
        except Exception as exc:  # a bug or an unforeseen file: refused, said, never dropped
            log.exception("reload: reading the config failed")
            words = f"reading it failed: {exc!r}; the running config stays"
            code, status = "invalid_config", 400
        finally:
            if not late:
                self.since = None
        self.counters.reloads_refused += 1
        self.emit("reload_refused", f"{why}: {words}")
        raise ServeError(f"configuration refused: {words}", code=code, http_status=status)

    def _apply_models(self, new: Config) -> list[str]:
        old = {m.id: m for m in self.config.models}
        fresh = {m.id: m for m in new.models}
        changes: list[str] = []
        for model_id in fresh.keys() - old.keys():
            changes.append(f"added {model_id}")
            self.emit("model_added", f"new in the config: {fresh[model_id].path}", model_id=model_id)
            if fresh[model_id].pinned:
                self.models.load_soon(model_id, "pinned model added by a reload")
        for model_id in old.keys() - fresh.keys():
            changes.append(f"removed {model_id}")
            self.models.retire(model_id, "removed from the config")
        for model_id in old.keys() & fresh.keys():
            before, after = old[model_id], fresh[model_id]
            if before == after:
                continue
            if before.path != after.path:
                changes.append(f"restarted {model_id} (path changed)")
                loaded = self.pool.worker_for(model_id) is not None
                self.models.retire(model_id, f"its path changed to {after.path}", then_load=after.pinned or loaded)
                continue
            words = ", ".join(f"{key} {getattr(before, key)!r} -> {getattr(after, key)!r}"
                              for key in ("pinned", "ttl", "max_concurrency", "max_queue", "aliases")
                              if getattr(before, key) != getattr(after, key))
            changes.append(f"changed {model_id} ({words})")
            handle = self.pool.worker_for(model_id)
            if handle is not None:
                handle.reconfigure(after)
            elif after.pinned:
                self.models.load_soon(model_id, "pinned by a reload")
            self.emit("model_changed", words, model_id=model_id)
        return changes

    def _apply_settings(self, new: Config) -> list[str]:
        changes: list[str] = []
        keep = self.enforcer.settings.pressure_reclaim_disabled
        if guard_settings(new) != guard_settings(self.config):
            # the file's settings replace runtime changes made with /admin/guard (T6)
            self.enforcer.settings = guard_settings(new, pressure_reclaim_disabled=keep)
            changes.append("guard settings changed")
        old_s, new_s = msgspec.structs.asdict(self.config.supervisor), msgspec.structs.asdict(new.supervisor)
        stale = sorted(k for k in old_s if old_s[k] != new_s[k] and k not in LIVE_SETTINGS)
        if stale:
            log.warning("reload: %s take effect only after a restart", ", ".join(f"supervisor.{k}" for k in stale))
            changes.append("needs a restart for " + ", ".join(f"supervisor.{k}" for k in stale))
        return changes
