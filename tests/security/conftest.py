"""Security tests: one module per promise of docs/security.md. Those that need the real server use the
session's shared `server` fixture (tests/conftest.py) and mark themselves `integration`."""
