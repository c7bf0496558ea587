"""The engine layer's error hierarchy (the rest of the server maps these to HTTP answers).

    EngineError                   anything the engine layer raises on purpose
    ├── EngineRequestError        (client.py) the engine answered a non-2xx status to an admin call
    ├── EngineConnectionError     (upstream.py) a forwarded completion could not reach the engine, or broke off
    └── EngineStartError          (supervisor.py) the engine exited or was not ready in time (.log_tail)
"""


class EngineError(Exception):
    """Base class of errors raised by the engine layer."""
