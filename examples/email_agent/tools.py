"""The agent's three tools over one inbox of the SQLite database: search, read, answer.

    tools = EmailTools(db_path, inbox="nora.costa@tidewaterlog.com")
    result = tools.dispatch("search_inbox", '{"keywords": "Orion kickoff"}')   # what the model called
    result.content      # the text the model sees next (a JSON list of hits, or "Error: ...")

`dispatch` never raises on anything the model sent (unknown tool, invalid JSON, bad or extra arguments,
FTS5-hostile keywords): it returns a `ToolResult` with `ok=False` and an error message for the model.
Programming errors (a broken database, a bug here) still raise.

Search semantics: keywords are reduced to plain words (so quotes, parentheses and FTS5 operators in the
model's text are harmless), stop words dropped, each word quoted; all words must match (AND), and if
nothing does, any word may (OR), ranked by BM25 with the subject weighted 4× the body. `from_addr` and
`to_addr` match any part of an address ("omar", "Omar Haddad" and "omar.haddad@x.com" all work; `to_addr`
also matches Cc). `sent_after` is inclusive and `sent_before` exclusive, both `YYYY-MM-DD`.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

DEFAULT_SEARCH_RESULTS = 5
MAX_SEARCH_RESULTS = 10
SNIPPET_TOKENS = 12
MAX_BODY_CHARS = 1200
MAX_KEYWORDS = 12

_WORD = re.compile(r"\w+")
_STOP_WORDS = frozenset(
    ["a", "an", "and", "are", "at", "be", "by", "did", "do", "does", "for", "from", "has", "have", "i", "in", "is", "it", "me", "my", "of", "on", "or", "our", "the", "to", "was", "we", "what", "when", "where", "which", "who", "why", "with", "you", "your", "not", "near"]
)


class ToolArgumentError(ValueError):
    """The model called a tool with arguments that cannot be used; the message goes back to the model."""


# ------------------------------------------------------------------------------------------ arguments


class _Arguments(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)


class SearchInboxArgs(_Arguments):
    keywords: list[str] = Field(min_length=1)
    from_addr: str | None = None
    to_addr: str | None = None
    sent_after: date | None = None
    sent_before: date | None = None
    max_results: int = Field(DEFAULT_SEARCH_RESULTS, ge=1)

    @field_validator("keywords", mode="before")
    @classmethod
    def _split_string(cls, value: object) -> object:
        # The spec asks for a string; a list of words is accepted too.
        return value.split() if isinstance(value, str) else value

    @field_validator("max_results")
    @classmethod
    def _cap(cls, value: int) -> int:
        return min(value, MAX_SEARCH_RESULTS)


class ReadEmailArgs(_Arguments):
    message_id: str = Field(min_length=1)

    @field_validator("message_id")
    @classmethod
    def _strip_brackets(cls, value: str) -> str:
        return value.strip("<> ")


class ReturnFinalAnswerArgs(_Arguments):
    answer: str = Field(min_length=1, max_length=500)
    sources: list[str] = Field(default_factory=list, max_length=MAX_SEARCH_RESULTS)

    @field_validator("sources", mode="before")
    @classmethod
    def _one_id_is_a_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value


_ARGUMENT_MODELS: dict[str, type[_Arguments]] = {
    "search_inbox": SearchInboxArgs,
    "read_email": ReadEmailArgs,
    "return_final_answer": ReturnFinalAnswerArgs,
}

# Terse on purpose: the chat template puts these in every prompt, and small models read slowly on CPU.
TOOL_SPECS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search_inbox",
            "description": "Search emails by keywords. Returns message ids, dates, senders, subjects and snippets.",
            "parameters": {
                "type": "object",
                "properties": {
                    "keywords": {"type": "string"},
                    "from_addr": {"type": "string"},
                    "to_addr": {"type": "string"},
                    "sent_after": {"type": "string", "description": "YYYY-MM-DD"},
                    "sent_before": {"type": "string", "description": "YYYY-MM-DD"},
                    "max_results": {"type": "integer", "description": f"at most {MAX_SEARCH_RESULTS}"},
                },
                "required": ["keywords"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_email",
            "description": "Read one email.",
            "parameters": {
                "type": "object",
                "properties": {"message_id": {"type": "string"}},
                "required": ["message_id"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "return_final_answer",
            "description": "Give the answer and the message ids of the emails that state it.",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string"}, "sources": {"type": "array", "items": {"type": "string"}}},
                "required": ["answer", "sources"],
                "additionalProperties": False,
            },
        },
    },
]


# -------------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class SearchHit:
    message_id: str
    date: str  # YYYY-MM-DD
    from_addr: str
    subject: str
    snippet: str


@dataclass(frozen=True)
class EmailView:
    message_id: str
    sent_at: str
    from_addr: str
    to_addrs: str
    cc: str
    subject: str
    attachments: str
    body: str


@dataclass(frozen=True)
class FinalAnswer:
    answer: str
    sources: tuple[str, ...]


@dataclass(frozen=True)
class ToolResult:
    content: str  # what the model sees
    ok: bool
    message_ids: tuple[str, ...] = ()  # emails shown by a search, or the email read
    final_answer: FinalAnswer | None = None

    @classmethod
    def error(cls, message: str) -> ToolResult:
        return cls(content=f"Error: {message}", ok=False)


def format_search_hits(hits: list[SearchHit]) -> str:
    if not hits:
        return "No emails matched. Try fewer or different keywords."
    rows = [{"message_id": h.message_id, "date": h.date, "from": h.from_addr, "subject": h.subject,
             "snippet": h.snippet} for h in hits]
    return orjson.dumps(rows).decode()


def format_email(email: EmailView) -> str:
    headers = [f"message_id: {email.message_id}", f"date: {email.sent_at.replace('T', ' ')[:16]}",
               f"from: {email.from_addr}", f"to: {email.to_addrs}"]
    if email.cc:
        headers.append(f"cc: {email.cc}")
    headers.append(f"subject: {email.subject}")
    if email.attachments:
        headers.append(f"attachments: {email.attachments}")
    body = email.body if len(email.body) <= MAX_BODY_CHARS else email.body[:MAX_BODY_CHARS] + " [truncated]"
    return "\n".join(headers) + "\n\n" + body


def fts_queries(keywords: list[str]) -> tuple[str, str]:
    """(all-words query, any-word query) in FTS5 syntax, built from plain words only, so always valid."""
    words = [w for k in keywords for w in _WORD.findall(k)]
    content_words = [w for w in words if w.lower() not in _STOP_WORDS] or words
    unique = list(dict.fromkeys(w.lower() for w in content_words))[:MAX_KEYWORDS]
    if not unique:
        raise ToolArgumentError("keywords must contain at least one word")
    quoted = [f'"{w}"' for w in unique]  # \w+ words hold no double quote: quoting makes operators literal
    return " ".join(quoted), " OR ".join(quoted)


def _like_pattern(text: str) -> str:
    needle = "".join(text.lower().split()) if "@" in text else ".".join(text.lower().split())
    escaped = needle.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


# -------------------------------------------------------------------------------------------- tools


class EmailTools:
    """The tools of one inbox. Holds a read-only SQLite connection: close it, or use `with`."""

    def __init__(self, db_path: str | Path, inbox: str) -> None:
        path = Path(db_path)
        if not path.is_file():
            raise FileNotFoundError(f"email database not found: {path}")
        self.inbox = inbox
        self._db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False)
        self._handlers: dict[str, Callable[[Mapping[str, Any]], ToolResult]] = {
            "search_inbox": self._search_tool,
            "read_email": self._read_tool,
            "return_final_answer": self._answer_tool,
        }

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # -------------------------------------------------------------------------- typed Python API

    def search_inbox(
        self,
        keywords: str | list[str],
        from_addr: str | None = None,
        to_addr: str | None = None,
        sent_after: date | str | None = None,
        sent_before: date | str | None = None,
        max_results: int = DEFAULT_SEARCH_RESULTS,
    ) -> list[SearchHit]:
        """Raises pydantic.ValidationError or ToolArgumentError on bad arguments."""
        args = SearchInboxArgs.model_validate({
            "keywords": keywords, "from_addr": from_addr, "to_addr": to_addr, "sent_after": sent_after,
            "sent_before": sent_before, "max_results": max_results})
        return self._search(args)

    def read_email(self, message_id: str) -> EmailView | None:
        """The email, or None when this inbox has no email with that id."""
        row = self._db.execute(
            "SELECT message_id, sent_at, from_addr, to_addrs, cc, subject, attachments, body FROM emails"
            " WHERE message_id = ? AND inbox = ?", (message_id, self.inbox)).fetchone()
        return EmailView(*row) if row else None

    # ------------------------------------------------------------------------------- model calls

    def dispatch(self, name: str, raw_arguments: str | Mapping[str, Any] | None) -> ToolResult:
        """Run the tool the model called. Bad calls come back as an error result, never as an exception."""
        handler = self._handlers.get(name)
        if handler is None:
            return ToolResult.error(f"unknown tool {name!r}. Available tools: {', '.join(self._handlers)}.")
        try:
            return handler(_parse_arguments(raw_arguments))
        except ToolArgumentError as error:
            return ToolResult.error(f"{name}: {error}")
        except ValidationError as error:
            return ToolResult.error(f"invalid arguments for {name}: {describe_validation_error(error)}")

    def _search_tool(self, arguments: Mapping[str, Any]) -> ToolResult:
        hits = self._search(SearchInboxArgs.model_validate(arguments))
        return ToolResult(format_search_hits(hits), ok=True, message_ids=tuple(h.message_id for h in hits))

    def _read_tool(self, arguments: Mapping[str, Any]) -> ToolResult:
        message_id = ReadEmailArgs.model_validate(arguments).message_id
        email = self.read_email(message_id)
        if email is None:
            raise ToolArgumentError(f"no email with message_id {message_id!r} in this inbox")
        return ToolResult(format_email(email), ok=True, message_ids=(email.message_id,))

    def _answer_tool(self, arguments: Mapping[str, Any]) -> ToolResult:
        args = ReturnFinalAnswerArgs.model_validate(arguments)
        final = FinalAnswer(answer=args.answer, sources=tuple(s.strip("<> ") for s in args.sources))
        return ToolResult("Answer recorded.", ok=True, final_answer=final)

    def _search(self, args: SearchInboxArgs) -> list[SearchHit]:
        all_words, any_word = fts_queries(args.keywords)
        filters, params = ["e.inbox = ?"], [self.inbox]
        if args.from_addr:
            filters.append("e.from_addr LIKE ? ESCAPE '\\'")
            params.append(_like_pattern(args.from_addr))
        if args.to_addr:
            filters.append("(e.to_addrs LIKE ? ESCAPE '\\' OR e.cc LIKE ? ESCAPE '\\')")
            params += [_like_pattern(args.to_addr)] * 2
        if args.sent_after:
            filters.append("e.sent_at >= ?")
            params.append(args.sent_after.isoformat())
        if args.sent_before:
            filters.append("e.sent_at < ?")
            params.append(args.sent_before.isoformat())
        sql = (
            "SELECT e.message_id, substr(e.sent_at, 1, 10), e.from_addr, e.subject,"
            f" snippet(emails_fts, 1, '', '', '…', {SNIPPET_TOKENS})"
            " FROM emails_fts JOIN emails AS e ON e.rowid = emails_fts.rowid"
            f" WHERE emails_fts MATCH ? AND {' AND '.join(filters)}"
            " ORDER BY bm25(emails_fts, 4.0, 1.0) LIMIT ?"
        )
        for query in (all_words, any_word):
            rows = self._db.execute(sql, (query, *params, args.max_results)).fetchall()
            if rows:
                return [SearchHit(message_id, day, sender, subject, " ".join(snippet.split()))
                        for message_id, day, sender, subject, snippet in rows]
        return []


def _parse_arguments(raw: str | Mapping[str, Any] | None) -> Mapping[str, Any]:
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if isinstance(raw, Mapping):
        return raw
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise ToolArgumentError(f"arguments are not valid JSON ({error})") from error
    if not isinstance(parsed, dict):
        raise ToolArgumentError("arguments must be a JSON object")
    return parsed


_ERROR_WORDING = {"missing": "required argument is missing", "extra_forbidden": "unexpected argument"}


def describe_validation_error(error: ValidationError) -> str:
    """One short line per bad field, worded for a model: 'keywords: required argument is missing'."""
    parts = []
    for item in error.errors(include_url=False):
        field = ".".join(str(p) for p in item["loc"]) or "arguments"
        parts.append(f"{field}: {_ERROR_WORDING.get(item['type'], item['msg'])}")
    return "; ".join(parts)
