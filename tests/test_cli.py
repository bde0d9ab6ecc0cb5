"""The command line: generated config flags, one-line errors, and `serve`/`chat` end to end."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_CONFIGS, make_tiny_model
from tests.test_daemon import free_port
from yaied import cli
from yaied.core.config import SECTIONS
from yaied.core.errors import EngineStartError
from yaied.core.request import FinishReason, TokenEvent
from yaied.engine.async_engine import AsyncEngine

SAMPLE_VALUES = {int: ("3", 3), float: ("0.5", 0.5), str: ("x", "x")}


@pytest.fixture(autouse=True)
def no_config_env(monkeypatch):
    # A YAIED_<SECTION>_<KEY> in the caller's shell must not change what these tests see.
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            monkeypatch.delenv(f"YAIED_{section}_{f.name}".upper(), raising=False)


def parse(*argv: str):
    return cli.build_parser().parse_args(list(argv))


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- flags ----------------------------------------------------------------------------------


def test_every_setting_has_a_flag():
    flags = {spec.setting: spec.flag for spec in cli.setting_flags()}
    settings = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert set(flags) == settings
    assert len(set(flags.values())) == len(flags)
    for flag in ("--max-num-seqs", "--page-size", "--kv-cache-gib", "--dtype", "--model"):
        assert flag in flags.values()


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_each_flag_parses_to_a_typed_override(command):
    for spec in cli.setting_flags():
        if spec.kind is bool:
            assert cli.config_overrides(parse(command, spec.flag)) == {spec.setting: True}
            negated = "--no-" + spec.flag.removeprefix("--")
            assert cli.config_overrides(parse(command, negated)) == {spec.setting: False}
        else:
            raw, value = SAMPLE_VALUES[spec.kind]
            overrides = cli.config_overrides(parse(command, spec.flag, raw))
            assert overrides == {spec.setting: value}
            assert type(overrides[spec.setting]) is spec.kind


def test_only_given_flags_become_overrides():
    assert cli.config_overrides(parse("serve")) == {}
    assert cli.config_overrides(
        parse("chat", "--page-size", "8", "--no-enable-prefix-caching")
    ) == {
        "cache.page_size": 8,
        "cache.enable_prefix_caching": False,
    }


def test_flags_over_env_over_toml(tmp_path, monkeypatch):
    path = tmp_path / "yaied.toml"
    path.write_text(
        "[cache]\npage_size = 8\n[scheduler]\nmax_num_seqs = 2\nmax_num_batched_tokens = 64\n"
    )
    monkeypatch.setenv("YAIED_SCHEDULER_MAX_NUM_SEQS", "3")
    monkeypatch.setenv("YAIED_SCHEDULER_MAX_NUM_BATCHED_TOKENS", "128")
    args = parse("serve", "--config", str(path), "--max-num-batched-tokens", "256")
    config = cli.load_cli_config(args)
    assert config.cache.page_size == 8  # TOML, untouched by an unset flag
    assert config.scheduler.max_num_seqs == 3  # env over TOML
    assert config.scheduler.max_num_batched_tokens == 256  # flag over env


def test_serve_and_chat_defaults():
    serve = parse("serve")
    assert (serve.host, serve.port, serve.max_tokens) == (None, None, 64)  # [server] defaults
    assert serve.prompt is None and serve.log_level is None  # info for the daemon
    chat = parse("chat")
    assert (chat.temperature, chat.top_p, chat.max_tokens, chat.system) == (0.7, None, 256, None)


def test_help_exits_zero(capsys):
    code, out, _ = run_main(capsys, "serve", "--help")
    assert code == 0
    assert "--page-size" in out and "--no-enable-prefix-caching" in out
    assert "--served-model-name" in out and "--api-key" in out


def test_python_dash_m_yaied_is_the_cli():
    # A GPU image with its own torch runs the checkout uninstalled: `python -m yaied serve ...`.
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "yaied", "serve", "--bogus-flag"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert done.stderr.strip().startswith("yaied: error:") and "--bogus-flag" in done.stderr


# -- errors: one line, exit 2 ---------------------------------------------------------------


def assert_one_line_error(code: int, out: str, err: str, pattern: str) -> None:
    assert code == 2
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("yaied: error: ")
    assert re.search(pattern, err), err


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        ([], "required"),
        (["frob"], "invalid choice: 'frob'"),
        (["serve", "--bogus"], "unrecognized arguments: --bogus"),
        (["serve", "--page-size", "x"], r"--page-size: invalid int value: 'x'"),
        (["serve", "--page-size", "0"], r"cache\.page_size must be an integer >= 1"),
        (["serve", "--dtype", "int8"], r"model\.dtype must be one of"),
        (["chat", "--scheduler-policy", "x"], r"scheduler\.policy must be one of"),
        (["serve", "--kv-cache-gib", "0"], r"cache\.kv_cache_gib must be a finite number > 0"),
        # oneDNN could not lay out the linears for such steps: plain F.linear, several times
        # slower, after one warning in the log
        (
            ["serve", "--max-num-batched-tokens", "1048577"],
            r"max_num_batched_tokens \(--max-num-batched-tokens\) must be at most 1048576",
        ),
        (["serve", "--port", "0"], r"--port: port must be an integer in 1\.\.65535"),
        (["serve", "--prompt", "x", "--max-tokens", "0"], "max_tokens must be at least 1"),
        (["chat", "--temperature", "-1"], "temperature must be >= 0"),
        (["chat", "--top-p", "2"], r"top_p must be in \(0, 1\]"),
        (["serve", "--log-level", "loud"], "--log-level: invalid choice"),
        # Bytes that are not UTF-8 reach argv as lone surrogates: the tokenizer raised a
        # TypeError traceback (--prompt, --system) and the JSON encoder refused them later.
        (["serve", "--prompt", "caf\udce9"], "--prompt: not valid UTF-8"),
        (["chat", "--system", "caf\udce9"], "--system: not valid UTF-8"),
        (["serve", "--served-model-name", "m\udcff"], "--served-model-name: not valid UTF-8"),
        # httpx's "unsupported protocol 'localhost://'" at the first request, exit 1, no flag
        (["chat", "--url", "localhost:8000"], "--url: expected an http:// or https:// URL"),
        (["chat", "--url", "127.0.0.1"], "--url: expected an http:// or https:// URL"),
        (["chat", "--url", "ftp://h"], "--url: expected an http:// or https:// URL"),
        (["chat", "--url", ""], "--url: expected an http:// or https:// URL"),
        # "" served as --model without a word; blanks named nothing a client could type
        (["serve", "--served-model-name", "", "--model", "/no/model"], "must not be empty"),
        (["serve", "--served-model-name", " ", "--model", "/no/model"], "must not be empty"),
        # "" was no key file, no template: the daemon started without them, perhaps without auth
        (["serve", "--api-key-file", "", "--model", "/no/model"], "--api-key-file: must not be"),
        (["serve", "--chat-template", "", "--model", "/no/model"], "--chat-template: must not"),
    ],
)
def test_bad_flags_and_values(capsys, argv, pattern):
    assert_one_line_error(*run_main(capsys, *argv), pattern)


def test_missing_config_file(capsys, tmp_path):
    missing = tmp_path / "nope.toml"
    result = run_main(capsys, "serve", "--config", str(missing))
    assert_one_line_error(*result, rf"cannot read {re.escape(str(missing))}: No such file")


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("[cache\npage_size = 8\n", r"yaied\.toml: .*line 1"),
        ("[cache]\npage_sise = 8\n", r"unknown setting cache\.page_sise"),
        ('[cache]\nkv_cache_gib = "1"\n', "kv_cache_gib must be a float"),
    ],
)
def test_bad_config_files(capsys, tmp_path, text, pattern):
    path = tmp_path / "yaied.toml"
    path.write_text(text)
    assert_one_line_error(*run_main(capsys, "serve", "--config", str(path)), pattern)


def test_bad_env_value(capsys, monkeypatch):
    monkeypatch.setenv("YAIED_CACHE_PAGE_SIZE", "sixteen")
    assert_one_line_error(*run_main(capsys, "chat"), "YAIED_CACHE_PAGE_SIZE='sixteen'")


def test_unknown_model(capsys, tmp_path):
    result = run_main(capsys, "serve", "--model", str(tmp_path / "no-such-model"))
    assert_one_line_error(*result, "unknown model")


def assert_one_line_failure(code: int, out: str, err: str, pattern: str) -> None:
    """A failure a later start may not meet: one line, exit 1, which systemd retries."""
    assert (code, out) == (cli.EXIT_FAILED, "")
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("yaied: error: ") and re.search(pattern, err), err


@pytest.mark.parametrize(
    ("host", "pattern", "code"),
    [
        # the port's holder may leave (systemd's restart then succeeds): exit 1
        ("127.0.0.1", r"cannot listen on 127\.0\.0\.1:\d+: .*[Aa]ddress already in use", 1),
        # a name that does not resolve is a setting to fix: exit 2, not retried
        ("no such host.invalid", r"cannot listen on no such host\.invalid:\d+: ", 2),
    ],
)
def test_serve_on_an_address_it_cannot_listen_on(
    capsys, tiny_model_dirs, monkeypatch, host, pattern, code
):
    """A port in use or a host that does not resolve is one line, before the model loads: not
    uvicorn's log lines, exit 3, and a "ready ... listening on" for a socket it never had, after
    a load (a first conversion takes seconds) nobody can use."""
    import socket

    loads = []
    monkeypatch.setattr(AsyncEngine, "__init__", lambda self, *a, **k: loads.append(a))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        argv = ["serve", "--model", str(tiny_model_dirs["llama"]), "--host", host, "--port", port]
        check = assert_one_line_failure if code == 1 else assert_one_line_error
        check(*run_main(capsys, *argv), pattern)
    assert loads == []


def test_a_ray_cluster_that_does_not_answer_exits_1(capsys, tiny_model_dirs, tmp_path):
    """Its head may be restarting: systemd retries exit 1, and not exit 2 (a setting to fix)."""
    import socket

    pytest.importorskip("ray")
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
    config = tmp_path / "yaied.toml"
    config.write_text('[[engines]]\nkind = "ray"\n')
    argv = ["serve", "--model", str(tiny_model_dirs["llama"]), "--config", str(config)]
    result = run_main(capsys, *argv, "--ray-address", address)
    assert_one_line_failure(*result, "cannot reach the Ray cluster at 127.0.0.1")


@pytest.mark.parametrize(
    ("broken", "pattern"),
    [
        ("weights", "is not a readable safetensors file"),  # found while the model loads
        ("pool", "the KV pool holds"),  # found once the weights are in
    ],
)
def test_a_model_that_cannot_load_is_a_setting_exit_2(
    capsys, tiny_model_dirs, tmp_path, broken, pattern
):
    """Found after the socket opened, in the load's thread, yet still a setting to fix: exit 2,
    which systemd does not retry (a restart would fail the same way)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dirs["llama"], model)
    kv = "0.01"
    if broken == "weights":
        (model / "model.safetensors").write_bytes(b"\x00" * 64)
    else:
        kv = "0.00001"
    argv = ["serve", "--model", str(model), "--kv-cache-gib", kv, "--threads", "1"]
    code, out, err = run_main(capsys, *argv, "--port", str(free_port()))
    assert code == cli.EXIT_USAGE and out == "", err
    assert re.search(pattern, err.splitlines()[-1]), err


