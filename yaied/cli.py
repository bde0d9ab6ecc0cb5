"""`yaied serve | chat`: argument parsing and wiring; the engine does the work.

Config flags and the errors users see live in ``yaied.cli_args``.

Errors a user can fix (a bad flag, config value or model) print one line and exit 2, which
systemd/yaied.service does not retry; a failure a later start may not meet (an engine that died,
a port still held, a Ray cluster not answering: UnavailableError) exits 1. Ctrl-C exits 130
without a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from yaied.cli_args import (  # noqa: F401  (setting_flags: re-exported for callers)
    PROG,
    GenerationError,
    Parser,
    UsageError,
    add_setting_flags,
    check_room,
    check_sampling,
    config_overrides,
    http_url,
    load_cli_config,
    not_empty,
    one_line,
    port_number,
    served_name,
    setting_flags,
    utf8_text,
)
from yaied.cli_chat import chat_loop, remote_responder
from yaied.core.config import EngineConfig
from yaied.core.errors import EngineStartError, UnavailableError
from yaied.server.config import REASONING_PARSERS, TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from yaied.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)

EXIT_USAGE = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a tool killed by the signal reports


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    common.add_argument("--config", metavar="PATH", help="a TOML file (see config/yaied.toml)")
    common.add_argument(
        "--log-level",
        default=None,
        choices=("debug", "info", "warning", "error"),
        help="default: info for the daemon (a line per request), warning otherwise",
    )
    add_setting_flags(common)

    parser = Parser(prog=PROG, description="yaied: an LLM serving engine.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,chat}")
    serve = commands.add_parser(
        "serve",
        parents=[common],
        help="serve the OpenAI-compatible HTTP API (or answer one --prompt)",
        description="Serve the model over the OpenAI-compatible HTTP API on --host:--port (the "
        "daemon listens at once; /health answers 503 until the model has loaded). With --prompt, "
        "answer that one prompt on the terminal instead and exit.",
    )
    serve.add_argument(
        "--prompt", type=utf8_text, default=None, help="answer this one prompt and exit"
    )
    serve.add_argument(
        "--max-tokens", type=int, default=64, metavar="N", help="with --prompt (default 64)"
    )
    serve.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=port_number, default=None, help="listen port (default 8000)")
    serve.add_argument(
        "--served-model-name", type=served_name, default=None, help="the name in /v1/models"
    )
    serve.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="accept this Bearer key (repeatable; YAIED_SERVER_API_KEYS takes a comma list)",
    )
    serve.add_argument(
        "--api-key-file",
        type=not_empty("leave it out to run without a key file"),
        metavar="PATH",
        help="accept the keys in this file too: one a line; blank lines and # comments skipped",
    )
    serve.add_argument(
        "--chat-template",
        type=not_empty("leave it out for the tokenizer's template"),
        metavar="PATH_OR_TEXT",
        help="a Jinja chat template used instead of the tokenizer's: a file, else the text itself",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        help="the model's tool-call markup (default: the chat template's, else hermes) "
        "[server.tool_call_parser]",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="<think> blocks go to reasoning_content [server.reasoning_parser]",
    )
    serve.add_argument(
        "--engines",
        type=int,
        metavar="N",
        help="run N local engine processes behind the router: one per GPU, or CPU processes "
        "sharing the cores (default 1: one engine in the daemon's process) [router.engines]",
    )
    serve.add_argument(
        "--router-policy",
        choices=("autellix", "round_robin", "least_loaded"),
        help="how calls are spread over engines [router.policy, default autellix]",
    )
    serve.add_argument(
        "--ray-address",
        metavar="auto|HOST:PORT",
        help='the Ray cluster that kind = "ray" engines join (default: a Ray instance started '
        "here, sized to this machine) [router.ray_address]",
    )
    serve.set_defaults(run=_serve)

    chat = commands.add_parser(
        "chat",
        parents=[common],
        help="chat with the model on the terminal",
        description="Chat through the model's chat template. Commands: /reset clears the "
        "history; /exit, /quit or end of input (Ctrl-D) ends.",
    )
    chat.add_argument(
        "--system", type=utf8_text, metavar="TEXT", help="a system message opening the chat"
    )
    chat.add_argument("--temperature", type=float, default=0.7, metavar="T", help="default 0.7")
    chat.add_argument("--top-p", type=float, default=None, help="default: the model's own")
    chat.add_argument("--max-tokens", type=int, default=256, metavar="N", help="default 256")
    chat.add_argument(
        "--url",
        type=http_url,
        metavar="URL",
        help="chat with the daemon at URL (http://127.0.0.1:8000) instead of a local engine; "
        "--model then names the served model (default: the first in /v1/models)",
    )
    chat.add_argument(
        "--api-key",
        default=os.environ.get("YAIED_API_KEY"),
        metavar="KEY",
        help="with --url: the Bearer key (default: $YAIED_API_KEY)",
    )
    chat.set_defaults(run=_chat)
    return parser


# -- running the engine ---------------------------------------------------------------------


Session = Callable[["AsyncEngine", asyncio.Runner], int]


def _with_engine(config: EngineConfig, session: Session) -> int:
    """Build the engine and run ``session`` with one event loop, shutting the engine down after.

    asyncio.Runner is asyncio.run split open: one loop across several ``run`` calls, so `chat` reads
    stdin between turns outside the loop, where Ctrl-C interrupts at once instead of only cancelling
    the main task.
    """
    from yaied.engine.async_engine import AsyncEngine  # torch loads only for a command that runs

    with asyncio.Runner() as runner:
        # Progress bars only for a person watching; in a log they are noise.
        engine = AsyncEngine(config, show_progress=sys.stderr.isatty())
        try:
            return session(engine, runner)
        finally:
            runner.run(engine.shutdown())


@dataclass(slots=True)
class Reply:
    text: str
    num_tokens: int


async def stream_reply(
    engine: AsyncEngine, prompt: str | list[int], sampling: dict[str, Any]
) -> Reply:
    """Generate, writing the text to stdout as it arrives."""
    parts: list[str] = []
    num_tokens = 0
    # aclosing: a Ctrl-C (the runner cancels this task) aborts the call here and now, not when
    # the loop next runs the generator's finalizer
    async with contextlib.aclosing(engine.generate(prompt, **sampling)) as events:
        async for event in events:
            if event.error is not None:
                raise GenerationError(f"generation failed: {event.error}")
            num_tokens += len(event.token_ids)
            parts.append(event.text)
            sys.stdout.write(event.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return Reply("".join(parts), num_tokens)


def _serve(args: argparse.Namespace) -> int:
    if args.prompt is None:
        return _serve_http(args)
    return _answer_one_prompt(args)


def _serve_http(args: argparse.Namespace) -> int:
    from yaied.daemon import run_server  # the server packages load only for the daemon
    from yaied.engine.faults import EngineDeadError
    from yaied.router.capacity import check_capacity
    from yaied.router.ray_cluster import autoscale_ray, check_start
    from yaied.server.reload import config_reader
    from yaied.worker.model_files import check_model_reference
    from yaied.worker.weight_bytes import weight_estimate

    config = load_cli_config(args)
    check_model_reference(config.model.model, load_format=config.model.load_format)
    flags = {
        "host": args.host,
        "port": args.port,
        "served_model_name": args.served_model_name,
        "api_keys": tuple(args.api_key) if args.api_key else None,
        "api_key_file": args.api_key_file,
        "chat_template": args.chat_template,
        "tool_call_parser": args.tool_call_parser,
        "reasoning_parser": args.reasoning_parser,
    }
    router_flags = {
        "engines": args.engines,
        "policy": args.router_policy,
        "ray_address": args.ray_address,
    }
    read_config = config_reader(  # again on SIGHUP
        args.config,
        {k: v for k, v in flags.items() if v is not None},
        {k: v for k, v in router_flags.items() if v is not None},
    )
    start = read_config()
    ranks = config.engine.tensor_parallel_size
    check_start(start.engines, start.router.ray_address, autoscale_ray(start.autoscale), ranks)
    # CPU engines past this machine's cores or memory: one line before any loads or the bind
    weights = weight_estimate(config.model)  # each engine's at its own ranks
    autoscale = check_capacity(config, start.router, start.engines, start.autoscale, weights)
    try:
        run_server(
            config, start.server, start.router, start.engines, read_config, autoscale, weights
        )
    except EngineDeadError as exc:
        print(f"{PROG}: error: {one_line(exc)}", file=sys.stderr)
        sys.stderr.flush()
        # The worker thread may be stuck in the step that hung: exit without waiting for it.
        os._exit(EXIT_FAILED)
    return 0


def _answer_one_prompt(args: argparse.Namespace) -> int:
    config = load_cli_config(args)
    sampling = {"max_tokens": args.max_tokens}
    check_sampling(sampling)

    def session(engine: AsyncEngine, runner: asyncio.Runner) -> int:
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise UsageError(f"model {config.model.model!r} has no tokenizer; --prompt needs one")
        prompt: str | list[int] = args.prompt
        if engine.inputs.has_chat_template():
            prompt, _ = engine.inputs.chat_prompt([{"role": "user", "content": args.prompt}])
        started = time.perf_counter()
        reply = runner.run(stream_reply(engine, prompt, sampling))
        seconds = time.perf_counter() - started
        rate = reply.num_tokens / seconds if seconds > 0 else 0.0
        print(f"{reply.num_tokens} tokens in {seconds:.2f} s ({rate:.1f} tok/s)", file=sys.stderr)
        return 0

    return _with_engine(config, session)


def _chat(args: argparse.Namespace) -> int:
    sampling: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.top_p is not None:
        sampling["top_p"] = args.top_p
    check_sampling(sampling)
    opening = [{"role": "system", "content": args.system}] if args.system else []
    if args.url is not None:
        return _chat_remote(args, sampling, opening)
    config = load_cli_config(args)

    def session(engine: AsyncEngine, runner: asyncio.Runner) -> int:
        if not engine.inputs.has_chat_template():
            raise UsageError(f"model {config.model.model!r} has no chat template; chat needs one")
        check_room(args.max_tokens, engine.info.max_model_len)

        def respond(messages: list[dict[str, str]]) -> str | None:
            prompt, _ = engine.inputs.chat_prompt(messages)
            try:
                return runner.run(stream_reply(engine, prompt, sampling)).text
            except ValueError as exc:  # the conversation outgrew the context: let the user go on
                print(f"{PROG}: {exc}; /reset starts over", file=sys.stderr)
                return None
            except KeyboardInterrupt:  # the runner cancelled the answer (its call aborted)
                print(file=sys.stdout)
                print(f"{PROG}: (answer interrupted)", file=sys.stderr)
                return None

        return chat_loop(opening, respond)

    return _with_engine(config, session)


def _chat_remote(
    args: argparse.Namespace, sampling: dict[str, Any], opening: list[dict[str, str]]
) -> int:
    """`chat --url`: the same loop against a daemon. Ctrl-C during an answer ends that answer."""
    from yaied.chat_client import ChatClient, ServerError, ServerUnreachable

    try:
        client = ChatClient(args.url, args.api_key)
    except ServerUnreachable as exc:  # a URL httpx cannot parse
        raise GenerationError(str(exc)) from None
    try:
        model = config_overrides(args).get("model.model") or client.first_model()
        return chat_loop(opening, remote_responder(client, model, sampling))
    except ServerUnreachable as exc:
        raise GenerationError(str(exc)) from None
    except ServerError as exc:  # before the first turn: /v1/models failed
        raise GenerationError(str(exc)) from None
    finally:
        client.close()


# -- entry point ----------------------------------------------------------------------------


def _silence_stdout() -> None:
    # Python flushes stdout again at exit; into a closed pipe that prints one more traceback.
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _apply_cpu_cap() -> None:
    """Checks YAIED_CPU_ISA before anything loads: a bad cap stops the start with one line (an
    IsaError is a ValueError). A cap below this CPU's level also holds torch's own kernels
    (oneDNN, ATen) to it, unless their variables are set, so that a capped run is what a CPU of
    that level does; torch reads them when it loads, which is later than this."""
    from yaied.kernels.cpu_isa import hold_torch_to_cap

    hold_torch_to_cap()


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        daemon = args.command == "serve" and args.prompt is None
        level = args.log_level or ("info" if daemon else "warning")
        logging.basicConfig(
            level=level.upper(),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        if args.command == "serve" or getattr(args, "url", None) is None:
            _apply_cpu_cap()
        return args.run(args)
    except KeyboardInterrupt:
        if sys.stderr.isatty():
            print(file=sys.stderr)  # end the ^C line
        return EXIT_INTERRUPTED
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except BrokenPipeError:  # `yaied serve | head`: the reader left; stop as quietly as it did
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except (GenerationError, EngineStartError, UnavailableError) as exc:
        print(f"{PROG}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    except (UsageError, ValueError, OSError) as exc:
        log.debug("%s failed", PROG, exc_info=True)  # the traceback, for --log-level debug
        print(f"{PROG}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
