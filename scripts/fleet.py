"""Several memvisor hosts behind a real LiteLLM proxy, on this machine.

Starts N supervisors as "hosts" (each its own runtime dir and port, loopback
only, its own host name), a LiteLLM proxy in front with every host as a
deployment of one model group, then drives plain client traffic (no client
retries) through the proxy while one host is pushed into refusals, one
fault window after another:

  drill     a fire drill to hard under a custom ceiling sized from its usage
            (`supervisor drill`, the host runs with --allow-drills)
  ceiling   a tiny custom ceiling through POST /admin/guard (the model is
            evicted, its reload refused with 507)
  sigstop   its worker SIGSTOPped (requests in flight wait for the wedge
            kill, new ones are refused as `worker_unresponsive`)

Each host is a LiteLLM deployment whose requests carry `X-Memvisor-Max-Wait:
0` (the router's extra_headers), so a host that cannot serve at once answers
429/503/507 with a code and Retry-After instead of holding the request;
LiteLLM retries on another deployment and cools the refusing one down for
Retry-After seconds. It prints the client-visible failures (the goal is 0),
the requests each host served (from each host's /metrics) and p50/p99
latency of requests begun in steady windows vs in fault windows.

LiteLLM runs from its own virtual environment (a pinned release, installed
on first use under the cache; `--litellm PATH` names an installed
`litellm` instead): it is the router, a separate program, and its
dependency pins (openai < 3) differ from this project's test extra.

    python scripts/fleet.py                      # 3 hosts, every fault, ~2-3 minutes
    python scripts/fleet.py --quick --hosts 2    # the CI version (tests/live/test_fleet_litellm_live.py)
    python scripts/fleet.py --json               # one JSON object as the last line
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import _venv  # noqa: E402  (scripts/ is on sys.path as the script's folder)

from shared.sizes import MiB, format_size  # noqa: E402
from tests.process_harness import sigterm_then_kill  # noqa: E402

# A known-good LiteLLM release (1.107.0 was a compromised one; so were 1.82.7 and 1.82.8).
# pyproject.toml's `fleet` extra pins the same (tests/live/test_fleet_litellm_live.py checks they agree).
LITELLM_PIN = "1.106.12"
MODEL = "tiny"
FAULTS = ("drill", "ceiling", "sigstop")
PROMPT = "Tell me about the fleet"


def say(text: str) -> None:
    _venv.say("fleet", text)


def ensure_litellm(pin: str = LITELLM_PIN) -> Path:
    """The `litellm` executable of the pinned release, installed once into the cache (scripts/_venv.py)."""
    return _venv.ensure_venv("litellm", pin, [f"litellm[proxy]=={pin}"]) / "bin" / "litellm"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def litellm_config(hosts: list[Host], cooldown: float) -> str:
    """The proxy's config: one deployment per host, all in the model group MODEL."""
    lines = ["model_list:"]
    for h in hosts:
        lines += [f"  - model_name: {MODEL}",
                  "    litellm_params:",
                  f"      model: openai/{MODEL}",
                  f"      api_base: {h.url}/v1",
                  "      api_key: unused",
                  "      timeout: 60",
                  "      extra_headers: {\"X-Memvisor-Max-Wait\": \"0\"}",
                  "    model_info:",
                  f"      id: {h.name}"]
    lines += ["router_settings:",
              "  routing_strategy: simple-shuffle",
              "  num_retries: 5",  # tries on other deployments before the client sees an error
              "  retry_after: 0",
              "  allowed_fails: 0",  # one refusal cools a deployment down ...
              f"  cooldown_time: {cooldown:g}",  # ... for Retry-After seconds, this when it sends none
              "litellm_settings:",
              "  telemetry: false",
              "  request_timeout: 60",
              "general_settings:",
              "  master_key: os.environ/LITELLM_MASTER_KEY"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# the hosts


@dataclass
class Host:
    name: str
    dir: Path
    proc: subprocess.Popen | None = None
    url: str = ""

    @property
    def runtime(self) -> Path:
        return self.dir / "rt"

    def start(self, model: Path) -> None:
        """Serve on a port chosen now, so the router's config can name it before the host is up."""
        self.dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        config = self.dir / "memvisor.toml"
        config.write_text(
            "[supervisor]\n"
            f'http = "127.0.0.1:{port}"\n'
            f'host_name = "{self.name}"\n'
            "allow_drills = true\n"
            "heartbeat_interval = 0.5\n"
            "heartbeat_timeout = 3.0\n"
            "stop_grace = 3.0\n"
            "[[models]]\n"
            f'id = "{MODEL}"\n'
            f'path = "{model}"\n'
            "max_concurrency = 4\n"
            "max_queue = 16\n")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        log = open(self.dir / "serve.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "supervisor", "serve", "--config", str(config),
                                      "--runtime-dir", str(self.runtime)], cwd=ROOT, env=env, stdout=log,
                                     stderr=subprocess.STDOUT)

    def wait_address(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited ({self.proc.returncode}); see {self.dir / 'serve.log'}")
            try:
                http = json.loads((self.runtime / "endpoints.json").read_text()).get("http", "")
            except (OSError, ValueError):
                http = ""
            if http and self.url.endswith(http.rsplit(":", 1)[-1]) and self.proc.poll() is None:
                return
            time.sleep(0.2)
        raise SystemExit(f"{self.name} did not start its front door in time")

    def cli(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, "-m", "supervisor", *args, "--runtime-dir", str(self.runtime)], cwd=ROOT,
                       env=env, check=True, capture_output=True, timeout=60)

    def stop(self) -> None:
        if self.proc is not None:
            sigterm_then_kill(self.proc, grace=20)


