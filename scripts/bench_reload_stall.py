"""How long the supervisor's loop stops while a reload rescans a large models folder.

Why: a SIGHUP whose rescan of 150,000 empty folders outlasted the
heartbeat window blocked the loop, and every worker was then killed as
wedged. This starts a real Arbiter (no models, no front door), points its
reload at a models folder of N empty folders (plus one model), and measures,
with a ticker task that sleeps 20 ms at a time, the longest the loop went
without running while the reload ran, against how long the reload took.

    python scripts/bench_reload_stall.py [--folders 150000] [--model-name NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from supervisor.arbiter import Arbiter  # noqa: E402
from supervisor.config import Config, SupervisorConfig  # noqa: E402
from supervisor.doors.refusals import ServeError  # noqa: E402
from supervisor.models.discovery import with_discovered  # noqa: E402


async def measure(folder: Path, runtime: Path) -> tuple[float, float, str]:
    base = Config(supervisor=SupervisorConfig(models_dirs=[str(folder)], http="127.0.0.1:0"))

    def rescan() -> Config:
        return with_discovered(base)[0]

    arb = Arbiter(base, runtime, max_workers=4, http=False, reload_config=rescan)
    task = asyncio.get_running_loop().create_task(arb.run())
    while not arb.running:
        await asyncio.sleep(0.01)
    worst = 0.0
    done = False

    async def ticker() -> None:
        nonlocal worst
        last = time.monotonic()
        while not done:
            await asyncio.sleep(0.02)
            now = time.monotonic()
            worst = max(worst, now - last - 0.02)
            last = now

    tick = asyncio.get_running_loop().create_task(ticker())
    await asyncio.sleep(0.1)
    started = time.monotonic()
    try:
        summary = await arb.service.reload("bench")
    except ServeError as exc:  # past RELOAD_TIMEOUT: refused, the running config kept
        summary = f"refused: {exc}"
    took = time.monotonic() - started
    done = True
    await tick
    arb.stop()
    await task
    return took, worst, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folders", type=int, default=150_000)
    parser.add_argument("--model-name", default="My Model (4bit)", help="the one model folder's name")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "models"
        folder.mkdir()
        for i in range(args.folders):
            (folder / f"empty-{i:06d}").mkdir()
        model = folder / args.model_name
        model.mkdir()
        (model / "config.json").write_text("{}")
        header = b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'  # discovery reads it: a model needs a readable header
        (model / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)
        took, worst, summary = asyncio.run(measure(folder, Path(tmp) / "rt"))
    print(f"{args.folders} empty folders: reload took {took:.2f} s; longest loop stall during it "
          f"{worst * 1000:.0f} ms ({worst / took:.1%} of the reload)")
    print(f"  {summary}")


if __name__ == "__main__":
    main()
