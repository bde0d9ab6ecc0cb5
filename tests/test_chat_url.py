"""`yaied chat --url`: the terminal chat against a running daemon, and what it does on failures."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import httpx
import pytest

from tests.test_daemon import free_port, wait_healthy
from yaied import chat_client, cli


def run_chat(capsys, monkeypatch, lines: list[str], *argv: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    code = cli.main(["chat", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
def test_chat_with_a_running_daemon(tmp_path, capsys, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("# chat clients\nsecret\n")
    port = free_port()
    argv = ["serve", "--port", str(port), "--threads", "1", "--api-key-file", str(keys)]
    code = f"from yaied.cli import main; raise SystemExit(main({argv!r}))"
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "daemon.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stderr=log)
        try:
            wait_healthy(proc, base, log_path)
            monkeypatch.setenv("YAIED_API_KEY", "secret")
            chat = ["--url", base, "--max-tokens", "8", "--temperature", "0"]
            code, out, err = run_chat(
                capsys, monkeypatch, ["Hello!", "What is 2+2?", "/exit"], *chat
            )
            assert code == 0, err
            assert err == ""
            replies = [line for line in out.splitlines() if line.strip()]
            assert len(replies) >= 2, out
            # Two chat requests; the second carried the first turn too, so its prompt is longer.
            prompts = re.findall(
                r"request (?:[^ :]+:)?chatcmpl-\w+ \([^)]*\): .*?prompt (\d+) tokens",
                log_path.read_text(),
            )
            assert len(prompts) == 2 and int(prompts[1]) > int(prompts[0]) + 8

            # A wrong key: /v1/models refuses, one line, exit 1.
            code, out, err = run_chat(capsys, monkeypatch, ["Hi"], *chat, "--api-key", "wrong")
            assert code == 1 and out == ""
            assert err == "yaied: error: missing or invalid API key\n"
            # With --model the chat starts; the refused turn is one line and the chat goes on.
            lines = ["Hi", "/exit"]
            code, out, err = run_chat(
                capsys, monkeypatch, lines, *chat, "--api-key", "x", "--model", "m"
            )
            assert code == 1 and out == ""
            assert err == "yaied: error: missing or invalid API key\n"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            finally:
                proc.kill()


def test_a_refused_connection_is_one_line_and_exit_1(capsys, monkeypatch):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code, out, err = run_chat(capsys, monkeypatch, ["Hi"], "--url", url)
    assert code == 1 and out == ""
    assert err.startswith(f"yaied: error: cannot connect to {url}") and err.count("\n") == 1


def test_a_malformed_url_is_one_line_and_exit_1(capsys, monkeypatch):
    # httpx refuses "http://[::1" when the client is made, before any request: that escaped
    # as an httpx.InvalidURL traceback.
    code, out, err = run_chat(capsys, monkeypatch, ["Hi"], "--url", "http://[::1")
    assert code == 1 and out == ""
    assert err.startswith("yaied: error: http://[::1 is not a valid URL") and err.count("\n") == 1


class FakeClient:
    """ChatClient's surface, scripted: each turn yields its chunks, then raises what it lists."""

    turns: list[list[object]] = []
    bodies: list[dict] = []
    closed: list[bool] = []

    def __init__(self, url: str, api_key: str | None) -> None:
        pass

    def first_model(self) -> str:
        return "served"

    def stream_chat(self, body):
        FakeClient.bodies.append({**body, "messages": list(body["messages"])})
        script = FakeClient.turns.pop(0)
        try:
            for item in script:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            FakeClient.closed.append(True)

    def close(self) -> None:
        pass


