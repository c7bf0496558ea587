"""Every `artlike` option and every HTTP route a doc names exists in the real CLI and the real app.

Options: each `artlike serve ...` / `artlike export ...` / `artlike import ...` / `artlike jobs ACTION ...`
command line, in prose or in a code block (continuation lines joined), up to a comment or the end of the command. Routes: each `METHOD /path` (with
that method) and each path after the server's URL (`$ARTLIKE_SERVER/...`, `http://127.0.0.1:8000/...`,
`{server}/...`; a base URL such as `{server}/t/{id}/v1` may be a prefix of routes). A concrete segment
(`mail-agent`) matches a path parameter; `[/{id}]` stands for both paths.
"""

from __future__ import annotations

import argparse
import re
from functools import cache
from pathlib import Path

import pytest
import typer
from artlike_server import cli as server_cli
from artlike_server.app import create_app
from starlette.routing import Route

from artlike import _cli
from tests.docs.doc_files import doc_files, relative
from tests.unit.fake_services import fake_services

COMMAND = re.compile(r"\bartlike (serve|export|import|jobs(?: (?:start|list|show|logs|cancel))?)\b([^`;|&)\n]*)")
FLAG = re.compile(r"--?[A-Za-z][\w-]*")
METHOD_ROUTE = re.compile(r"\b(GET|POST|PUT|PATCH|DELETE)\s+(/[^\s`|,;)\"']*)")
# The engine's (vLLM's) own routes, which docs/scale-out.md asks of a remote engine.
ENGINE_ROUTES = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
SERVER_URL_PATH = re.compile(
    r"(?:\$\{?ARTLIKE_SERVER\}?|https?://(?:127\.0\.0\.1|localhost):8000|\{server\})(/[^\s`|,;)\"'>]*)")


def doc_lines(path: Path) -> list[str]:
    """The page's lines, a shell command continued with `\\` joined into one."""
    return path.read_text(encoding="utf-8").replace("\\\n", " ").splitlines()


# ------------------------------------------------------------------ options


@cache
def options() -> dict[str, frozenset[str]]:
    server_commands = typer.main.get_command(server_cli.app).commands  # type: ignore[attr-defined]
    known = {name: frozenset(opt for param in server_commands[name].params
                             for opt in (*param.opts, *param.secondary_opts)) | {"--help"}
             for name in ("serve", "export", "import")}
    root = _cli._parser()
    commands = next(action for action in root._actions if isinstance(action, argparse._SubParsersAction))
    jobs = commands.choices["jobs"]
    jobs_options = {opt for action in jobs._actions for opt in action.option_strings}
    known["jobs"] = frozenset(jobs_options)
    actions = next(action for action in jobs._actions if isinstance(action, argparse._SubParsersAction))
    for name, parser in actions.choices.items():
        known[f"jobs {name}"] = frozenset(jobs_options | {opt for action in parser._actions
                                                          for opt in action.option_strings})
    return known


def named_options(line: str) -> list[tuple[str, str]]:
    found = []
    for command in COMMAND.finditer(line):
        arguments = command.group(2).split(" #", 1)[0].split()
        found += [(command.group(1), token.split("=", 1)[0]) for token in arguments if FLAG.fullmatch(token.split("=", 1)[0])]
    return found


def unknown_options(path: Path) -> list[str]:
    return [f"{relative(path)}:{number}: artlike {command} {flag}"
            for number, line in enumerate(doc_lines(path), start=1)
            for command, flag in named_options(line) if flag not in options()[command]]


@pytest.mark.parametrize("path", doc_files(), ids=relative)
def test_named_options_exist(path: Path) -> None:
    assert unknown_options(path) == []


def test_options_are_found() -> None:
    assert named_options("run `artlike serve --engines 2 --engine-arg=--x --engine-arg=2` # --not-this") == [
        ("serve", "--engines"), ("serve", "--engine-arg"), ("serve", "--engine-arg")]
    assert named_options("artlike jobs start --data rows.jsonl -f   # --iterations") == [
        ("jobs start", "--data"), ("jobs start", "-f")]
    assert "--data" in options()["jobs start"] and "--api-key-file" in options()["serve"]


# ------------------------------------------------------------------ routes


@cache
def routes() -> list[tuple[list[str], frozenset[str]]]:
    app = create_app(fake_services())
    return [(route.path.split("/"), frozenset(route.methods or ())) for route in app.routes
            if isinstance(route, Route)]


def segments_match(named: list[str], template: list[str]) -> bool:
    return len(named) == len(template) and all(
        part == wanted or (wanted.startswith("{") and part != "") for part, wanted in zip(named, template, strict=True))


def variants(path: str) -> list[str]:
    """`/v1/jobs[/{id}]` names `/v1/jobs` and `/v1/jobs/{id}`; a query string or a trailing `.` is no path."""
    path = re.split(r"[?#]", path, maxsplit=1)[0].rstrip(".:")
    optional = re.search(r"\[([^\[\]]*)\]", path)
    if optional is None:
        return [path]
    without, with_it = path[:optional.start()] + path[optional.end():], path.replace(optional.group(0), optional.group(1), 1)
    return list(dict.fromkeys([*variants(without), *variants(with_it)]))


def route_exists(path: str, method: str | None) -> bool:
    """With a method, a route of that method; without, any route or the prefix of one (a base URL)."""
    named = path.rstrip("/").split("/")
    if method is None:
        return any(segments_match(named, template[:len(named)]) for template, _ in routes())
    return any(method in methods and segments_match(named, template) for template, methods in routes())


def named_routes(line: str) -> list[tuple[str | None, str]]:
    found: list[tuple[str | None, str]] = [(method, path) for method, path in METHOD_ROUTE.findall(line)]
    found += [(None, path) for path in SERVER_URL_PATH.findall(line)]
    return [(method, variant) for method, path in found for variant in variants(path)
            if "..." not in variant and "…" not in variant]


def unknown_routes(path: Path) -> list[str]:
    return [f"{relative(path)}:{number}: {method or 'URL'} {route}"
            for number, line in enumerate(doc_lines(path), start=1)
            for method, route in named_routes(line) if not route_exists(route, method) and route not in ENGINE_ROUTES]


@pytest.mark.parametrize("path", doc_files(), ids=relative)
def test_named_routes_exist(path: Path) -> None:
    assert unknown_routes(path) == []


def test_routes_are_found_and_matched() -> None:
    assert named_routes("`GET /v1/fine_tuning/jobs[/{id}]` and curl $ARTLIKE_SERVER/v1/ratings?x=1") == [
        ("GET", "/v1/fine_tuning/jobs"), ("GET", "/v1/fine_tuning/jobs/{id}"), (None, "/v1/ratings")]
    assert route_exists("/v1/trainable_models/mail-agent/continual", "PATCH")
    assert route_exists("/t/{id}/v1", None)
    assert not route_exists("/v1/trainable_models/mail-agent/continual", "POST")
    assert not route_exists("/v1/no_such_route", None)
