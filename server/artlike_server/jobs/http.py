"""The jobs routers' JSON out (orjson); bodies come in through `artlike_server.http_body`."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import Response


def json_response(body: Any) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")
