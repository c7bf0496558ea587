"""The `serve` command's options, derived from the settings' fields (settings.py): one flag per field, with
the field's default, its description as the help, its `ge`/`gt` bound as the option's minimum, and its
environment variable.

Types the command line spells differently: a tuple of strings is a repeatable option; a tuple of ints (a
core or GPU list) is given as a string such as "0-3,6" and parsed by the command.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Union, get_args, get_origin

import annotated_types
import typer
from pydantic.fields import FieldInfo

from .settings import SECTIONS


@dataclass(frozen=True)
class SettingsFlag:
    section: str  # the settings section the value goes to (a field of ServerSettings)
    field: str  # the field in that section
    param: str  # the command's parameter name
    decl: str  # the option as typed: --engine-port
    info: FieldInfo

    @property
    def cli_default(self) -> Any:
        """The option's default as the command line holds it (no repeatable value: None)."""
        default = self.info.default
        return None if isinstance(default, tuple) else default


def settings_flags() -> list[SettingsFlag]:
    """Every settings field an operator gives, in section order."""
    flags: list[SettingsFlag] = []
    for section, model in SECTIONS.items():
        for name, info in model.model_fields.items():
            extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
            if not extra.get("cli", True):
                continue
            decl = str(extra.get("flag") or "--" + name.replace("_", "-"))
            flags.append(SettingsFlag(section, name, decl.removeprefix("--").replace("-", "_"), decl, info))
    params = [flag.param for flag in flags]
    duplicates = {param for param in params if params.count(param) > 1}
    if duplicates:
        raise RuntimeError(f"settings fields share a command-line option: {sorted(duplicates)}")
    return flags


def cli_type(annotation: Any) -> Any:
    """The type typer parses the option as (see the module docstring)."""
    options = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    for option in options:
        if get_origin(option) is tuple:
            return list[str] | None if get_args(option)[0] is str else str | None
    return annotation


def _minimum(info: FieldInfo) -> float | None:
    for bound in info.metadata:
        if isinstance(bound, annotated_types.Ge):
            return bound.ge  # type: ignore[return-value]
        if isinstance(bound, annotated_types.Gt):
            return bound.gt  # type: ignore[return-value]  # typer has no open bound: the settings check it
    return None


def option_parameter(flag: SettingsFlag) -> inspect.Parameter:
    extra = flag.info.json_schema_extra if isinstance(flag.info.json_schema_extra, dict) else {}
    explicit = (flag.decl,) if "flag" in extra else ()
    envvar = extra.get("envvar")
    option = typer.Option(*explicit, help=flag.info.description, envvar=str(envvar) if envvar else None,
                          min=_minimum(flag.info))
    return inspect.Parameter(flag.param, inspect.Parameter.KEYWORD_ONLY, default=flag.cli_default,
                             annotation=Annotated[cli_type(flag.info.annotation), option])


def with_options(command: Callable[..., Any], *, before: Callable[..., Any], after: Callable[..., Any]) -> None:
    """Give `command` (which takes **options) the parameters of `before`, then one per settings flag, then
    those of `after`: what typer reads to build the command's options."""
    own = [*inspect.signature(before, eval_str=True).parameters.values()]
    tail = [*inspect.signature(after, eval_str=True).parameters.values()]
    parameters = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                  for p in (*own, *(option_parameter(f) for f in settings_flags()), *tail)]
    command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
