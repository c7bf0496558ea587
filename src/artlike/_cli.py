"""The `artlike` console script. `artlike serve ...` runs the server, which is a separate install;
`artlike jobs ...` talks to a running one (`_jobs_cli.py`).

The client package must not import server code (torch, vLLM, FastAPI): the server is imported only when
`serve`, `export` or `import` is asked for.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._jobs_cli import add_parser as add_jobs_parser
from ._jobs_cli import run as run_jobs
from ._version import __version__

INSTALL_SERVER_HINT = "install the server extra: pip install 'artlike[server]' and run server/install.sh"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="artlike",
        description="artlike: an OpenAI-compatible server that trains the model behind it with GRPO.",
    )
    parser.add_argument("--version", action="version", version=f"artlike {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands.add_parser("serve", help="serve a model and train it (needs the server extra)", add_help=False)
    commands.add_parser("export", help="export a trained step as PEFT, merged weights or GGUF (needs the server "
                        "extra)", add_help=False)
    commands.add_parser("import", help="import a PEFT LoRA adapter trained elsewhere as a step of a model "
                        "(needs the server extra)", add_help=False)
    add_jobs_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    # `serve`, `export` and `import` own everything after them (their own --help included); parse only what
    # comes before.
    handed_over = [index for index, argument in enumerate(arguments) if argument in ("serve", "export", "import")]
    command_end = handed_over[0] + 1 if handed_over else len(arguments)
    parsed = _parser().parse_args(arguments[:command_end])
    if parsed.command == "jobs":
        return run_jobs(parsed)
    try:
        from artlike_server.cli import main as serve_main
    except ModuleNotFoundError as missing:
        print(f"artlike {parsed.command}: {missing.name or 'a server module'} is not installed; {INSTALL_SERVER_HINT}", file=sys.stderr)
        return 2
    serve_main(arguments)  # the server's CLI exits by itself (typer); returning means success
    return 0


if __name__ == "__main__":
    sys.exit(main())
