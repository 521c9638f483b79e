"""The dashboard in a real browser, during a fire drill.

A real supervisor (`python -m supervisor serve`, its own process) runs a
pinned model and a non-pinned one; headless Chromium (Debian's, through its
chromedriver: no browser download) opens the page. The test loads the second
model and switches the guard to a small custom ceiling from the page itself,
starts a fire drill in that model with `python -m supervisor drill`, and
checks that the chart and the event list follow it live and that the guard's
action appears with its reason. It saves a screenshot (the README's comes
from here: MEMVISOR_DASHBOARD_PNG=docs/dashboard.png).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from shared.sizes import MiB

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ROOT = Path(__file__).resolve().parents[2]
HEADROOM = 256 * MiB      # custom ceiling = group usage + this
DRILL_RATE = "64MiB/s"    # a few seconds of climb: the chart shows the rise, not a step


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


@pytest.fixture
def supervisor(tmp_path, tiny_models):
    runtime = tmp_path / "rt"
    config = tmp_path / "memvisor.toml"
    config.write_text(f"""
[guard]
tier = "balanced"
[supervisor]
http = "127.0.0.1:0"
allow_drills = true
idle_timeout = 600
[[models]]
id = "resident"
path = "{tiny_models.a}"
pinned = true
[[models]]
id = "victim"
path = "{tiny_models.small}"
ttl = 300
""")
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "supervisor", "serve", "--config", str(config),
                             "--runtime-dir", str(runtime)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def address() -> str:
        try:
            return json.loads((runtime / "endpoints.json").read_text()).get("http", "")
        except (OSError, ValueError):
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            return ""

    try:
        url = "http://" + wait_for(lambda: address().rsplit(":", 1)[-1] != "0" and address(), 60, "the front door")
        wait_for(lambda: httpx.get(url + "/health").status_code == 200, 60, "the pinned model")
        yield url, runtime
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture
def browser(tmp_path):
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("needs Debian's chromium and chromium-driver (.ci/run installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--no-first-run",
                f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1400,1250"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def model_row(driver, model: str) -> list[str]:
    """The row's cells, read in one script: the page redraws its rows every second."""
    return driver.execute_script(
        "const tr = document.querySelector(`#models tbody tr[data-model='${arguments[0]}']`);"
        " return tr ? [...tr.cells].map(td => td.textContent) : []", model)


def event_rows(driver) -> list[dict]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#events tbody tr')].map(tr => ({kind: tr.dataset.kind,"
        " cells: [...tr.cells].map(td => td.textContent)}))")


def test_dashboard_shows_a_fire_drill_live_with_the_guards_action_and_reason(supervisor, browser, tmp_path):
    try:
        drill_scenario(supervisor, browser, tmp_path)
    except BaseException:
        browser.save_screenshot(str(tmp_path / "failed.png"))
        print(f"the page when it failed: {tmp_path / 'failed.png'}; the server's log: {tmp_path / 'serve.log'}")
        print("browser console:", browser.get_log("browser"))
        raise


