"""What the server's child processes inherit: its environment without the server's secrets.

The engine, the trainer worker, torchrun and the dtype probe run other people's code (vLLM, torch, a
model's remote code) and write their environment into logs and crash reports; none of them needs the API
key that guards this server or the keys of remote engines. `artlike serve` drops them from its own
environment once it has read them (`drop_secrets`), and each launcher builds its child's environment
through `without_secrets` as well.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping

__all__ = ["SECRET_VARIABLES", "drop_secrets", "without_secrets"]

SECRET_VARIABLES = frozenset({"ARTLIKE_API_KEY", "ARTLIKE_ENGINE_KEY", "ARTLIKE_ENGINE_API_KEY"})
"""Read by `artlike serve` only (the engine gets its own key as VLLM_API_KEY)."""

_MIN_SEARCHED = 8  # a shorter secret is matched as a whole value only: "ab" would match half of PATH


def _holds_secret(value: str, secrets: Iterable[str]) -> bool:
    return any(value == s or (len(s) >= _MIN_SEARCHED and s in value) for s in secrets if s)


def without_secrets(env: Mapping[str, str], secrets: Iterable[str] = ()) -> dict[str, str]:
    """A copy of `env` without `SECRET_VARIABLES` and without any variable whose value holds one of `secrets`."""
    kept = tuple(secrets)
    return {name: value for name, value in env.items()
            if name not in SECRET_VARIABLES and not _holds_secret(value, kept)}


def drop_secrets(environ: MutableMapping[str, str], secrets: Iterable[str] = ()) -> list[str]:
    """Remove from `environ` (in place) what `without_secrets` leaves out; the names removed, sorted."""
    kept = without_secrets(environ, secrets)
    dropped = sorted(set(environ) - set(kept))
    for name in dropped:
        del environ[name]
    return dropped