def test_errors_and_ctrl_c_drop_the_turn_and_keep_the_chat(capsys, monkeypatch):
    FakeClient.turns = [
        ["Hel", "lo"],
        ["par", KeyboardInterrupt()],  # Ctrl-C while the answer streams
        [chat_client.ServerError("generation failed: boom")],  # an error chunk
        ["Fine."],
    ]
    FakeClient.bodies, FakeClient.closed = [], []
    monkeypatch.setattr(chat_client, "ChatClient", FakeClient)
    lines = ["one", "two", "three", "four"]
    code, out, err = run_chat(capsys, monkeypatch, lines, "--url", "http://x", "--system", "S")
    assert code == 1, err  # stdin is no terminal: the turns it lost make the status
    assert out == "Hello\npar\nFine.\n"
    assert err == "yaied: (answer interrupted)\nyaied: error: generation failed: boom\n"
    assert len(FakeClient.closed) == 4  # the interrupted stream was closed too
    assert FakeClient.bodies[0]["model"] == "served"
    last = FakeClient.bodies[-1]["messages"]
    assert [m["content"] for m in last] == ["S", "one", "Hello", "four"]  # failed turns dropped


@pytest.mark.parametrize("terminal", [False, True])
def test_a_piped_chat_that_lost_a_turn_exits_1(capsys, monkeypatch, terminal):
    """`yaied chat < questions` whose turns failed (a 503 while the model loaded, a 400 for a
    prompt over the context, an unknown --model) printed the errors and exited 0: a script saw
    success. The chat still goes on; at a terminal, a person read the errors, so 0 stays."""
    FakeClient.turns = [[chat_client.ServerError("the model is still loading")], ["Ok."]]
    FakeClient.bodies, FakeClient.closed = [], []
    monkeypatch.setattr(chat_client, "ChatClient", FakeClient)
    stdin = io.StringIO("one\ntwo\n")
    stdin.isatty = lambda: terminal
    monkeypatch.setattr(sys, "stdin", stdin)
    code = cli.main(["chat", "--url", "http://x"])
    out, err = capsys.readouterr()
    assert code == (0 if terminal else 1), err
    assert "Ok.\n" in out and "yaied: error: the model is still loading\n" in err


def test_a_piped_chat_whose_turns_all_answered_exits_0(capsys, monkeypatch):
    FakeClient.turns, FakeClient.bodies, FakeClient.closed = [["Ok."], ["Yes."]], [], []
    monkeypatch.setattr(chat_client, "ChatClient", FakeClient)
    code, out, err = run_chat(
        capsys, monkeypatch, ["one", "", "/reset", "two"], "--url", "http://x"
    )
    assert (code, out, err) == (0, "Ok.\nYes.\n", "")


def test_a_line_that_is_not_utf8_is_skipped_and_the_chat_goes_on(capsys, monkeypatch):
    # Bytes that are not UTF-8 (a Latin-1 terminal, a pasted binary) reach input() as lone
    # surrogates: the JSON encoder refused them and the chat ended (exit 2); offline, the
    # tokenizer raised a TypeError traceback.
    FakeClient.turns, FakeClient.bodies, FakeClient.closed = [["Ok."]], [], []
    monkeypatch.setattr(chat_client, "ChatClient", FakeClient)
    lines = ["caf\udce9", "Hello"]
    code, out, err = run_chat(capsys, monkeypatch, lines, "--url", "http://x")
    assert code == 1, err  # a line not sent is an answer missing
    assert out == "Ok.\n"
    assert err == "yaied: that line is not valid UTF-8 (check the terminal's encoding); not sent\n"
    assert [m["content"] for m in FakeClient.bodies[0]["messages"]] == ["Hello"]


def test_the_client_reads_openai_errors_and_error_chunks():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            error = {"error": {"message": "missing or invalid API key", "code": 401}}
            return httpx.Response(401, json=error)
        stream = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n: ping\n\n'
        stream += b'data: {"error":{"message":"generation failed: x"}}\n\n'
        return httpx.Response(200, content=stream)

    client = chat_client.ChatClient("http://test/v1/")
    assert client.root == "http://test"
    # The endpoint's own URL, as pasted from a curl line: it was "no route
    # /v1/chat/completions/v1/models" and exit 1.
    assert chat_client.api_root("http://test/v1/chat/completions") == "http://test"
    assert chat_client.api_root("http://test/chat/completions/") == "http://test"
    assert chat_client.api_root("http://test/proxy/v1") == "http://test/proxy"
    client.http = httpx.Client(base_url=client.root, transport=httpx.MockTransport(handler))
    # No key sent: the server's words named no way to send one.
    hint = r"^missing or invalid API key; pass one with --api-key KEY or \$YAIED_API_KEY$"
    with pytest.raises(chat_client.ServerError, match=hint):
        client.first_model()
    client.sends_key = True  # a key sent and refused: the server's words alone
    with pytest.raises(chat_client.ServerError, match="^missing or invalid API key$"):
        client.first_model()
    got = []
    with pytest.raises(chat_client.ServerError, match="generation failed: x"):
        for text in client.stream_chat({"messages": []}):
            got.append(text)
    assert got == ["a"]


