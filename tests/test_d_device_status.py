"""SPEC D6: the device pool beside the host pool on every surface.

`status` (GuardStatus.device, WorkerStatus.device_bytes), the PUB ceiling and
pressure topics (CeilingMsg.device, PressureMsg.device), `tiers`, `probe`,
`watch` and `/metrics` show a discrete device's pool when there is one, and
nothing more than absent/None fields without one. T6: `custom_device_ceiling`
changes at runtime. No GPU here: readings are faked (NVML) or put straight
into the snapshot.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import msgspec
import pytest

from shared import probe
from shared import protocol as p
from shared.host import HostCounters
from shared.memory import MemoryReading
from shared.probe import nvml
from shared.probe.nvml import DeviceReading
from shared.sizes import MAX_SIZE, GiB, MiB, format_size
from supervisor.cli import main
from supervisor.config import Config
from supervisor.guard.enforcer import Enforcer
from supervisor.policy.device import compute_device_ceilings, device_remedy
from supervisor.policy.pressure import tick
from supervisor.policy.snapshot import GuardSettings, Snapshot, WorkerRecord
from supervisor.policy.status import GuardStatus, ModelInfo, ServerStatus, build_status, device_pool
from tests.nvml_harness import fake_pynvml, proc

DEVICE = 24 * GiB
RESERVE = int(0.05 * DEVICE)  # D2 balanced: clamp(5 % of 24 GiB, 512 MiB, 4 GiB)


def _worker(device_bytes: int, **kw) -> WorkerRecord:
    kw.setdefault("memory", MemoryReading(usage=GiB, footprint=GiB, mlx_active=GiB))
    return WorkerRecord(worker="w1", model="small", pid=42, state="busy", last_access=990.0,
                        device_bytes=device_bytes, **kw)


def _snap(*, device_total: int = DEVICE, free: int | None = 20 * GiB, group: int = 4 * GiB,
          guard: GuardSettings | None = None) -> Snapshot:
    return Snapshot(now=1000.0, guard=guard or GuardSettings(tier="balanced"),
                    host=HostCounters(total=64 * GiB, free=50 * GiB), supervisor_footprint=GiB,
                    device_total=device_total, device_free=free, workers=[_worker(group)])


def _pool(**kw) -> p.DevicePool | None:
    return device_pool(tick(_snap(**kw)), "NVIDIA H200")


# ---------------------------------------------------------------------------
# device_pool and the status


def test_d6_no_device_no_device_pool_and_status_as_before():
    s = _snap(device_total=0, free=None, group=0)
    result = tick(s)
    assert device_pool(result) is None
    status = build_status(s, result)
    assert status.device is None and status.workers[0].device_bytes == 0
    data = msgspec.to_builtins(status)
    assert data["device"] is None and "device_total" not in data


@pytest.mark.parametrize(("case", "kw", "want"), [
    ("others_free_the_static_binds", dict(free=20 * GiB, group=4 * GiB),
     dict(binding="device_static", ceiling=DEVICE - RESERVE, others=0, free=20 * GiB, level="ok")),
    ("other_processes_bind", dict(free=14 * GiB, group=4 * GiB),
     dict(binding="device_others", ceiling=18 * GiB - RESERVE, others=6 * GiB, level="ok")),
    ("no_free_reading", dict(free=None, group=4 * GiB),
     dict(binding="device_static", ceiling=DEVICE - RESERVE, others=0, free=None, level="ok")),
    ("soft", dict(free=3 * GiB, group=21 * GiB),
     dict(binding="device_static", ceiling=DEVICE - RESERVE, level="soft")),
    ("hard", dict(free=2 * GiB, group=22 * GiB),
     dict(binding="device_static", ceiling=DEVICE - RESERVE, level="hard")),
    ("guard_off", dict(guard=GuardSettings(enabled=False)),
     dict(binding="", ceiling=0, soft_bytes=0, hard_bytes=0, level="ok", utilization=0.0, remedy="")),
    ("custom_device_ceiling", dict(free=DEVICE - 9 * GiB - 900 * MiB, group=9 * GiB + 900 * MiB,
                                   guard=GuardSettings(tier="custom", custom_device_ceiling=10 * GiB)),
     dict(binding="device_static", ceiling=10 * GiB, reserve=DEVICE - 10 * GiB, level="hard")),
    ("reserve_takes_the_whole_device", dict(device_total=512 * MiB, free=512 * MiB, group=0,
                                            guard=GuardSettings(tier="safe")),
     dict(reserve=GiB, reserve_exceeds_total=True, static=1, ceiling=1, binding="device_static")),
])
def test_d6_device_pool_carries_the_ticks_device_figures(case, kw, want):
    d = _pool(**kw)
    assert d is not None, case
    for field, value in want.items():
        assert getattr(d, field) == value, (case, field)
    assert d.name == "NVIDIA H200"
    if d.ceiling > 0:
        assert d.utilization == d.usage / d.ceiling
        assert d.remedy == device_remedy(d.binding, kw.get("guard", GuardSettings()).tier) != ""


def test_d6_device_pool_matches_compute_device_ceilings_and_the_tick():
    s = _snap(free=3 * GiB, group=20 * GiB)
    result = tick(s)
    d = device_pool(result)
    c = compute_device_ceilings(tier="balanced", total=DEVICE, free=3 * GiB, group_bytes=20 * GiB)
    assert c is not None and d is not None
    assert (d.total, d.free, d.usage, d.reserve, d.static, d.dynamic, d.ceiling, d.soft_bytes, d.hard_bytes) == (
        c.total, c.free, 20 * GiB, c.reserve, c.static, c.dynamic, c.ceiling, c.soft, c.hard)
    assert (d.soft_threshold, d.hard_threshold) == (c.soft_threshold, c.hard_threshold)
    assert (d.level, d.emergency) == (result.device_level, result.device_emergency)
    assert d.name == ""  # the tick does not know the device's name


def test_d6_emergency_on_the_device_reaches_the_pool():
    """P2 on the device: 2 GiB over its ceiling is an emergency at once."""
    s = _snap(device_total=DEVICE, free=0, group=DEVICE, guard=GuardSettings(tier="custom",
                                                                          custom_device_ceiling=20 * GiB))
    d = device_pool(tick(s))
    assert d is not None and d.level == "hard" and d.emergency


def test_d6_status_shows_the_device_pool_beside_the_host_and_each_workers_device_bytes():
    guard = GuardSettings(tier="custom", custom_ceiling=10 * GiB, custom_device_ceiling=20 * GiB)
    s = _snap(free=5 * GiB, group=19 * GiB, guard=guard)
    result = tick(s)
    status = build_status(s, result, "NVIDIA H200")
    assert status.device == device_pool(result, "NVIDIA H200")
    assert status.device is not None and status.device.level == "soft" and status.device.ceiling == 20 * GiB
    assert status.custom_device_ceiling == 20 * GiB
    # the host figures are the host pool's; the level is the group's, the worse of the two (D4)
    assert status.ceiling == result.ceilings.ceiling and status.usage == result.usage
    assert result.host_level == "ok" and status.pressure_level == "soft"
    assert status.workers[0].device_bytes == 19 * GiB
    assert msgspec.json.decode(msgspec.json.encode(status), type=GuardStatus) == status


# ---------------------------------------------------------------------------
# the wire: PUB ceiling and pressure topics


def test_d6_ceiling_and_pressure_messages_carry_the_device_and_decode_without_it():
    codec = p.Codec(p.Published)
    d = _pool(free=3 * GiB, group=20 * GiB)
    assert d is not None
    ceiling = p.CeilingMsg(t=1.0, enabled=True, tier="balanced", ceiling=1, static=1, dynamic=1, gpu_cap=0,
                           binding="static", soft_bytes=0, hard_bytes=0, reserve=0, device=d)
    pressure = p.PressureMsg(t=1.0, level="soft", usage=1, soft_bytes=0, hard_bytes=0, ceiling=1,
                             utilization=1.0, admission_paused=False, interval=1.0, device=d)
    assert codec.decode(codec.encode(ceiling)) == ceiling
    assert codec.decode(codec.encode(pressure)) == pressure
    # a peer that sends no device field (a CPU machine, an older supervisor): None
    old = msgspec.msgpack.encode({"type": "pressure", "v": p.PROTOCOL_VERSION, "t": 1.0, "level": "ok", "usage": 1,
                                  "soft_bytes": 0, "hard_bytes": 0, "ceiling": 1, "utilization": 0.0,
                                  "admission_paused": False, "interval": 1.0})
    assert codec.decode(old).device is None


class _Bus:
    def __init__(self) -> None:
        self.sent: list[p.Msg] = []

    def publish(self, msg: p.Msg) -> None:
        self.sent.append(msg)


def _enforcer(device_name: str = "NVIDIA H200") -> tuple[Enforcer, _Bus]:
    bus = _Bus()
    handles = {"w1": SimpleNamespace(device_info={"device_name": device_name} if device_name else {})}
    enf = Enforcer(config=Config(), pool=SimpleNamespace(handles=handles), bus=bus, ledger=None,
                   emit=lambda *a, **k: None, restarts=lambda _model: 0)
    return enf, bus


def test_d6_enforcer_publishes_the_device_pool_on_the_ceiling_and_pressure_topics():
    enf, bus = _enforcer()
    enf.ticks = 1
    result = tick(_snap(free=3 * GiB, group=20 * GiB))
    enf.publish(result)
    ceiling, pressure = bus.sent
    assert isinstance(ceiling, p.CeilingMsg) and isinstance(pressure, p.PressureMsg)
    assert ceiling.device == pressure.device == device_pool(result, "NVIDIA H200")
    assert pressure.level == result.level
    # same ceilings next tick: only the pressure; a new device ceiling: the ceiling again
    enf.ticks = 2
    enf.publish(result)
    assert [type(m) for m in bus.sent[2:]] == [p.PressureMsg]
    enf.publish(tick(_snap(free=GiB, group=4 * GiB)))  # other processes took the device
    assert [type(m) for m in bus.sent[3:]] == [p.CeilingMsg, p.PressureMsg]
    assert bus.sent[3].device.binding == "device_others"


def test_d6_enforcer_publishes_no_device_without_one():
    enf, bus = _enforcer(device_name="")
    enf.ticks = 1
    enf.publish(tick(_snap(device_total=0, free=None, group=0)))
    assert [m.device for m in bus.sent] == [None, None]


# ---------------------------------------------------------------------------
# T6: custom_device_ceiling at runtime


def test_d6_t6_guard_update_sets_the_custom_device_ceiling_and_ticks():
    enf, _bus = _enforcer()
    ticks: list[float] = []
    enf.tick = ticks.append  # type: ignore[method-assign]
    enf.update_guard(p.GuardUpdate(tier="custom", custom_device_ceiling=10 * GiB))
    assert enf.settings.custom_device_ceiling == 10 * GiB and enf.settings.tier == "custom"
    assert len(ticks) == 1  # the new limits reach every worker now
    s = msgspec.structs.replace(_snap(), guard=enf.settings)
    d = device_pool(tick(s))
    assert d is not None and d.static == d.ceiling == 10 * GiB  # D2: custom_device_ceiling is device static
    enf.update_guard(p.GuardUpdate(custom_device_ceiling=0))  # unset again
    assert enf.settings.custom_device_ceiling == 0


@pytest.mark.parametrize(("value", "words"), [
    (-1, "custom device ceiling must be 0.."),
    (MAX_SIZE + 1, "custom device ceiling must be 0.."),
    (20, "at least 1MiB"),  # a unit slip (20 meant GiB), as the config refuses it
])
def test_d6_t6_guard_update_refuses_a_bad_custom_device_ceiling(value, words):
    enf, _bus = _enforcer()
    enf.tick = lambda now: pytest.fail("ticked on a refused update")  # type: ignore[method-assign]
    before = enf.settings
    with pytest.raises(ValueError, match=words):
        enf.update_guard(p.GuardUpdate(tier="custom", custom_device_ceiling=value))
    assert enf.settings == before  # nothing of a refused update is applied


# ---------------------------------------------------------------------------
# `status`


def _server_status(guard: GuardStatus) -> ServerStatus:
    return ServerStatus(pid=1, uptime=5.0, runtime_dir="/run/x", pub="ipc:///run/x/pub", http="", guard=guard,
                        models=[ModelInfo(id="small", path="/m", pinned=True, state="busy", worker="w1", pid=42)],
                        events=[], malformed_frames=0, counters={})


def test_d6_status_renders_a_device_block_and_a_device_column():
    from supervisor.cli.status import render

    s = _snap(free=3 * GiB, group=21 * GiB)
    text = render(_server_status(build_status(s, tick(s), "NVIDIA H200")))
    d = device_pool(tick(s))
    assert d is not None
    assert f"device NVIDIA H200: {format_size(DEVICE)}, free {format_size(3 * GiB)}" in text
    assert f"device ceiling {format_size(d.ceiling)} bound by device_static — to raise it: {d.remedy}" in text
    assert f"static {format_size(d.static)}  dynamic {format_size(d.dynamic)}  reserve {format_size(RESERVE)}" in text
    assert f"usage {format_size(d.usage)} = {d.utilization:.0%} of the device ceiling" in text
    assert "device pressure SOFT" in text
    header = next(line for line in text.splitlines() if line.startswith("model"))
    row = next(line for line in text.splitlines() if line.startswith("*small"))
    assert header.split()[:5] == ["model", "state", "pid", "usage", "device"]
    assert row.split()[5:7] == format_size(21 * GiB).split()


def test_d6_status_without_a_device_shows_the_host_alone():
    from supervisor.cli.status import render

    s = _snap(device_total=0, free=None, group=0)
    text = render(_server_status(build_status(s, tick(s))))
    assert "device" not in text


def test_d6_status_guard_off_says_there_is_no_device_limit():
    from supervisor.cli.status import render

    s = _snap(guard=GuardSettings(enabled=False))
    text = render(_server_status(build_status(s, tick(s))))
    assert "guard OFF: no device limit" in text and "device ceiling" not in text


# ---------------------------------------------------------------------------
# `tiers`


def test_d6_tiers_json_what_if_device_has_a_device_table(capsys):
    assert main(["tiers", "--json", "--total", "64GiB", "--free", "40GiB", "--device-total", "24GiB",
                 "--device-free", "14GiB", "--device-own", "4GiB"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"tiers", "device"}
    dev = out["device"]
    assert (dev["total"], dev["free"], dev["group_bytes"]) == (24 * GiB, 14 * GiB, 4 * GiB)
    assert list(dev["tiers"]) == ["safe", "balanced", "aggressive", "custom"]
    bal = dev["tiers"]["balanced"]
    assert bal["reserve_bytes"] == RESERVE and bal["others_bytes"] == 6 * GiB
    assert bal["ceiling_bytes"] == 18 * GiB - RESERVE and bal["binding"] == "device_others"


def test_d6_tiers_custom_device_ceiling_what_if(capsys):
    assert main(["tiers", "--json", "--device-total", "24GiB", "--custom-device-ceiling", "10GiB"]) == 0
    custom = json.loads(capsys.readouterr().out)["device"]["tiers"]["custom"]
    assert custom["static_bytes"] == custom["ceiling_bytes"] == 10 * GiB  # no free reading: dynamic = static


def test_d6_tiers_without_a_device_has_no_device_key_or_table(capsys):
    assert main(["tiers", "--json", "--total", "16GiB"]) == 0
    assert set(json.loads(capsys.readouterr().out)) == {"tiers"}
    assert main(["tiers", "--total", "16GiB"]) == 0
    assert "device" not in capsys.readouterr().out


def test_d6_tiers_table_shows_the_device_table_after_the_host_table(capsys):
    assert main(["tiers", "--total", "64GiB", "--free", "40GiB", "--device-total", "24GiB",
                 "--device-free", "14GiB", "--device-own", "4GiB"]) == 0
    text = capsys.readouterr().out
    host, device = text.split("device pool (separate from host memory):")
    assert "\nbalanced " in host and "\nbalanced " in device
    assert "device_others" in device and "other processes" in device
    assert "device 24.00 GiB, free 14.00 GiB, group's device bytes 4.00 GiB" in device


def _reading(**kw) -> DeviceReading:
    kw.setdefault("per_process", {4101: 3 * GiB})
    return DeviceReading(index=0, name="NVIDIA H200", total=140 * GiB, free=100 * GiB, used=40 * GiB,
                         uuid="GPU-0000", **kw)


def test_d6_tiers_reads_the_nvml_device_of_this_machine(monkeypatch, capsys):
    monkeypatch.setattr(nvml, "read_device", lambda *a, **k: _reading())
    assert main(["tiers", "--json"]) == 0
    dev = json.loads(capsys.readouterr().out)["device"]
    assert (dev["name"], dev["total"], dev["free"]) == ("NVIDIA H200", 140 * GiB, 100 * GiB)
    assert dev["tiers"]["balanced"]["reserve_bytes"] == 4 * GiB  # 5 % of 140 GiB, capped at 4 GiB
    assert main(["tiers"]) == 0
    assert "device pool NVIDIA H200 (separate from host memory):" in capsys.readouterr().out


def test_d6_tiers_on_a_machine_without_a_device_is_quiet(monkeypatch, capsys):
    monkeypatch.setattr(nvml, "read_device", lambda *a, **k: None)
    assert main(["tiers", "--json"]) == 0
    captured = capsys.readouterr()
    assert set(json.loads(captured.out)) == {"tiers"}


# ---------------------------------------------------------------------------
# `probe`


def test_d6_probe_shows_device_rows_and_each_processes_bytes(monkeypatch, capsys):
    monkeypatch.setattr(nvml, "read_device", lambda *a, **k: _reading(unknown_pids=[4200]))
    assert main(["probe"]) == 0
    rows = {line.split("  ")[1].strip(): line for line in capsys.readouterr().out.splitlines()
            if line.startswith("  device")}
    assert "0: NVIDIA H200" in rows["device"] and "NVML, GPU-0000" in rows["device"]
    assert f"{format_size(140 * GiB)} ({140 * GiB})" in rows["device total"]
    assert f"({100 * GiB})" in rows["device free"] and f"({40 * GiB})" in rows["device used"]
    assert f"{format_size(3 * GiB)} ({3 * GiB})" in rows["device pid 4101"]
    assert "unknown" in rows["device pid 4200"]


def test_d6_probe_json_has_the_device_reading(monkeypatch, capsys):
    monkeypatch.setattr(nvml, "read_device", lambda *a, **k: _reading())
    assert main(["probe", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"]["total"] == 140 * GiB and out["device"]["per_process"] == {"4101": 3 * GiB}
    assert out["device_unavailable"] == ""


@pytest.fixture
def fresh_nvml():
    nvml._reset()
    probe._warned.clear()
    yield
    nvml._reset()
    probe._warned.clear()


def test_d6_probe_without_pynvml_says_why_there_is_no_device(monkeypatch, capsys, fresh_nvml):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert main(["probe"]) == 0
    captured = capsys.readouterr()
    line = next(line for line in captured.out.splitlines() if line.startswith("  device"))
    assert "no NVIDIA device" in line and "pynvml not importable" in line
    assert "NVML unavailable" not in captured.err  # said once, in the table, not warned as well
    assert main(["probe", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] is None and "pynvml not importable" in out["device_unavailable"]


def test_d6_nvml_unavailable_reason_follows_the_last_reading(monkeypatch, fresh_nvml):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(count=0))
    assert nvml.read_device() is None and "sees no NVIDIA device" in nvml.unavailable_reason()
    nvml._reset()
    assert nvml.unavailable_reason() == ""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(compute=[proc(4101, GiB)]))
    assert nvml.read_device() is not None and nvml.unavailable_reason() == ""


# ---------------------------------------------------------------------------
# `watch`


def _watch_text(*msgs) -> str:
    from rich.console import Console

    from supervisor.cli.watch import _View

    view = _View()
    for msg in msgs:
        view.take(msg)
    console = Console(record=True, width=220, color_system=None)
    console.print(view.render())
    return console.export_text()


def _pressure(device: p.DevicePool | None) -> p.PressureMsg:
    return p.PressureMsg(t=1.0, level="soft", usage=2 * GiB, soft_bytes=9 * GiB, hard_bytes=9.5 * GiB,
                         ceiling=10 * GiB, utilization=0.2, admission_paused=False, interval=1.0, device=device)


def test_d6_watch_shows_a_device_line_under_the_pressure_line():
    d = _pool(free=3 * GiB, group=21 * GiB)
    assert d is not None
    lines = _watch_text(_pressure(d)).splitlines()
    at = next(i for i, line in enumerate(lines) if "pressure SOFT" in line)
    device = lines[at + 1]
    assert "device NVIDIA H200 SOFT" in device
    assert f"{format_size(d.usage)} / {format_size(d.ceiling)} ({d.utilization:.0%})" in device
    assert "binding: device_static" in device


def test_d6_watch_without_a_device_has_no_device_line():
    assert "device" not in _watch_text(_pressure(None))


# ---------------------------------------------------------------------------
# `/metrics`


def _metrics_text(snapshot: Snapshot) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    from supervisor.http.metrics import GuardCollector
    from supervisor.policy.status import DiskCacheStatus

    result = tick(snapshot)
    sup = SimpleNamespace(
        last_tick=lambda: result, admission_paused=False, workers=lambda: [], counters=lambda: {},
        malformed_frames=lambda: {}, config=Config(), last_snapshot=lambda: snapshot,
        disk_cache=lambda: DiskCacheStatus(max=0))
    registry = CollectorRegistry()
    registry.register(GuardCollector(sup))  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def _value(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.rsplit(" ", 1)[1])


def test_d6_metrics_have_the_device_pool_and_each_workers_device_bytes():
    s = _snap(free=3 * GiB, group=21 * GiB)
    d = device_pool(tick(s))
    assert d is not None
    text = _metrics_text(s)
    assert _value(text, "memvisor_device_total_bytes") == DEVICE
    assert _value(text, "memvisor_device_ceiling_bytes") == d.ceiling
    assert _value(text, "memvisor_device_usage_bytes") == 21 * GiB
    assert _value(text, "memvisor_device_soft_bytes") == d.soft_bytes
    assert _value(text, "memvisor_device_hard_bytes") == d.hard_bytes
    assert _value(text, "memvisor_device_level") == 1  # soft
    assert _value(text, "memvisor_device_emergency") == 0
    assert _value(text, 'memvisor_worker_device_bytes{model="small",worker="w1"}') == 21 * GiB
    assert _value(text, "memvisor_pressure_level") == 1  # the group's: the worse of the two pools


def test_d6_metrics_without_a_device_have_no_device_series():
    text = _metrics_text(_snap(device_total=0, free=None, group=0))
    assert "memvisor_ceiling_bytes" in text
    assert "device" not in text
