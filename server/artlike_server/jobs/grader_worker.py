"""One grader worker process: `artlike.graders.run_leaf` calls, a JSON line in and a JSON line out.

It runs our own grader code (not user code) on untrusted text, so it needs no sandbox; what bounds it is the
parent (grader_pool.py), which kills it when a call runs past its time limit, and the address-space limit set
here, which turns a runaway table into a MemoryError instead of the machine's memory.

    argv[1]: JSON {"memory_bytes": int}
    first line out: {"ok": true} once the metric packages are imported
    each line in: {"function": str, "args": [str, ...]}
    each line out: {"ok": true, "value": ...} | {"ok": false, "error": exception type, "message": str}
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import resource
import sys
from typing import IO, Any

PRELOADED = ("rouge_score.rouge_scorer", "sacrebleu", "rapidfuzz.fuzz", "math_verify")


def _reply_channel() -> IO[str]:
    """The protocol's own copy of stdout; fd 1 then points at stderr, so a library's print cannot corrupt it."""
    channel = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    return channel


def _answer(channel: IO[str], reply: dict[str, Any]) -> None:
    channel.write(json.dumps(reply) + "\n")


def main() -> None:
    config = json.loads(sys.argv[1])
    memory = int(config["memory_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    channel = _reply_channel()
    from artlike.graders import run_leaf

    for module in PRELOADED:  # a missing one is reported by the grader that needs it
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    _answer(channel, {"ok": True})
    for line in sys.stdin:
        try:
            request = json.loads(line)
            # math-verify's SIGALRM limit is off: the parent's kill bounds the whole call, C code included.
            value = run_leaf(request["function"], request["args"], alarm_timeout_s=None)
        except Exception as error:  # MemoryError included: reported, and the parent replaces this worker
            _answer(channel, {"ok": False, "error": type(error).__name__, "message": str(error)[:2000]})
            continue
        _answer(channel, {"ok": True, "value": value})


if __name__ == "__main__":
    main()