# -- the serve flags for the daemon's key file and chat template ----------------------------


def test_serve_key_file_and_chat_template_flags(tmp_path, monkeypatch, tiny_model_dirs):
    import yaied.daemon

    seen = []
    monkeypatch.setattr(yaied.daemon, "run_server", lambda engine, server, *_: seen.append(server))
    keys = tmp_path / "keys"
    keys.write_text("k2\n")
    model = ["--model", str(tiny_model_dirs["llama"])]
    argv = ["serve", *model, "--api-key", "k1", "--api-key-file", str(keys)]
    assert cli.main([*argv, "--chat-template", "{{ messages }}"]) == 0
    assert seen[0].api_keys == ("k1", "k2") and seen[0].chat_template == "{{ messages }}"


def test_serve_with_a_missing_key_file_is_one_line_and_exit_2(tmp_path, capsys, tiny_model_dirs):
    missing = tmp_path / "no-keys"
    argv = ["serve", "--model", str(tiny_model_dirs["llama"]), "--api-key-file", str(missing)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("yaied: error: server.api_key_file") and str(missing) in err
    assert err.count("\n") == 1


# -- what a server that is not a yaied daemon (or a broken one) sends ----------------------------


def client_of(handler) -> chat_client.ChatClient:
    client = chat_client.ChatClient("http://test")
    client.http = httpx.Client(base_url=client.root, transport=httpx.MockTransport(handler))
    return client


def streamed(content, headers: dict[str, str] | None = None) -> chat_client.ChatClient:
    return client_of(lambda request: httpx.Response(200, headers=headers, content=content))


def test_a_stream_line_past_the_bound_is_an_error_having_read_no_more():
    """An endless line grew the client's memory without bound: lines are read up to 1 MiB (a
    chunk is well under a kilobyte); past that the turn fails, the stream read no further."""
    sent = []

    def endless():
        yield b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
        yield b'data: {"choices":[{"delta":{"content":"'
        for _ in range(64):  # 4 MiB, within one line (finite: without a bound, the test ends)
            sent.append(1)
            yield b"b" * 65536
        yield b'"}}]}\n\ndata: [DONE]\n\n'

    got = []
    with pytest.raises(chat_client.ServerError, match="line of over 1048576 bytes") as error:
        got.extend(streamed(endless()).stream_chat({"messages": []}))
    assert got == ["a"] and len(sent) <= 1 + (1 << 20) // 65536
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("content", "headers", "message"),
    [
        (b'{"choices":[{"message":{"content":"hi"}}]}', None, "ended before"),  # not streamed
        (b'{"choices":[]}', {"content-type": "application/json"}, "not an event stream"),
        (b"<html>busy</html>", {"content-type": "text/html"}, "not an event stream"),
        (b"data: [1, 2]\n\ndata: [DONE]\n\n", None, "not a JSON object"),
        (b'data: "a"\n\ndata: [DONE]\n\n', None, "not a JSON object"),
        (b"data: 5\n\ndata: [DONE]\n\n", None, "not a JSON object"),
        (b'data: {"choices": 5}\n\ndata: [DONE]\n\n', None, "choices"),
        (b'data: {"choices": [5]}\n\ndata: [DONE]\n\n', None, "choice"),
        (b'data: {"choices": [{"delta": "a"}]}\n\ndata: [DONE]\n\n', None, "delta"),
        (b'data: {"choices": [{"delta": {"content": 5}}]}\n\ndata: [DONE]\n\n', None, "content"),
        (b"data: {nope\n\n", None, "malformed stream chunk"),
    ],
)
def test_a_stream_that_is_not_an_openai_chat_stream_is_a_one_line_error(content, headers, message):
    """Such streams ended the chat with a traceback (AttributeError, TypeError), or, not SSE at
    all, gave an empty answer as if the model had said nothing."""
    with pytest.raises(chat_client.ServerError, match=message) as error:
        list(streamed(content, headers).stream_chat({"messages": []}))
    assert "\n" not in str(error.value) and "http://test" in str(error.value)


