"""A stand-in for the vLLM server, to test the supervisor's process handling in seconds.

    python fake_engine.py PORT CONTROL_DIR

Reads CONTROL_DIR/mode when it starts:
    ok        serve GET /health and POST /v1/completions with 200
    exit      print a complaint and exit with code 3 at once
    stubborn  like ok, but ignore SIGTERM and start a child that ignores it too (a stuck EngineCore)
    chatty    like ok, after printing 4 MB of log lines
While CONTROL_DIR/unhealthy exists, /health answers 500. Every process writes its pid to CONTROL_DIR/pids.
Like the real engine, it answers POSTs without `Authorization: Bearer $VLLM_API_KEY` with 401.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def main() -> None:
    port, control = int(sys.argv[1]), Path(sys.argv[2])
    expected_auth = f"Bearer {os.environ['VLLM_API_KEY']}"
    with (control / "pids").open("a") as pids:
        pids.write(f"{os.getpid()}\n")
    mode = (control / "mode").read_text().strip()
    print(f"fake engine: mode {mode}, port {port}", flush=True)
    if mode == "exit":
        print("fake engine: cannot load the model", flush=True)
        sys.exit(3)
    if mode == "chatty":
        for line in range(40_000):
            print(f"fake engine: log line {line:06d} " + "x" * 80, flush=line % 1000 == 0)
        sys.stdout.flush()
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        subprocess.Popen([sys.executable, "-c", STUBBORN_CHILD, str(control)])

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._answer(500 if (control / "unhealthy").exists() else 200)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self._answer(200 if self.headers.get("authorization") == expected_auth else 401)

        def _answer(self, status: int) -> None:
            body = json.dumps({"ok": status == 200}).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return  # quiet

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


STUBBORN_CHILD = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1] + "/pids", "a") as pids:
    pids.write(f"{os.getpid()}\\n")
while True:
    time.sleep(60)
"""

if __name__ == "__main__":
    main()