@pytest.mark.parametrize(
    ("command", "pattern"),
    [(["chat"], "has no chat template"), (["serve", "--prompt", "Hi"], "has no tokenizer")],
)
def test_a_model_without_tokenizer(capsys, tiny_model_dirs, monkeypatch, command, pattern):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))
    argv = [*command, "--model", str(tiny_model_dirs["llama"]), "--kv-cache-gib", "0.01"]
    assert_one_line_error(*run_main(capsys, *argv), pattern)


# -- interrupts and engine failures ---------------------------------------------------------


def test_ctrl_c_exits_130_quietly(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_serve", interrupted)
    assert run_main(capsys, "serve") == (130, "", "")


class FailingEngine:
    async def generate(self, prompt, **sampling):
        yield TokenEvent("r", [5], "par", None)
        yield TokenEvent("r", [], "", FinishReason.ERROR, error="worker died")


def test_a_failed_generation_exits_1_with_one_line(capsys, monkeypatch):
    def serve(args):
        return asyncio.run(cli.stream_reply(FailingEngine(), "hi", {}))

    monkeypatch.setattr(cli, "_serve", serve)
    code, out, err = run_main(capsys, "serve")
    assert code == 1
    assert out == "par"  # what streamed before the failure stays printed
    assert err == "yaied: error: generation failed: worker died\n"


def test_an_engine_killed_while_loading_exits_1_with_one_line(capsys, monkeypatch):
    # router/local_process.py raises it when an engine process ends before it is ready
    def serve(args):
        raise EngineStartError("engine 0 process killed by signal 9 (SIGKILL) while loading")

    monkeypatch.setattr(cli, "_serve", serve)
    code, out, err = run_main(capsys, "serve")
    assert (code, out) == (1, "")
    assert err == "yaied: error: engine 0 process killed by signal 9 (SIGKILL) while loading\n"


# -- end to end with the default model ------------------------------------------------------

# One torch thread: with every core, a test run beside other busy processes was measured 25x
# slower per step (OpenMP threads waiting on a preempted sibling).
ONE_THREAD = ("--threads", "1")


@pytest.fixture
def torch_threads_restored():
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # the worker set it for the whole process


@pytest.fixture
def generate_calls(monkeypatch) -> list[dict[str, str]]:
    """Record each accepted generation's prompt (decoded) and text, passing the events through."""
    calls: list[dict[str, str]] = []
    real = AsyncEngine.generate

    async def generate(self, prompt, *args, **kwargs):
        events = real(self, prompt, *args, **kwargs)
        first = await anext(events)  # a rejected prompt raises here, before any record
        call = {"prompt": self.tokenizer.decode(prompt), "text": first.text}
        calls.append(call)
        yield first
        async for event in events:
            call["text"] += event.text
            yield event

    monkeypatch.setattr(AsyncEngine, "generate", generate)
    return calls


@pytest.mark.slow
def test_chat_keeps_history_resets_and_survives_a_too_long_turn(
    capsys, monkeypatch, generate_calls, torch_threads_restored
):
    too_long = "word " * 300  # over --max-model-len: reported, dropped, the chat goes on
    lines = ["Hello!", "What is 2+2?", "/reset", too_long, "", "Bye", "/exit", "never read"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    argv = [
        "chat",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--max-model-len",
        "256",
        *ONE_THREAD,
    ]
    code, out, err = run_main(capsys, *argv)
    assert code == 1, err  # piped: the too-long turn went unanswered (tests/test_chat_url.py)
    assert len(generate_calls) == 3
    first, second, third = generate_calls
    assert "Hello!" in first["prompt"]
    assert "Hello!" in second["prompt"] and first["text"] in second["prompt"]
    assert "What is 2+2?" in second["prompt"]
    assert "Hello!" not in third["prompt"] and "Bye" in third["prompt"]
    assert all(call["text"].strip() for call in generate_calls)
    # No "> " prompt without a TTY: stdout holds just the replies, one per line break.
    assert out == "".join(call["text"] + "\n" for call in generate_calls)
    assert "exceeds the model's context length" in err and "/reset" in err


@pytest.mark.slow
def test_serve_prints_the_answer_and_a_rate(capsys, torch_threads_restored):
    code, out, err = run_main(capsys, "serve", "--prompt", "Hi!", "--max-tokens", "4", *ONE_THREAD)
    assert code == 0, err
    assert out.strip()
    assert re.search(r"^[1-4] tokens in \d+\.\d\d s \(\d+\.\d tok/s\)$", err, re.MULTILINE), err


class _InterruptOnce(io.StringIO):
    """stdout that sends this process SIGINT at the first text of the first answer, as a Ctrl-C
    in the terminal would: the signal reaches the asyncio runner between two tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.fired = False

    def write(self, text: str) -> int:
        if text.strip() and not self.fired:
            self.fired = True
            signal.raise_signal(signal.SIGINT)
        return super().write(text)


def tiny_chat_model(tmp_path: Path, default_model_folder: Path) -> Path:
    """A tiny random model (context 2048) with the default model's tokenizer and chat template."""
    folder = tmp_path / "tiny-chat"
    config = dict(TINY_CONFIGS["llama"], vocab_size=49152, max_position_embeddings=2048)
    make_tiny_model("llama", folder, configs={"llama": config})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_folder / name).exists():
            shutil.copy(default_model_folder / name, folder / name)
    return folder


def test_chat_max_tokens_that_leave_no_room_for_a_prompt_stop_the_start(
    tmp_path, default_model_folder, monkeypatch, capsys
):
    """Every turn failed with "exceeds the model's context length ...; /reset starts over",
    advice that could not help: the context is too small for --max-tokens alone."""
    folder = tiny_chat_model(tmp_path, default_model_folder)
    capsys.readouterr()  # the shard writer's progress bar
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))
    argv = ["chat", "--model", str(folder), "--kv-cache-gib", "0.01", "--max-tokens", "2048"]
    result = run_main(capsys, *argv)
    assert_one_line_error(*result, r"--max-tokens 2048 leaves no room .* context of 2048 tokens")


