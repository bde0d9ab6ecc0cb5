"""`yaied chat`'s terminal side: the loop that reads turns, and a daemon's answers streamed to
the terminal (`chat --url`). cli.py builds the engine or the client and calls these.

    read a line -> /exit, /reset or a user turn -> respond(messages) -> the reply joins the
    history (None: the turn is dropped, the chat goes on)
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from yaied.cli_args import PROG, is_utf8, one_line

if TYPE_CHECKING:  # httpx loads only for `chat --url`
    from yaied.chat_client import ChatClient

Respond = Callable[[list[dict[str, str]]], str | None]


def read_line(interactive: bool) -> str | None:
    try:
        return input("> " if interactive else "")
    except EOFError:
        if interactive:
            print()  # leave the shell prompt on a line of its own
        return None


def chat_loop(opening: list[dict[str, str]], respond: Respond) -> int:
    """Read turns until /exit or EOF; ``respond`` answers one, or returns None to drop it.

    The exit status: 0, or 1 when input is not a terminal and a turn was dropped. The chat goes
    on after a failed turn either way, but a script feeding it (`yaied chat < questions`) must
    not read success from a run whose answers are missing (each failure has its line on stderr).
    """
    interactive = sys.stdin.isatty()
    messages = list(opening)
    dropped = 0
    while (line := read_line(interactive)) is not None:
        command = line.strip()
        if command in ("/exit", "/quit"):
            break
        if command == "/reset":
            messages = list(opening)
            if interactive:
                print("(history cleared)", file=sys.stderr)
            continue
        if not command:
            continue
        if not is_utf8(line):  # undecodable bytes: input() gives them as lone surrogates
            print(
                f"{PROG}: that line is not valid UTF-8 (check the terminal's encoding); not sent",
                file=sys.stderr,
            )
            dropped += 1
            continue
        messages.append({"role": "user", "content": line})
        reply = respond(messages)
        if reply is None:
            messages.pop()
            dropped += 1
            continue
        messages.append({"role": "assistant", "content": reply})
    return 1 if dropped and not interactive else 0


def remote_responder(client: ChatClient, model: str, sampling: dict[str, Any]) -> Respond:
    """Each turn streamed from the daemon to stdout. Ctrl-C during an answer ends that answer;
    an error inside it (ServerError) drops the turn; ServerUnreachable ends the chat."""
    from yaied.chat_client import ServerError

    def respond(messages: list[dict[str, str]]) -> str | None:
        parts: list[str] = []
        deltas = client.stream_chat({"model": model, "messages": messages, **sampling})
        try:
            with contextlib.closing(deltas):  # closing the response aborts the request
                for text in deltas:
                    parts.append(text)
                    sys.stdout.write(text)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            print(file=sys.stdout)
            print(f"{PROG}: (answer interrupted)", file=sys.stderr)
            return None
        except ServerError as exc:
            if parts:
                print(file=sys.stdout)
            print(f"{PROG}: error: {one_line(exc)}", file=sys.stderr)
            return None
        print(file=sys.stdout)
        return "".join(parts)

    return respond