def test_a_well_formed_stream_with_its_content_type_still_streams():
    stream = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n: ping\n\n'
    stream += b'data: {"choices":[{"delta":{"content":"a"}}]}\r\n\r\n'
    stream += b'data:{"choices":[{"delta":{"content":"b"},"finish_reason":"stop"}]}\n\n'
    stream += b'data: {"choices":[],"usage":{"prompt_tokens":1}}\n\ndata: [DONE]\n\n'
    headers = {"content-type": "text/event-stream; charset=utf-8"}
    assert list(streamed(stream, headers).stream_chat({"messages": []})) == ["a", "b"]


def test_a_broken_stream_drops_the_turn_in_one_line_and_the_chat_goes_on(capsys, monkeypatch):
    import functools

    answers = [
        b'data: {"choices":[{"delta":{"content":"par"}}]}\n\ndata: [5]\n\n',
        b"data: " + b"x" * (chat_client.MAX_LINE_BYTES + 1),
        b'data: {"choices":[{"delta":{"content":"ok"}}]}\n\ndata: [DONE]\n\n',
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=answers.pop(0))

    client = functools.partial(httpx.Client, transport=httpx.MockTransport(handler))
    monkeypatch.setattr(chat_client.httpx, "Client", client)
    lines = ["one", "two", "three"]
    code, out, err = run_chat(capsys, monkeypatch, lines, "--url", "http://x", "--model", "m")
    assert code == 1, err
    assert out == "par\nok\n"
    errors = err.splitlines()
    assert len(errors) == 2 and all(e.startswith("yaied: error: ") for e in errors), err
    assert "not a JSON object" in errors[0] and "line of over" in errors[1]


def test_a_body_past_the_bound_is_an_error_having_read_no_more():
    """/v1/models and error bodies were read whole: they are read up to MAX_BODY_BYTES."""
    sent = []

    def huge(head: bytes):
        yield head
        for _ in range(256):  # 16 MiB of blanks: still valid JSON
            sent.append(1)
            yield b" " * 65536

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, content=huge(b'{"data": [{"id": "m"}]}'))
        return httpx.Response(400, content=huge(b'{"error": {"message": "no"}}'))

    client = client_of(handler)
    with pytest.raises(chat_client.ServerError, match="/v1/models body of over"):
        client.first_model()
    assert len(sent) <= 1 + chat_client.MAX_BODY_BYTES // 65536
    with pytest.raises(chat_client.ServerError, match="error body of over"):
        list(client.stream_chat({"messages": []}))


def test_a_gzip_bomb_is_bounded_by_what_it_expands_to(monkeypatch):
    """httpx decompressed each chunk whole before a bound saw it: 16 KiB of gzip became 16 MiB
    in the client's memory at once. The client asks for identity; a body compressed anyway is
    decompressed in pieces, so MAX_BODY_BYTES holds on what it expands to."""
    import functools
    import tracemalloc
    import zlib

    bomb = zlib.compress(b'{"data": [{"id": "m"}]}' + b" " * (16 << 20), wbits=zlib.MAX_WBITS | 16)
    asked = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.headers.get("accept-encoding"))
        sent = iter([bomb])  # as a socket gives it (bytes would be decoded on the spot)
        return httpx.Response(200, headers={"content-encoding": "gzip"}, content=sent)

    client = functools.partial(httpx.Client, transport=httpx.MockTransport(handler))
    monkeypatch.setattr(chat_client.httpx, "Client", client)
    chat = chat_client.ChatClient("http://test")
    tracemalloc.start()
    try:
        with pytest.raises(chat_client.ServerError, match="/v1/models body of over"):
            chat.first_model()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert asked == ["identity"]
    assert peak < chat_client.MAX_BODY_BYTES + (2 << 20), f"{peak} bytes held at once"
