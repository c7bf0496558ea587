"""The email agent's tools over a small hand-written inbox: search filters, reading, and model mistakes."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from pydantic import ValidationError

from examples.email_agent.data import Corpus, Email, build_database
from examples.email_agent.tools import (
    MAX_BODY_CHARS,
    MAX_SEARCH_RESULTS,
    TOOL_SPECS,
    EmailTools,
    ReadEmailArgs,
    ReturnFinalAnswerArgs,
    SearchInboxArgs,
    ToolArgumentError,
    fts_queries,
)

ME = "sam.lee@orbitlabs.com"
OTHER = "kim.ray@northgate.ai"


def _email(n: int, subject: str, body: str, sent_at: str, *, inbox: str = ME, sender: str = "ana.diaz@orbitlabs.com",
           to: tuple[str, ...] = (ME,), cc: tuple[str, ...] = ()) -> Email:
    message_id = f"t{n:04d}"
    return Email(message_id, inbox, sender, to, cc, subject, body, sent_at, message_id, None)


EMAILS = (
    _email(1, "Orion kickoff moved to 3:30 PM", "The Orion kickoff is now on Thursday at 3:30 PM in Room 4B.",
           "2024-03-04T09:00:00"),
    _email(2, "Invoice INV-1001 from Northwind Traders", "Please pay invoice INV-1001 for $1,200.00 by March 30.",
           "2024-03-10T11:00:00", sender="billing@northwindtraders.com"),
    _email(3, "Lunch on Friday?", "Want to grab lunch on Friday? The ramen place opened.", "2024-04-02T12:00:00",
           sender="omar.haddad@orbitlabs.com", to=("team@orbitlabs.com",), cc=(ME,)),
    _email(4, "Atlas budget", "Finance approved $50,000.00 for Atlas, not the Orion amount.", "2024-05-20T15:00:00",
           sender="omar.haddad@orbitlabs.com", to=("ben.cho@orbitlabs.com",)),
    _email(5, "Long report", "Orion " + "word " * 600, "2024-06-01T08:00:00"),
    *(_email(10 + i, f"Weekly newsletter {i}", f"Newsletter number {i} about invoices and budgets.",
             f"2024-07-{i + 1:02d}T08:00:00", sender="news@digest.com") for i in range(14)),
    _email(99, "Orion secret", "Another inbox's Orion email.", "2024-03-05T09:00:00", inbox=OTHER, to=(OTHER,)),
)


@pytest.fixture(scope="module")
def db_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    corpus = Corpus(seed=0, inboxes=(ME, OTHER), emails=EMAILS, questions=())
    return build_database(corpus, tmp_path_factory.mktemp("email") / "emails.sqlite")


@pytest.fixture
def tools(db_path: Path) -> Iterator[EmailTools]:
    with EmailTools(db_path, ME) as tools:
        yield tools


def _ids(tools: EmailTools, **kwargs: object) -> list[str]:
    return [hit.message_id for hit in tools.search_inbox(**kwargs)]  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- search


def test_search_by_keyword_ranks_the_subject_match_first(tools: EmailTools) -> None:
    ids = _ids(tools, keywords="Orion kickoff")
    assert ids[0] == "t0001"
    assert "t0099" not in ids  # another inbox


def test_search_stems_and_falls_back_to_any_word(tools: EmailTools) -> None:
    assert "t0002" in _ids(tools, keywords="invoices")  # porter stemming
    # No email has all three words; the any-word fallback still finds the invoice.
    assert "t0002" in _ids(tools, keywords="Northwind zebra unicorn")


def test_search_accepts_a_list_of_keywords(tools: EmailTools) -> None:
    assert _ids(tools, keywords=["Orion", "kickoff"])[0] == "t0001"


def test_search_filters_by_sender_and_recipient(tools: EmailTools) -> None:
    assert set(_ids(tools, keywords="budget lunch", from_addr="omar")) == {"t0003", "t0004"}
    assert set(_ids(tools, keywords="lunch budget", from_addr="Omar Haddad")) == {"t0003", "t0004"}
    assert _ids(tools, keywords="lunch budget", to_addr="ben.cho@orbitlabs.com") == ["t0004"]
    assert _ids(tools, keywords="lunch", to_addr=ME) == ["t0003"]  # Cc counts as a recipient
    assert _ids(tools, keywords="lunch", to_addr="ben") == []
    assert _ids(tools, keywords="invoice", from_addr="100%_wild") == []  # LIKE wildcards are literal


def test_search_filters_by_date(tools: EmailTools) -> None:
    assert set(_ids(tools, keywords="Orion")) == {"t0001", "t0004", "t0005"}
    assert set(_ids(tools, keywords="Orion", sent_after="2024-05-20")) == {"t0004", "t0005"}  # inclusive
    assert set(_ids(tools, keywords="Orion", sent_before="2024-05-20")) == {"t0001"}  # exclusive
    assert _ids(tools, keywords="Orion", sent_after="2024-03-01", sent_before="2024-03-05") == ["t0001"]


def test_max_results_defaults_to_five_and_is_capped_at_ten(tools: EmailTools) -> None:
    assert len(_ids(tools, keywords="newsletter")) == 5
    assert len(_ids(tools, keywords="newsletter", max_results=3)) == 3
    assert len(_ids(tools, keywords="newsletter", max_results=50)) == MAX_SEARCH_RESULTS
    assert SearchInboxArgs.model_validate({"keywords": "x", "max_results": 500}).max_results == MAX_SEARCH_RESULTS


def test_search_result_content_is_json_with_snippets(tools: EmailTools) -> None:
    result = tools.dispatch("search_inbox", '{"keywords": "Northwind invoice"}')
    assert result.ok
    rows = orjson.loads(result.content)
    assert rows[0] == {"message_id": "t0002", "date": "2024-03-10", "from": "billing@northwindtraders.com",
                       "subject": "Invoice INV-1001 from Northwind Traders", "snippet": rows[0]["snippet"]}
    assert "1,200.00" in rows[0]["snippet"]
    assert result.message_ids == tuple(row["message_id"] for row in rows)


def test_search_without_matches_says_so(tools: EmailTools) -> None:
    result = tools.dispatch("search_inbox", '{"keywords": "xylophone"}')
    assert result.ok and result.message_ids == ()
    assert result.content.startswith("No emails matched")


@pytest.mark.parametrize("keywords", ['"AND OR (', "NEAR(a b", "*", "Orion OR", "a:b ^c -d +e {x}", "AND", "'; DROP TABLE emails; --"])
def test_fts_syntax_hostile_keywords_never_raise_an_fts_error(tools: EmailTools, keywords: str) -> None:
    result = tools.dispatch("search_inbox", orjson.dumps({"keywords": keywords}))
    assert result.content.startswith(("[", "No emails matched", "Error: search_inbox: keywords must contain"))


def test_fts_queries_quote_plain_words_only() -> None:
    assert fts_queries(['"AND OR (']) == ('"and" "or"', '"and" OR "or"')  # only stop words: kept, quoted
    assert fts_queries(["the Orion kickoff?"]) == ('"orion" "kickoff"', '"orion" OR "kickoff"')
    with pytest.raises(ToolArgumentError):
        fts_queries(["((( ???"])


# --------------------------------------------------------------------------------------------- read


def test_read_email_returns_headers_and_body(tools: EmailTools) -> None:
    result = tools.dispatch("read_email", '{"message_id": "t0003"}')
    assert result.ok and result.message_ids == ("t0003",)
    assert "from: omar.haddad@orbitlabs.com" in result.content
    assert f"cc: {ME}" in result.content
    assert "subject: Lunch on Friday?" in result.content
    assert result.content.endswith("Want to grab lunch on Friday? The ramen place opened.")


def test_read_email_accepts_angle_brackets_around_the_id(tools: EmailTools) -> None:
    assert tools.dispatch("read_email", '{"message_id": "<t0001>"}').message_ids == ("t0001",)


def test_read_email_truncates_long_bodies(tools: EmailTools) -> None:
    content = tools.dispatch("read_email", '{"message_id": "t0005"}').content
    assert content.endswith("[truncated]")
    assert len(content) < MAX_BODY_CHARS + 300


@pytest.mark.parametrize("message_id", ["t9999", "t0099"])  # unknown, and another inbox's email
def test_read_email_of_an_unknown_id_is_an_error_for_the_model(tools: EmailTools, message_id: str) -> None:
    result = tools.dispatch("read_email", orjson.dumps({"message_id": message_id}))
    assert not result.ok
    assert result.content == f"Error: read_email: no email with message_id {message_id!r} in this inbox"
    assert tools.read_email(message_id) is None


# ------------------------------------------------------------------------------------------- answer


def test_return_final_answer_records_answer_and_sources(tools: EmailTools) -> None:
    result = tools.dispatch("return_final_answer", {"answer": "3:30 PM", "sources": ["t0001"]})
    assert result.ok and result.content == "Answer recorded."
    assert result.final_answer is not None
    assert (result.final_answer.answer, result.final_answer.sources) == ("3:30 PM", ("t0001",))


def test_a_single_source_string_is_a_list_of_one(tools: EmailTools) -> None:
    result = tools.dispatch("return_final_answer", '{"answer": "x", "sources": "t0001"}')
    assert result.final_answer is not None and result.final_answer.sources == ("t0001",)


# -------------------------------------------------------------------------------------- bad calls


@pytest.mark.parametrize(
    ("name", "arguments", "message"),
    [
        ("search_inbox", "{}", "Error: invalid arguments for search_inbox: keywords: required argument is missing"),
        ("search_inbox", '{"keywords": "x", "folder": "inbox"}',
         "Error: invalid arguments for search_inbox: folder: unexpected argument"),
        ("search_inbox", '{"keywords": "x", "sent_after": "last week"}', "Error: invalid arguments for search_inbox: sent_after:"),
        ("search_inbox", '{"keywords": "x", "max_results": 0}', "Error: invalid arguments for search_inbox: max_results:"),
        ("search_inbox", '{"keywords": "x"', "Error: search_inbox: arguments are not valid JSON"),
        ("search_inbox", '["x"]', "Error: search_inbox: arguments must be a JSON object"),
        ("search_inbox", '"x"', "Error: search_inbox: arguments must be a JSON object"),
        ("read_email", '{"id": "t0001"}', "Error: invalid arguments for read_email: message_id: required argument is missing; id: unexpected argument"),
        ("return_final_answer", '{"answer": ""}', "Error: invalid arguments for return_final_answer: answer:"),
        ("return_final_answer", '{"answer": "x", "sources": [1]}', "Error: invalid arguments for return_final_answer: sources.0:"),
        ("send_email", '{"to": "boss"}', "Error: unknown tool 'send_email'. Available tools: search_inbox, read_email, return_final_answer."),
        ("", None, "Error: unknown tool ''"),
    ],
)
def test_bad_calls_return_an_error_message_not_an_exception(tools: EmailTools, name: str, arguments: str | None, message: str) -> None:
    result = tools.dispatch(name, arguments)
    assert not result.ok
    assert result.final_answer is None and result.message_ids == ()
    assert result.content.startswith(message), result.content


def test_empty_arguments_mean_no_arguments(tools: EmailTools) -> None:
    assert tools.dispatch("search_inbox", "").content.startswith("Error: invalid arguments for search_inbox: keywords")


def test_the_typed_api_raises_on_bad_arguments(tools: EmailTools) -> None:
    with pytest.raises(ValidationError):
        tools.search_inbox(keywords="x", sent_after="soon")


def test_programming_errors_still_surface(db_path: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        EmailTools(tmp_path / "missing.sqlite", ME)
    tools = EmailTools(db_path, ME)
    tools.close()
    with pytest.raises(sqlite3.ProgrammingError):  # using a closed connection: a bug, not the model's fault
        tools.dispatch("search_inbox", '{"keywords": "Orion"}')


def test_tool_specs_match_the_argument_models() -> None:
    models = {"search_inbox": SearchInboxArgs, "read_email": ReadEmailArgs, "return_final_answer": ReturnFinalAnswerArgs}
    assert [spec["function"]["name"] for spec in TOOL_SPECS] == list(models)
    for spec in TOOL_SPECS:
        parameters = spec["function"]["parameters"]
        model = models[spec["function"]["name"]]
        assert set(parameters["properties"]) == set(model.model_fields)
        assert set(parameters["required"]) <= {n for n, f in model.model_fields.items() if f.is_required()} | {"sources"}
