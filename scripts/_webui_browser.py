"""Chats in Open WebUI through a real headless Chromium: run by `open_webui_run.py` in the playwright venv.

Playwright drives Debian's own Chromium (`executable_path`), so nothing is downloaded: no
browser build from Playwright's CDN (unreachable here), only the `playwright` wheel with its
driver. Playwright rather than raw CDP because it waits for elements, types into Open WebUI's
rich-text editor as a user would and reports timeouts plainly; hand-written CDP would redo all that.

Each chat is what a user does: open `/?models=ID` (Open WebUI's own link that preselects a
model), type the prompt into `#chat-input`, press Enter, and wait until the answer is shown
and Open WebUI has stored it as done. Argument: one JSON object {"url", "chromium", "shots",
"chats": [{"model", "prompt"}], "timeout_s"}. Output: one JSON line, a result per chat.
"""

from __future__ import annotations

import json
import sys
import time

from playwright.sync_api import Page, sync_playwright

# Open WebUI's own API, called from the page with the token the page holds (as its UI does).
FETCH = """async (path) => {
  const r = await fetch(path, {headers: {Authorization: `Bearer ${localStorage.token}`}});
  return {status: r.status, body: await r.json()};
}"""


def stored_answer(page: Page, chat_id: str) -> dict | None:
    """The chat's last assistant message as Open WebUI stored it, once it is done."""
    reply = page.evaluate(FETCH, f"/api/v1/chats/{chat_id}")
    if reply["status"] != 200:
        return None
    history = reply["body"].get("chat", {}).get("history", {})
    message = history.get("messages", {}).get(history.get("currentId") or "", {})
    if message.get("role") == "assistant" and message.get("done"):
        return message
    return None


def one_chat(page: Page, base: str, model: str, prompt: str, shot: str, timeout_s: float) -> dict:
    started = time.monotonic()
    page.goto(f"{base}/?models={model}")
    editor = page.locator("#chat-input")
    editor.wait_for(state="visible", timeout=timeout_s * 1000)
    page.keyboard.press("Escape")  # a first-visit "what's new" dialog, where one opens
    editor.click()
    page.keyboard.type(prompt)
    page.keyboard.press("Enter")
    page.wait_for_url("**/c/**", timeout=timeout_s * 1000)
    chat_id = page.url.rstrip("/").rsplit("/", 1)[-1]
    deadline = started + timeout_s
    message = None
    while message is None and time.monotonic() < deadline:
        time.sleep(0.5)
        message = stored_answer(page, chat_id)
    shown = page.locator("#response-content-container").last
    shown.wait_for(state="visible", timeout=10_000)
    page.screenshot(path=shot, full_page=True)
    return {"model": model, "prompt": prompt, "chat_id": chat_id, "done": message is not None,
            "stored": (message or {}).get("content", ""), "stored_model": (message or {}).get("model"),
            "error": (message or {}).get("error"), "shown": shown.inner_text(),
            "seconds": round(time.monotonic() - started, 2), "screenshot": shot}


def main() -> None:
    spec = json.loads(sys.argv[1])
    results = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=spec["chromium"], headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(spec["url"])
        page.wait_for_function("() => !!localStorage.token", timeout=spec["timeout_s"] * 1000)
        models = page.evaluate(FETCH, "/api/models")["body"].get("data", [])
        listed = [{"id": m["id"], "owned_by": m.get("owned_by"), "connection_type": m.get("connection_type")}
                  for m in models]
        for n, chat in enumerate(spec["chats"]):
            results.append(one_chat(page, spec["url"], chat["model"], chat["prompt"],
                                    f"{spec['shots']}/chat-{n}.png", spec["timeout_s"]))
        browser.close()
    print(json.dumps({"models": listed, "chats": results}))


if __name__ == "__main__":
    main()