@pytest.mark.timeout(120)
def test_ctrl_c_during_a_local_answer_stops_that_answer_and_the_chat_goes_on(
    tmp_path, default_model_folder, monkeypatch, capsys
):
    # Before, the interrupt ended the whole chat (exit 130); `chat --url` already stopped just
    # the answer. The stopped call must leave the engine too, not run on behind the next turn.
    folder = tiny_chat_model(tmp_path, default_model_folder)
    aborted, answered = [], []
    abort, stream_reply = AsyncEngine.abort, cli.stream_reply
    monkeypatch.setattr(
        AsyncEngine, "abort", lambda self, id_: aborted.append(id_) or abort(self, id_)
    )

    async def answer(*args):
        answered.append(await stream_reply(*args))
        return answered[-1]

    monkeypatch.setattr(cli, "stream_reply", answer)
    stdout = _InterruptOnce()
    monkeypatch.setattr(sys, "stdin", io.StringIO("one\ntwo\n"))
    monkeypatch.setattr(sys, "stdout", stdout)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # asyncio's runner's
    try:
        argv = ["chat", "--model", str(folder), "--kv-cache-gib", "0.01", "--max-tokens", "400"]
        code = cli.main([*argv, "--temperature", "0"])
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    assert code == 1, err  # stdin is no terminal: the interrupted turn's answer is missing
    assert "yaied: (answer interrupted)" in err
    assert len(answered) == 1 and answered[0].num_tokens > 0  # the second turn answered
    assert len(aborted) == 1  # the cut answer's call, as it was cut


