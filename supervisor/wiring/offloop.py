"""Work the supervisor's loop must not wait on: run on a thread, picked up later.

Why: the one loop reads heartbeats, reaps exits and answers
signals; a models-folder rescan of 150,000 folders or a named pipe called
`model.safetensors` inside it stalled all of that (the pipe for good, SIGTERM
ignored). Disk reads of model files and config files run here instead: each
on its own daemon thread (a thread stuck in the kernel cannot be cancelled,
and a daemon one does not keep the process from exiting, which asyncio's
default executor would: it is joined at shutdown), with a time bound after
which the loop stops waiting and says so.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable, TypeVar

T = TypeVar("T")

# How long the loop lets one read of a model's small files (headers, config.json, the cards' facts) take.
MODEL_FILES_TIMEOUT = 10.0


class OffLoopTimeout(TimeoutError):
    """The work did not finish within its bound (its thread may still be running)."""


async def off_loop(fn: Callable[[], T], timeout: float, what: str,
                   on_late: Callable[[], None] | None = None) -> T:
    """`fn()` on a daemon thread; its result (or exception) once it finishes, or
    OffLoopTimeout after `timeout` seconds. The loop runs on meanwhile; when the
    work ends after its bound, `on_late` runs on the loop (and its outcome is dropped)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()
    late: list[bool] = []

    def settle(result: T | None, error: BaseException | None) -> None:
        if not done.done():
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)  # type: ignore[arg-type]
        if on_late is not None and late:
            on_late()

    def work() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = fn()
        except BaseException as exc:  # handed to the loop, raised there
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed while we worked: nobody is waiting
            pass

    threading.Thread(target=work, name=f"memvisor-offloop-{what}", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(done), timeout)
    except asyncio.TimeoutError:
        late.append(True)
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody will retrieve it
        raise OffLoopTimeout(f"{what} took longer than {timeout:g} s") from None
