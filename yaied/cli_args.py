"""Command-line settings: one flag per config setting, and the errors the CLI reports.

Every config setting gets a flag generated from the dataclasses in ``yaied.core.config``
(``--page-size``, ``--enable-prefix-caching/--no-enable-prefix-caching``), so a new setting is a
new flag with no edit here. Only the flags a user gave become overrides: an unset flag must not
mask the TOML file or a ``YAIED_*`` variable.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, get_type_hints

from yaied.core.config import SECTIONS, EngineConfig, load_config
from yaied.core.request import SamplingParams

# A config flag's namespace attribute is this prefix and the dotted setting: "cfg:cache.page_size".
_SETTING_PREFIX = "cfg:"


PROG = "yaied"


def one_line(exc: BaseException) -> str:
    """An error as the CLI prints it: one line."""
    return " ".join(str(exc).split()) or type(exc).__name__


class UsageError(Exception):
    """Something the user can fix (a flag, a config value, the model): one line, exit code 2."""


class GenerationError(Exception):
    """The engine failed while generating: one line, exit code 1."""


class Parser(argparse.ArgumentParser):
    # argparse prints the usage and exits; we want one line and an exit code from main().
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


@dataclass(frozen=True, slots=True)
class SettingFlag:
    setting: str  # "cache.page_size"
    flag: str  # "--page-size"
    kind: type  # the dataclass field's type: int, float, str or bool
    default: Any
    help: str  # the field's metadata["help"], where config.py gives one


# Keys of [router] with a flag of their own (--router-policy): an engine setting of the same name
# must not take the bare flag, or `--policy` would silently mean the scheduler's.
ROUTER_KEYS = ("policy",)


def setting_flags() -> list[SettingFlag]:
    """One flag per config setting; a key shared by two sections gets its section as a prefix."""
    counts = Counter(f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls))
    counts.update(ROUTER_KEYS)  # the router's [router] flags are written by hand in cli.py
    flags = []
    for section, cls in SECTIONS.items():
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            stem = f.name if counts[f.name] == 1 else f"{section}_{f.name}"
            flag = "--" + stem.replace("_", "-")
            setting = f"{section}.{f.name}"
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            help_text = f.metadata.get("help", "")
            flags.append(SettingFlag(setting, flag, hints[f.name], default, help_text))
    return flags


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    groups = {s: parser.add_argument_group(f"[{s}] settings") for s in SECTIONS}
    for spec in setting_flags():
        section = spec.setting.split(".", 1)[0]
        common = dict(dest=_SETTING_PREFIX + spec.setting, default=argparse.SUPPRESS)
        help_text = f"{spec.help} [{spec.setting}, default {spec.default!r}]".lstrip()
        if spec.kind is bool:
            action = argparse.BooleanOptionalAction
            groups[section].add_argument(spec.flag, action=action, help=help_text, **common)
        else:
            metavar = spec.kind.__name__.upper()
            groups[section].add_argument(
                spec.flag, type=spec.kind, metavar=metavar, help=help_text, **common
            )


def is_utf8(text: str) -> bool:
    """False for text that came from bytes that are not UTF-8 (argv, stdin): Python hands those
    over as lone surrogates, which the tokenizer and the JSON encoder refuse much later."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def utf8_text(text: str) -> str:
    """An argument that is text for the model or the API (not a path, which may be any bytes)."""
    if not is_utf8(text):
        raise argparse.ArgumentTypeError("not valid UTF-8 (check the terminal's encoding)")
    return text


def not_empty(hint: str) -> Callable[[str], str]:
    """A flag whose empty value (an unset shell variable) would mean its default without a word:
    --api-key-file "" ran the daemon with no key file, so perhaps with no auth at all."""

    def check(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"must not be empty ({hint})")
        return text

    return check


def served_name(text: str) -> str:
    """--served-model-name: "" would fall back to --model without a word (the config's default
    means "the model's own name"), and blanks name nothing a client could type."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty (leave it out to serve as --model)")
    return utf8_text(text)


def http_url(text: str) -> str:
    """--url: an http(s) address with a host. "localhost:8000" or "127.0.0.1" failed at the first
    request as httpx's "unsupported protocol 'localhost://'", naming no flag."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text.strip())
    except ValueError:  # "http://[::1": left to the client, which names what is wrong
        return text
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(
            f"expected an http:// or https:// URL such as http://127.0.0.1:8000, got {text!r}"
        )
    return text


def port_number(text: str) -> int:
    port = int(text) if text.strip().isdigit() else 0
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"port must be an integer in 1..65535, got {text!r}")
    return port


def check_sampling(sampling: dict[str, Any]) -> None:
    """Before the model loads: a bad --temperature should not cost a load."""
    SamplingParams.from_kwargs(**sampling)


def check_room(max_tokens: int, context: int) -> None:
    """A chat's --max-tokens that leaves no room for any prompt in the context: every turn failed
    with "/reset starts over", which could not help."""
    if max_tokens >= context:
        raise UsageError(
            f"--max-tokens {max_tokens} leaves no room for a prompt in the model's context of "
            f"{context} tokens; lower it"
        )


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the user gave as flags, as ``load_config`` overrides."""
    return {
        key.removeprefix(_SETTING_PREFIX): value
        for key, value in vars(args).items()
        if key.startswith(_SETTING_PREFIX)
    }


def load_cli_config(args: argparse.Namespace) -> EngineConfig:
    try:
        return load_config(args.config, overrides=config_overrides(args))
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{args.config}: {exc}") from exc
    except OSError as exc:
        raise UsageError(f"cannot read {exc.filename or args.config}: {exc.strerror}") from exc
    except TypeError as exc:  # a TOML value of the wrong type fails a comparison in validation
        raise UsageError(f"bad config value: {exc}") from exc