# -- the docs -------------------------------------------------------------------------------

README = Path(__file__).resolve().parent.parent / "README.md"
# Flags the README gives to other programs: scripts/ (checked below), lm_eval, pip, ray,
# systemctl and systemd-analyze, SGLang, Claude Code.
OTHER_PROGRAMS_FLAGS = {
    "--max-turns",
    "--tools",
    "--tasks",
    "--include_path",
    "--model_args",
    "--apply_chat_template",
    "--no-deps",
    "--head",
    "--address",
    "--resources",
    "--now",
    "--offline",
    "--enable-deterministic-inference",
}


def subcommand_flags(name: str) -> dict[str, argparse.Action]:
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {
        flag: action
        for action in commands.choices[name]._actions
        for flag in action.option_strings
        if flag.startswith("--") and flag != "--help"
    }


def test_readme_names_every_flag_that_is_not_a_setting():
    # The generated setting flags are documented as a family ("Every setting of [model] ..."),
    # the others one by one: a new flag must reach the README too.
    text = README.read_text()
    generated = {spec.flag for spec in cli.setting_flags()}
    generated |= {"--no-" + f.removeprefix("--") for f in generated}
    for command in ("serve", "chat"):
        for flag in set(subcommand_flags(command)) - generated:
            assert re.search(
                rf"`[^`]*{re.escape(flag)}\b[^`]*`|^yaied.*{re.escape(flag)}\b", text, re.M
            ), f"README does not name `yaied {command} {flag}`"


