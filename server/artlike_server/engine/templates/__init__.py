"""Chat templates shipped with artlike, selectable by name (`--chat-template tool-chatml`).

`tool-chatml` (chatml_tools.jinja): ChatML with Hermes-style tool calls for ChatML models whose own
template has no tool support, such as SmolLM2. Serve it with vLLM's `hermes` tool-call parser. Without
tools it renders exactly like SmolLM2-Instruct's template (including its default system prompt).
"""

from __future__ import annotations

from pathlib import Path

TEMPLATES_DIR = Path(__file__).resolve().parent
BUILTIN_CHAT_TEMPLATES: dict[str, str] = {"tool-chatml": "chatml_tools.jinja"}


def builtin_chat_template(name: str) -> Path:
    """The file of the built-in chat template `name` (KeyError names the known ones)."""
    try:
        return TEMPLATES_DIR / BUILTIN_CHAT_TEMPLATES[name]
    except KeyError:
        raise KeyError(
            f"no built-in chat template {name!r}; known: {', '.join(BUILTIN_CHAT_TEMPLATES)}"
        ) from None


def resolve_chat_template(value: str) -> str:
    """A built-in template name becomes its file path; anything else (a path, a template) passes through."""
    return str(builtin_chat_template(value)) if value in BUILTIN_CHAT_TEMPLATES else value