def drill_scenario(supervisor, browser, tmp_path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    url, runtime = supervisor
    browser.get(url + "/")
    # the models and the ceiling appear
    wait_for(lambda: model_row(browser, "resident")[1:2] == ["ready"], 20, "the pinned model's row")
    assert model_row(browser, "victim")[1] == "unloaded"
    wait_for(lambda: "GiB" in browser.find_element(By.ID, "ceiling").text, 20, "the ceiling")
    assert browser.find_element(By.ID, "binding").text.startswith("bound by ")
    assert "live" in browser.find_element(By.ID, "conn").text
    # SPEC D6: no discrete device here, so no device pool on the page
    assert not browser.find_element(By.ID, "device-card").is_displayed()
    # the y axis follows what is used, not the far ceiling (the lines lay flat on the floor)
    axis = wait_for(lambda: browser.execute_script(
        "const peak = Math.max(0, ...S.lines.group.map(p => p[1]));"
        " return S.axis && peak > 0 ? {top: S.axis.top, above: S.axis.above, peak: peak,"
        " ceiling: S.ceiling.ceiling} : null"), 20, "the chart's axis")
    if axis["peak"] < axis["ceiling"] / 4:  # a machine with room: the ceiling is far above the models
        assert axis["peak"] < axis["top"] <= 2 * axis["peak"] and "ceiling" in axis["above"], axis

    # admin from the page (loopback): load the victim, then a small custom ceiling
    browser.execute_script("document.querySelector(`#models tr[data-model='victim'] button`).click()")
    wait_for(lambda: model_row(browser, "victim")[1:2] == ["ready"], 60, "the victim to load")
    time.sleep(1.0)  # its first samples are counted in the group's usage
    usage = httpx.get(url + "/status").json()["guard"]["usage"]
    Select(browser.find_element(By.ID, "tier-select")).select_by_value("custom")
    browser.find_element(By.ID, "custom-ceiling").send_keys(str(usage + HEADROOM))
    browser.find_element(By.CSS_SELECTOR, "#guard-form button").click()
    wait_for(lambda: browser.find_element(By.ID, "tier").text == "custom", 10, "the tier switch")
    for button in browser.find_elements(By.CSS_SELECTOR, "[data-window='60']"):
        button.click()  # the last minute: the drill fills the chart
    time.sleep(2.0)
    chart_before = browser.execute_script("return document.getElementById('chart').toDataURL()")
    points_before = browser.execute_script("return (S.models.get('victim') || []).length")

    # the fire drill
    drill = subprocess.run([sys.executable, "-m", "supervisor", "drill", "victim", "--rate", DRILL_RATE,
                            "--to", "1GiB", "--runtime-dir", str(runtime)], cwd=ROOT, capture_output=True,
                           text=True, timeout=30)
    assert drill.returncode == 0, drill.stderr
    wait_for(lambda: any(r["kind"] == "drill" for r in event_rows(browser)), 10, "the drill in the event list")
    actions = wait_for(lambda: [r for r in event_rows(browser) if r["kind"] in ("evict", "abort", "mark_for_unload")
                                and r["cells"][2] == "victim"], 60, "the guard's action in the event list")
    reason = actions[0]["cells"][3]
    assert "pressure" in reason, reason
    # the card shows the guard's latest action with its reason (it may have acted again since)
    card = browser.find_element(By.ID, "last-action").text
    acted = [r["cells"][3] for r in event_rows(browser)
             if r["kind"] in ("evict", "abort", "mark_for_unload", "abort_load", "reclaim", "shrink_cache")]
    assert any(words and words in card for words in acted), (card, acted)
    levels = [r["cells"][3] for r in event_rows(browser) if r["kind"] == "level"]
    assert any("-> hard" in words for words in levels), levels
    if actions[-1]["kind"] == "evict":  # the idle victim is stopped: its row says so
        wait_for(lambda: model_row(browser, "victim")[1:2] == ["unloaded"], 10, "the evicted model's row")

    # the chart followed: samples over the soft watermark, drawn
    time.sleep(1.5)  # and the fall after the action
    soft = browser.execute_script("return S.ceiling.soft_bytes")
    peak = browser.execute_script("return Math.max(...S.models.get('victim').map(p => p[1]))")
    group_peak = browser.execute_script("return Math.max(...S.lines.group.map(p => p[1]))")
    assert browser.execute_script("return S.models.get('victim').length") > points_before + 8
    assert group_peak >= soft and peak > 100 * MiB
    assert browser.execute_script("return document.getElementById('chart').toDataURL()") != chart_before
    assert browser.execute_script("return S.marks.some(e => e.kind === 'drill')")
    # near the watermarks the axis takes them in: the ceiling is a line on the chart
    axis = browser.execute_script("return S.axis")
    assert "ceiling" in axis["shown"] and axis["top"] >= browser.execute_script("return S.ceiling.ceiling"), axis

    shot = tmp_path / "dashboard.png"
    assert browser.save_screenshot(str(shot))
    target = os.environ.get("MEMVISOR_DASHBOARD_PNG")
    if target:
        shutil.copyfile(shot, ROOT / target)
    device_card(browser)


def device_card(browser) -> None:
    """SPEC D6: a pressure message with a device pool shows its card (drawn in one script: the
    page redraws its cards from the live messages, which carry no device here)."""
    seen = browser.execute_script("""
        renderDevice({name: "NVIDIA H200", total: 24 * GiB, free: 3 * GiB, usage: 21 * GiB, ceiling: 22 * GiB,
          binding: "device_static", soft_bytes: 20 * GiB, hard_bytes: 21.5 * GiB, level: "soft",
          emergency: false, utilization: 21 / 22});
        const card = document.getElementById("device-card");
        return {hidden: card.hidden, usage: document.getElementById("device-usage").textContent,
          level: document.getElementById("device-level").className,
          sub: document.getElementById("device-sub").textContent,
          fill: document.getElementById("device-fill").style.width,
          name: document.getElementById("device-name").textContent};
    """)
    assert not seen["hidden"] and seen["name"] == "NVIDIA H200"
    assert seen["usage"] == "21.00 GiB / 22.00 GiB" and seen["level"] == "badge level-soft"
    assert "bound by device_static" in seen["sub"] and seen["fill"] == "95.5%"
    assert browser.execute_script("renderDevice(null); return document.getElementById('device-card').hidden")