async def served_counts(client: httpx.AsyncClient, hosts: list[Host]) -> dict[str, int]:
    """Requests each host finished, by its own /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = {}
    for h in hosts:
        text = (await client.get(f"{h.url}/metrics")).text
        counts[h.name] = int(sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                                 if s.name == "memvisor_generations_total" and s.labels.get("outcome") == "finished"))
    return counts


async def refusal_counts(client: httpx.AsyncClient, hosts: list[Host]) -> dict[str, dict[str, int]]:
    """Each host's refusals of generation requests, by status (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, int]] = {}
    for h in hosts:
        text = (await client.get(f"{h.url}/metrics")).text
        per: dict[str, int] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if (s.name == "memvisor_http_requests_total" and s.labels.get("endpoint") == "/v1/chat/completions"
                        and s.labels.get("status", "200") >= "400"):
                    per[s.labels["status"]] = per.get(s.labels["status"], 0) + int(s.value)
        out[h.name] = per
    return out


# ---------------------------------------------------------------------------
# faults: each pushes one host into refusals, then lets it go


async def fault_on(kind: str, host: Host, client: httpx.AsyncClient) -> dict:
    if kind == "drill":
        usage = (await client.get(f"{host.url}/status")).json()["guard"]["usage"]
        ceiling = usage + 128 * MiB
        await client.post(f"{host.url}/admin/guard", json={"tier": "custom", "custom_ceiling": ceiling})
        await asyncio.to_thread(host.cli, "drill", MODEL, "--rate", "1GiB/s", "--to", "256MiB")
        return {"ceiling": ceiling}
    if kind == "ceiling":
        await client.post(f"{host.url}/admin/guard", json={"tier": "custom", "custom_ceiling": "1MiB"})
        return {}
    if kind == "sigstop":
        for _ in range(40):  # a worker to stop: the router's traffic reloads it after the last fault
            card = (await client.get(f"{host.url}/v1/models/{MODEL}")).json()
            if card["readiness"]["loaded"]:
                break
            await asyncio.sleep(0.25)
        pid = card.get("pid")
        if pid:
            os.kill(pid, signal.SIGSTOP)
        return {"pid": pid, "stopped": bool(pid)}
    raise ValueError(kind)


