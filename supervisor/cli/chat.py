"""`chat MODEL [PROMPT]`: talk to a model in the terminal, as `ollama run` does.

With a PROMPT (or a prompt on stdin when it is not a terminal) it prints the
answer and exits 0, or prints one line saying what failed and exits 1: for
scripts. Without one it is a session: the reply streams as it is made, a
model that is not loaded yet shows its load's progress, the conversation is
kept until `/clear`, a line ending in `\\` continues on the next, `\"\"\"` opens
and closes a block of several lines, and `/bye` or Ctrl-D leaves. Ctrl-C
stops a reply.

It only sends requests to the running supervisor's front door
(supervisor.doors.chat_client), so the model is loaded under the same admission
as any client's request.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

HELP = ('commands: /bye (or Ctrl-D) leaves, /clear forgets the conversation, /? this help; a line ending '
        'in \\ continues, """ opens and closes a block of several lines')
POLL_EVERY = 0.5  # seconds between two looks at a load's progress


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a model id (or alias) the supervisor serves")
    parser.add_argument("prompt", nargs="?", help="one prompt: print the answer and exit (a prompt on stdin "
                        "does the same when stdin is not a terminal)")
    parser.add_argument("--system", default="", help="a system message to start the conversation with")
    parser.add_argument("--url", default="", help="the front door, e.g. http://127.0.0.1:8000 (default: the "
                        "running supervisor's, from the runtime dir)")
    parser.add_argument("--api-key", default=os.environ.get("MEMVISOR_API_KEY", ""),
                        help="when the server has [supervisor] api_keys (default: $MEMVISOR_API_KEY)")
    parser.add_argument("--max-tokens", type=int, default=0, help="the most tokens a reply may have")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the model's)")


def run(args: argparse.Namespace) -> int:
    import logging

    import httpx

    from supervisor.doors.chat_client import CONNECT_SECONDS, ChatError, front_door

    if not args.verbose:  # httpx logs each request at INFO: not for a chat's terminal
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        url = args.url.rstrip("/") or front_door(args.runtime_dir)
    except ChatError as exc:
        return _fail(str(exc))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    options: dict[str, Any] = {}
    if args.max_tokens > 0:
        options["num_predict"] = args.max_tokens
    if args.temperature is not None:
        options["temperature"] = args.temperature
    start = [{"role": "system", "content": args.system}] if args.system else []
    with httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(CONNECT_SECONDS, read=None)) as client:
        chat = Chat(client, args.model, options, start)
        if args.prompt is not None or not sys.stdin.isatty():
            return chat.once(args.prompt if args.prompt is not None else sys.stdin.read())
        return chat.session()


def _fail(message: str) -> int:
    print(f"memvisor: {message}", file=sys.stderr)
    return 1


class Chat:
    def __init__(self, client, model: str, options: dict[str, Any], start: list[dict[str, str]]) -> None:
        self.client, self.model, self.options = client, model, options
        self.start = start
        self.messages = list(start)
        self.status = ""  # the progress line now on stderr ("" when none)

    def once(self, prompt: str) -> int:
        from supervisor.doors.chat_client import ChatError

        if not prompt.strip():
            return _fail("the prompt is empty")
        try:
            self.answer(prompt)
        except ChatError as exc:
            return _fail(str(exc))
        print()
        return 0

    def answer(self, prompt: str) -> str:
        """The reply to `prompt`, printed as it comes; kept in the conversation when it completes."""
        from supervisor.doors.chat_client import Reply, load_line

        reply = Reply(self.client, self.model, [*self.messages, {"role": "user", "content": prompt}], self.options)
        text: list[str] = []
        polled = time.monotonic()
        try:
            for piece in reply.pieces():
                if piece is None:
                    if not text and time.monotonic() - polled >= POLL_EVERY and sys.stderr.isatty():
                        polled = time.monotonic()
                        self._show(load_line(self.client, self.model))
                    continue
                self._show("")
                sys.stdout.write(piece)
                sys.stdout.flush()
                text.append(piece)
        finally:
            self._show("")
            reply.close()
        answer = "".join(text)
        self.messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        return answer

    def _show(self, line: str) -> None:
        """One status line on stderr, replaced in place (nothing when stderr is not a terminal)."""
        if line == self.status or not sys.stderr.isatty():
            return
        sys.stderr.write("\r\033[K" + line[:200])
        sys.stderr.flush()
        self.status = line

    def session(self) -> int:
        from supervisor.doors.chat_client import ChatError

        try:
            import readline  # noqa: F401  (line editing and the arrow keys' history for input())
        except ImportError:
            pass
        print(f"chatting with {self.model}: /bye or Ctrl-D to leave, /? for help")
        while True:
            try:
                text = read_message()
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:
                print("\nUse Ctrl-D or /bye to leave.")
                continue
            if text is None or self.command(text.strip()):
                continue
            if text.strip() in ("/bye", "/exit", "/quit"):
                return 0
            try:
                self.answer(text)
                print()
            except ChatError as exc:
                print(f"memvisor: {exc}", file=sys.stderr)
            except KeyboardInterrupt:
                print("\n(stopped)")

    def command(self, text: str) -> bool:
        """A slash command handled here (True), or text for the model (False; /bye is the caller's)."""
        if text == "/clear":
            self.messages = list(self.start)
            print("(the conversation is forgotten)")
        elif text in ("/?", "/help"):
            print(HELP)
        elif text.startswith("/") and text not in ("/bye", "/exit", "/quit") and " " not in text:
            print(f"unknown command {text}; /? lists them")
        else:
            return False
        return True


def read_message() -> str | None:
    """One message from the terminal (None when it is blank): `\\` at a line's end continues,
    `\"\"\"` opens a block that the next `\"\"\"` closes."""
    line = input(">>> ")
    if line.lstrip().startswith('"""'):
        rest = line.lstrip()[3:]
        if rest.rstrip().endswith('"""'):
            return rest.rstrip()[:-3] or None
        lines = [rest] if rest else []
        while not (more := input("... ")).rstrip().endswith('"""'):
            lines.append(more)
        lines.append(more.rstrip()[:-3])
        text = "\n".join(lines).strip("\n")
        return text or None
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = input("... ")
    lines.append(line)
    text = "\n".join(lines)
    return text if text.strip() else None
