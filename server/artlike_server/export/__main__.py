"""`python -m artlike_server.export DATA_DIR MODEL[@STEP] FORMAT OUT [--dtype D] [--quant Q] [--base-model P]`:
one export in a process of its own (the server runs merged and GGUF exports here, keeping torch out of its
own process). An API error is printed to stdout as its JSON body and the process exits with `API_ERROR_EXIT`,
so the caller raises the same error."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from ..errors import APIError
from .formats import export_request
from .run import export_step
from .service import API_ERROR_EXIT
from .source import find_step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m artlike_server.export")
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("reference")
    parser.add_argument("format")
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype")
    parser.add_argument("--quant")
    parser.add_argument("--base-model", type=Path)
    args = parser.parse_args(argv)
    try:
        request = export_request(args.format, args.dtype, args.quant)
        source = find_step(args.data_dir, args.reference, base_path=args.base_model)
        export_step(source, request, args.out)
    except APIError as error:
        sys.stdout.write(orjson.dumps({"status": error.status_code, **error.body()}).decode() + "\n")
        return API_ERROR_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
