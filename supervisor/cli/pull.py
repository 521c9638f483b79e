"""`pull ORG/NAME[:TAG][@REVISION]`: a model from the Hugging Face hub, served at once.

The download runs here, in this process (a progress bar, Ctrl-C to stop, the
next pull resumes), into the hub cache (`HF_HUB_CACHE`, `HF_HOME`) from
`HF_ENDPOINT` with your hub token; the model is recorded as pulled
(supervisor.models.pulled) and a running supervisor is asked to reload, which
serves it under the name pulled. Before any weight byte is fetched the model
is refused when it could never fit under this machine's ceiling (the running
supervisor's, else `--tier`'s on this machine): supervisor.models.hub_fit.
"""

from __future__ import annotations

import argparse
import sys
import threading

import msgspec

from shared import protocol as p
from shared.sizes import format_size
from supervisor.cli._control import call, connect
from supervisor.policy.status import ServerStatus
from supervisor.wiring.client import NotRunning


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="ORG/NAME on the Hugging Face hub; :TAG picks a GGUF file by its "
                        "quantisation (ORG/NAME:Q4_K_M), @REVISION a branch, tag or commit")
    parser.add_argument("--file", default="", metavar="PATH", help="the GGUF file to take, by its path in the repo")
    parser.add_argument("--tier", default="balanced", choices=("safe", "balanced", "aggressive"),
                        help="with no supervisor running: judge the fit under this tier (default balanced)")
    parser.add_argument("--force", action="store_true", help="pull even when it could never fit here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from supervisor.models.hub_fit import Room, note_now, refusal, room_from_machine, room_from_status
    from supervisor.models.hub_repo import HubError, RefError, describe, parse_ref, plan_for, quiet_transport_logs
    from supervisor.models.pulled import RecordError

    quiet_transport_logs()
    try:
        ref = parse_ref(args.model, args.file)
    except RefError as exc:
        return _fail(str(exc), 2)
    try:
        plan = plan_for(ref)
    except (RefError, HubError) as exc:
        return _fail(str(exc))
    print(describe(plan))
    status = _running(args)
    try:
        room = room_from_status(status.guard) if status is not None else room_from_machine(args.tier)
    except (ImportError, OSError) as exc:  # no probe for this machine: the fit is not judged here
        print(f"memvisor: cannot read this machine's memory ({exc}); the fit is judged at load", file=sys.stderr)
        room = Room(ever=0, now=0, pool="host", tier=args.tier, source="", remedy="")
    why = refusal(plan, room)
    if why is not None and not args.force:
        return _fail(f"refused before downloading: {why} (--force pulls it anyway)")
    try:
        entry = _download(plan, args.quiet)
    except KeyboardInterrupt:
        print("memvisor: pull interrupted; the same pull resumes where it stopped", file=sys.stderr)
        return 130
    except HubError as exc:
        return _fail(str(exc))
    except (OSError, RecordError) as exc:  # the cache or the record: a full disk, a folder not ours
        return _fail(f"pull failed: {exc}")
    print(f"pulled {entry.id} ({format_size(plan.download_bytes)}) into {entry.snapshot}")
    if note := note_now(entry.id, plan.weight_bytes, room):
        print(note)
    if status is not None:
        code, _reply = call(args, p.ReloadRequest(), timeout=120)
        if code != 0:  # the pull stands; the reason is printed above
            print(f"memvisor: pulled, but the running supervisor did not reload; `memvisor reload` serves "
                  f"{entry.id} once that is mended", file=sys.stderr)
    else:
        print("no supervisor runs here: `memvisor serve` will serve it")
    print(f"chat with it: memvisor chat {entry.id}")
    return 0


def _fail(message: str, code: int = 1) -> int:
    print(f"memvisor: {message}", file=sys.stderr)
    return code


def _running(args: argparse.Namespace) -> ServerStatus | None:
    """The running supervisor's status, or None when none runs in the runtime dir."""
    try:
        with connect(args.runtime_dir, timeout=5.0) as client:
            reply = client.call(p.StatusRequest())
    except NotRunning:
        return None
    if not isinstance(reply, p.ControlOk):
        return None
    return msgspec.json.decode(reply.data, type=ServerStatus)


def _download(plan, quiet: bool):
    """The files with a progress bar a line each (rich), verified and recorded."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from supervisor.models.hub_fetch import Step, pull

    console = Console(stderr=True)
    columns = (TextColumn("{task.description:<32}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=console, disable=quiet or not console.is_terminal) as bar:
        tasks: dict[str, object] = {}

        def on_step(step: Step) -> None:
            if step.phase == "linking":
                return
            task = tasks.get(step.file)
            if task is None:
                task = tasks[step.file] = bar.add_task(step.file, total=step.size)
            label = step.file if step.phase == "pulling" else f"verifying {step.file}"
            bar.update(task, completed=step.done, total=step.size, description=label[-32:])  # type: ignore[arg-type]

        return pull(plan, on_step, threading.Event())