async def fault_off(kind: str, host: Host, client: httpx.AsyncClient, info: dict) -> None:
    if kind == "drill":
        try:
            await asyncio.to_thread(host.cli, "drill", MODEL, "--stop")
        except subprocess.CalledProcessError:
            pass  # the guard stopped the worker: no drill left to stop
    if kind in ("drill", "ceiling"):
        await client.post(f"{host.url}/admin/guard", json={"tier": "balanced"})
    if kind == "sigstop" and info.get("pid"):
        try:
            os.kill(info["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass  # killed as wedged meanwhile
    # no reload by hand: the router's next request for this host starts the load (503
    # model_loading while it runs), and LiteLLM sends it back once Retry-After has passed


# ---------------------------------------------------------------------------
# traffic


@dataclass
class Outcome:
    began: float
    seconds: float
    status: int
    window: str  # "steady" or the fault's name
    host: str = ""
    error: str = ""
    retries: int = 0  # LiteLLM's tries on other hosts before this answer (x-litellm-attempted-retries)


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    window: str = "steady"
    running: bool = True


async def client_loop(run: Run, client: httpx.AsyncClient, url: str, key: str, tokens: int) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens}
    while run.running:
        window, began = run.window, time.monotonic()
        try:
            r = await client.post(url, json=body, headers={"authorization": f"Bearer {key}"})
            host = r.headers.get("llm_provider-x-memvisor-host") or r.headers.get("x-memvisor-host", "")
            error = "" if r.status_code == 200 else r.text[:300]
            retries = int(r.headers.get("x-litellm-attempted-retries") or 0)
            run.outcomes.append(Outcome(began, time.monotonic() - began, r.status_code, window, host, error,
                                        retries))
        except httpx.HTTPError as exc:
            run.outcomes.append(Outcome(began, time.monotonic() - began, 0, window, "", repr(exc)))


def percentile(ordered: list[float], q: int) -> float:
    """The nearest-rank q-th percentile of sorted values."""
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


# ---------------------------------------------------------------------------
# the run


async def drive(args, hosts: list[Host], proxy_url: str, key: str) -> dict:
    limits = httpx.Limits(max_connections=args.clients * 2 + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        for h in hosts:  # warm every host: the model loaded, as in a fleet that has served a while
            r = await client.post(f"{h.url}/v1/models/{MODEL}/load")
            r.raise_for_status()
        before = await served_counts(client, hosts)
        run = Run()
        url = f"{proxy_url}/v1/chat/completions"
        clients = [asyncio.ensure_future(client_loop(run, client, url, key, args.tokens))
                   for _ in range(args.clients)]
        victim = hosts[1 % len(hosts)]
        timeline = []
        await asyncio.sleep(args.steady)
        for kind in args.faults:
            say(f"fault {kind} on {victim.name}")
            run.window = kind
            started = time.monotonic()
            info = await fault_on(kind, victim, client)
            await asyncio.sleep(max(0.0, args.window - (time.monotonic() - started)))
            await fault_off(kind, victim, client, info)
            timeline.append({"fault": kind, "host": victim.name, "seconds": round(time.monotonic() - started, 1),
                             **{k: v for k, v in info.items() if k != "pid"}})
            run.window = "steady"
            say(f"fault {kind} lifted; recovering")
            await asyncio.sleep(args.recover)
        run.running = False
        await asyncio.gather(*clients)
        after = await served_counts(client, hosts)
        refusals = await refusal_counts(client, hosts)
    return summarise(run, {h: after[h] - before[h] for h in after}, refusals, timeline, victim.name)


def summarise(run: Run, served: dict[str, int], refusals: dict, timeline: list, victim: str) -> dict:
    ok = [o for o in run.outcomes if o.status == 200]
    failed = [o for o in run.outcomes if o.status != 200]
    steady = [o.seconds for o in ok if o.window == "steady"]
    faulty = [o.seconds for o in ok if o.window != "steady"]

    def ms(values: list[float], q: int) -> float:
        return round(1000 * percentile(sorted(values), q), 1) if values else float("nan")

    by_window: dict[str, int] = {}
    by_header: dict[str, int] = {}  # X-Memvisor-Host, as LiteLLM passes it on (llm_provider-...)
    for o in run.outcomes:
        by_window[o.window] = by_window.get(o.window, 0) + 1
        if o.status == 200:
            by_header[o.host or "?"] = by_header.get(o.host or "?", 0) + 1
    windows = {}
    for name in ("steady", *[f["fault"] for f in timeline]):
        done = [o.seconds for o in ok if o.window == name]
        windows[name] = {"requests": by_window.get(name, 0), "p50_ms": ms(done, 50), "p99_ms": ms(done, 99),
                         "retried": sum(1 for o in run.outcomes if o.window == name and o.retries)}
    return {
        "requests": len(run.outcomes), "failed": len(failed), "served": served, "victim": victim,
        "windows": windows, "retried": sum(1 for o in run.outcomes if o.retries),
        "refusals": refusals, "requests_by_window": by_window, "served_by_header": by_header,
        "p50_ms_steady": ms(steady, 50), "p99_ms_steady": ms(steady, 99),
        "p50_ms_fault": ms(faulty, 50), "p99_ms_fault": ms(faulty, 99),
        "failures": [{"status": o.status, "window": o.window, "error": o.error} for o in failed[:10]],
        "faults": timeline,
    }


def report(summary: dict) -> None:
    print(f"{'host':10} {'served':>7}  refusals to the router (status: count)")
    for name, count in summary["served"].items():
        mark = "  <- faults" if name == summary["victim"] else ""
        ref = ", ".join(f"{k}: {v}" for k, v in sorted(summary["refusals"].get(name, {}).items())) or "-"
        print(f"{name:10} {count:7}  {ref}{mark}")
    print(f"{'window':10} {'requests':>8} {'retried':>8} {'p50 ms':>8} {'p99 ms':>8}")
    faults = {f["fault"]: f for f in summary["faults"]}
    for name, w in summary["windows"].items():
        f = faults.get(name)
        note = ""
        if f is not None:
            note = f"  {f['seconds']} s on {f['host']}"
            note += f", ceiling {format_size(f['ceiling'])}" if "ceiling" in f else ""
            note += "" if f.get("stopped", True) else ", no worker to stop"
        print(f"{name:10} {w['requests']:8} {w['retried']:8} {w['p50_ms']:8} {w['p99_ms']:8}{note}")
    for f in summary["failures"]:
        print(f"failed: {f['status']} during {f['window']}: {f['error'][:200]}")
    split = ", ".join(f"{k} {v}" for k, v in summary["served"].items())
    print(f"fleet: {summary['requests']} requests, {summary['failed']} failed; served {split}; "
          f"p50/p99 {summary['p50_ms_steady']}/{summary['p99_ms_steady']} ms steady, "
          f"{summary['p50_ms_fault']}/{summary['p99_ms_fault']} ms during faults")


def start_litellm(exe: Path, hosts: list[Host], work: Path, key: str, cooldown: float) -> tuple[subprocess.Popen,
                                                                                                str]:
    config = work / "litellm.yaml"
    config.write_text(litellm_config(hosts, cooldown))
    port = free_port()
    env = {**os.environ, "LITELLM_MASTER_KEY": key,
           # offline: the model cost map is the one in the package, not fetched
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False",
           "DISABLE_SCHEMA_UPDATE": "True"}
    log = open(work / "litellm.log", "wb")
    proc = subprocess.Popen([str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
                            cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_proxy(proc: subprocess.Popen, url: str, deadline: float, log: Path) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"LiteLLM exited ({proc.returncode}); see {log}:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health/liveliness", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"LiteLLM did not answer in time; see {log}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=3, help="supervisors to start (2-3)")
    ap.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS), help="fault windows, in order")
    ap.add_argument("--clients", type=int, default=6, help="concurrent clients (no client retries)")
    ap.add_argument("--tokens", type=int, default=8, help="max_tokens of each request")
    ap.add_argument("--steady", type=float, default=15.0, help="seconds of traffic before the first fault")
    ap.add_argument("--window", type=float, default=12.0, help="seconds each fault lasts")
    ap.add_argument("--recover", type=float, default=12.0, help="seconds of traffic after each fault")
    ap.add_argument("--quick", action="store_true", help="short windows (the CI version)")
    ap.add_argument("--litellm", type=Path, help="an installed `litellm` executable (default: the pinned "
                    "release, installed once into the cache)")
    ap.add_argument("--work", type=Path, help="where hosts keep their runtime dirs and logs (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object, last")
    args = ap.parse_args(argv)
    if args.quick:
        args.steady, args.window, args.recover, args.clients = 6.0, 7.0, 6.0, 4
    if not 2 <= args.hosts <= 8:
        ap.error("--hosts: 2 to 8")
    exe = args.litellm or ensure_litellm()
    work = args.work or Path(tempfile.mkdtemp(prefix="memvisor-fleet-"))
    work.mkdir(parents=True, exist_ok=True)
    from modelfiles.modelgen import make_model

    model = work / "models" / MODEL
    if not (model / "config.json").exists():
        make_model(model, 4 * MiB, 0)
    hosts = [Host(name=f"fleet-{chr(ord('a') + i)}", dir=work / f"host{i}") for i in range(args.hosts)]
    key = "sk-" + secrets.token_hex(16)
    proxy: subprocess.Popen | None = None
    started = time.monotonic()
    try:
        for h in hosts:
            h.start(model)
        proxy, proxy_url = start_litellm(exe, hosts, work, key, cooldown=5)
        for h in hosts:
            h.wait_address(time.monotonic() + 120)
        wait_proxy(proxy, proxy_url, time.monotonic() + 180, work / "litellm.log")
        say(f"{len(hosts)} hosts and LiteLLM {LITELLM_PIN} up in {time.monotonic() - started:.0f} s; work dir {work}")
        summary = asyncio.run(drive(args, hosts, proxy_url, key))
    finally:
        if proxy is not None and proxy.poll() is None:
            os.killpg(proxy.pid, signal.SIGTERM)  # its own session: the proxy and its workers
            try:
                proxy.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proxy.pid, signal.SIGKILL)
        for h in hosts:
            h.stop()
    summary["wall_s"] = round(time.monotonic() - started, 1)
    summary["litellm"] = LITELLM_PIN
    report(summary)
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