def test_every_flag_the_readme_names_exists():
    text = README.read_text()
    ours = {"--help"} | set(subcommand_flags("serve")) | set(subcommand_flags("chat"))
    scripts = "\n".join(
        p.read_text(errors="replace") for p in (README.parent / "scripts").iterdir() if p.is_file()
    )
    for flag in set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", text)):
        known = flag in ours or flag in OTHER_PROGRAMS_FLAGS or f'"{flag}"' in scripts
        assert known, f"README names {flag}, which neither yaied nor scripts/ take"


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_every_flag_has_help_that_gives_its_default(command):
    for flag, action in subcommand_flags(command).items():
        assert action.help, f"yaied {command} {flag} has no help"
        default = action.default
        if isinstance(default, int | float) and not isinstance(default, bool):
            assert str(default) in action.help, f"yaied {command} {flag}: default {default}"


def test_readme_names_every_environment_variable_yaied_reads():
    # YAIED_<SECTION>_<KEY> are the config's (config/yaied.toml lists them); any other YAIED_*
    # variable the package or the scripts read must be in the README.
    root = README.parent
    sources = [p for p in (root / "yaied").rglob("*.py")]
    sources += [p for p in (root / "scripts").iterdir() if p.is_file()]
    # os.environ.get("YAIED_X"), os.getenv("YAIED_X"), a constant ENV = "YAIED_X", shell's $YAIED_X
    read = re.compile(
        r"""environ(?:\.get)?[(\[]\s*["'](YAIED_\w+)|getenv\(\s*["'](YAIED_\w+)"""
        r"""|^[A-Z_]+\s*=\s*["'](YAIED_\w+)["']|\$\{?(YAIED_\w+)""",
        re.M,
    )
    names = {
        n
        for p in sources
        for m in read.finditer(p.read_text(errors="replace"))
        for n in m.groups()
        if n
    }
    text = README.read_text()
    assert names, "no environment variable found: the pattern is stale"
    missing = sorted(n for n in names if n not in text)
    assert not missing, f"README does not name {missing}"


