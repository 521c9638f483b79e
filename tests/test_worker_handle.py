"""A worker's handle changes in one place: its own methods (supervisor/workers/process.py).

As h11's `ConnectionState` is the only writer of a connection's state, a
`WorkerHandle`'s fields (its state, why it is leaving, its beats, limits, load)
are set only by `WorkerHandle` itself; the pool, the message router, the
spares, the enforcer and the models call its methods. A stop's cause and
reason, and P6.3's mark, are one `Leaving` value, set once and never undone.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

import supervisor
from shared.state_table import IllegalMove
from supervisor.config import ModelConfig
from supervisor.doors.refusals import LoadError
from supervisor.workers.process import Leaving, WorkerHandle

ROOT = Path(supervisor.__file__).resolve().parent.parent  # the checkout whose supervisor is imported
PROCESS = ROOT / "supervisor" / "workers" / "process.py"
# names that hold something other than a handle, with a field of the same name
NOT_HANDLES = {"life"}  # supervisor.models.life.ModelLife (its `load` is the load task in flight)


def _handle_fields() -> set[str]:
    """Every attribute WorkerHandle sets on itself (its fields), read from its source."""
    tree = ast.parse(PROCESS.read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "WorkerHandle"]
    fields = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                and isinstance(node.ctx, ast.Store):
            fields.add(node.attr.lstrip("_"))
    return fields


def _writes_outside(fields: set[str]) -> list[str]:
    """`x.field = ...` (or `x.field.y = ...`, `x.field += ...`) on something other than `self`,
    anywhere in supervisor/ but process.py."""
    found = []
    for path in sorted((ROOT / "supervisor").rglob("*.py")):
        if path == PROCESS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                chain, root = [], target
                while isinstance(root, ast.Attribute):
                    chain.append(root.attr)
                    root = root.value
                if isinstance(root, ast.Name) and root.id in NOT_HANDLES:
                    continue
                if chain and not (isinstance(root, ast.Name) and root.id == "self") and set(chain) & fields:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(target)}")
    return found


def test_only_the_handle_writes_its_fields():
    fields = _handle_fields()
    assert _writes_outside(fields) == []
    assert {"state", "beats", "last_access", "last_limits", "sample", "leaving"} <= fields  # the check sees them


def _model() -> ModelConfig:
    return ModelConfig(id="m", path="/nonexistent/m")


def test_p6_3_a_mark_then_a_stop_is_one_leaving_that_keeps_the_mark_and_the_first_cause():
    async def scenario() -> None:
        handle = WorkerHandle("m#1", _model(), 0, 1)
        assert handle.leaving is None and not handle.marked_for_unload and not handle.view(0).leaving
        handle.mark()
        assert handle.leaving == Leaving("marked", marked=True) and handle.marked_for_unload
        assert handle.state == "starting" and handle.view(0).leaving and handle.view(0).stop_reason == ""

        async def escalate() -> None:
            await asyncio.sleep(0)

        first = handle.stop("evict", "evicted: pressure", escalate)
        again = handle.stop("ttl", "TTL: idle", escalate)  # a stop is asked once; the first cause stays
        assert again is first and handle.state == "draining"
        assert handle.leaving == Leaving("evict", "evicted: pressure", marked=True)
        assert handle.left_because("evict") and not handle.left_because("marked", "ttl")
        assert handle.view(0).stop_reason == "evicted: pressure"
        await first

    asyncio.run(scenario())


def test_an_exit_says_how_it_ended_and_a_late_move_is_refused():
    async def scenario() -> None:
        handle = WorkerHandle("m#1", _model(), 0, 1)
        handle.ended(-9)  # SIGKILL nobody sent
        assert handle.state == "dead" and "Perhaps out of memory?" in handle.exit_cause
        assert handle.exited.result() == -9
        with pytest.raises(IllegalMove):
            handle.move("hello")
        with pytest.raises(LoadError):
            handle.loaded.result()

    asyncio.run(scenario())