def readme_commands(text: str) -> list[str]:
    """Each command of the README's sh blocks, continuation lines joined, comments cut."""
    blocks = re.findall(r"^```(?:sh|bash)\n(.*?)^```", text, re.M | re.S)
    joined = "\n".join(blocks).replace("\\\n", " ")
    return [line.split("  #")[0] for line in joined.splitlines() if line.strip()]


def test_readme_dummy_shapes_fit_the_default_kv_pool_on_cpu():
    # A random-weight shape is served at its config's whole context unless --max-model-len says
    # otherwise, and on CPU the pool is cache.kv_cache_gib: a command that does not fit stops
    # with "the KV pool holds N tokens, less than one request's context". The GPU section's
    # commands size the pool from the device's memory instead.
    import json
    import types

    import torch

    from yaied.core.config import CacheConfig
    from yaied.worker.worker import kv_bytes_per_token

    text = README.read_text()
    cpu_text = re.sub(r"^## The GPU path.*?(?=^## )", "", text, flags=re.M | re.S)
    checked = 0
    for command in readme_commands(cpu_text):
        shape_file = re.search(r"--model (config/models/\S+\.json)", command)
        if "--load-format dummy" not in command or shape_file is None:
            continue
        config = json.loads((README.parent / shape_file.group(1)).read_text())
        shape = types.SimpleNamespace(
            num_layers=config["num_hidden_layers"],
            num_kv_heads=config["num_key_value_heads"],
            head_dim=config.get("head_dim")
            or config["hidden_size"] // config["num_attention_heads"],
        )
        gib = re.search(r"--kv-cache-gib (\S+)", command)
        pool_bytes = float(gib.group(1) if gib else CacheConfig().kv_cache_gib) * 2**30
        # bf16 pools, the smallest any dtype makes: a command refused even then is wrong
        pool_tokens = pool_bytes // kv_bytes_per_token(shape, torch.bfloat16)
        length = re.search(r"--max-model-len (\d+)", command)
        context = int(length.group(1)) if length else config["max_position_embeddings"]
        assert context <= pool_tokens, f"README: `{command.strip()}` needs --max-model-len"
        checked += 1
    assert checked, "no dummy-shape command found: the pattern is stale"


def test_readme_names_every_responses_stream_event():
    # The server's event types, as literals in yaied/server; the README writes a pair as
    # `response.x.delta`/`.done` (or "`response.x.delta`, ..., then `.done`").
    sources = "\n".join(p.read_text() for p in (README.parent / "yaied" / "server").glob("*.py"))
    emitted = set(re.findall(r'"(response\.[a-z_]+\.[a-z_.]+)"', sources))
    named, last = set(), ""
    for span in re.findall(r"`([^`\n]+)`", README.read_text()):
        if span.startswith("response."):
            named.add(last := span)
        elif re.fullmatch(r"\.[a-z_]+", span) and last:
            named.add(last.rsplit(".", 1)[0] + span)
    assert emitted, "no event type found: the pattern is stale"
    missing = sorted(emitted - named)
    assert not missing, f"README's Responses stream does not name {missing}"


def test_architecture_names_only_code_that_exists():
    # docs/architecture.md names files and functions at each step of a token's path; each name
    # in backticks that looks like code (snake_case, CamelCase, a.b) must still be in the code.
    # Spans with a placeholder (`fc_<response>_<n>`) or a glob (`test_x*.py`) are patterns.
    root = README.parent
    text = (root / "docs" / "architecture.md").read_text()
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    paths = [*root.joinpath("yaied").rglob("*"), *root.joinpath("scripts").iterdir()]
    paths += [*root.joinpath("tests").rglob("*.py"), root / "pyproject.toml"]
    code = "\n".join(
        p.read_text(errors="replace")
        for p in paths
        if p.is_file() and p.suffix in ("", ".py", ".c", ".h", ".sh", ".toml")
    )
    words = set(re.findall(r"\w+", code))
    missing = set()
    for span in re.findall(r"`([^`]+)`", text):
        if "<" in span or "*" in span:
            continue
        for name in re.findall(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*", span):
            if not ("_" in name or "." in name or re.match(r"[A-Z][a-z]+[A-Z]", name)):
                continue
            parts = name.split(".")
            if parts[-1] in ("py", "c", "h", "md", "toml", "json"):
                continue
            missing |= {p for p in parts if len(p) > 2 and p not in words}
    assert not missing, f"docs/architecture.md names {sorted(missing)}, which the code lacks"
