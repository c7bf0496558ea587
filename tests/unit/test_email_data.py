"""The synthetic email corpus: deterministic, well-formed, with disjoint splits and answerable questions."""

from __future__ import annotations

import sqlite3
import time
from collections import Counter
from pathlib import Path

import pytest

from examples.email_agent.data import Corpus, build_database, generate, load_or_build


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return generate(seed=0)


def test_same_seed_gives_identical_corpus(corpus: Corpus) -> None:
    again = generate(seed=0)
    assert again.emails == corpus.emails
    assert again.questions == corpus.questions
    assert again.fingerprint() == corpus.fingerprint()


def test_different_seed_gives_different_corpus(corpus: Corpus) -> None:
    other = generate(seed=1)
    assert other.fingerprint() != corpus.fingerprint()
    assert {q.question for q in other.questions} != {q.question for q in corpus.questions}
    assert [e.body for e in other.emails[:50]] != [e.body for e in corpus.emails[:50]]


def test_default_corpus_size(corpus: Corpus) -> None:
    assert len(corpus.inboxes) == 4
    per_inbox = Counter(e.inbox for e in corpus.emails)
    assert set(per_inbox) == set(corpus.inboxes)
    assert all(750 <= n <= 753 for n in per_inbox.values())  # a thread may overshoot by two emails
    assert len(corpus.questions) >= 500


def test_generation_is_fast() -> None:
    start = time.perf_counter()
    generate(seed=7)
    assert time.perf_counter() - start < 5.0


def test_splits_share_no_question_nor_source(corpus: Corpus) -> None:
    splits = {name: corpus.split(name) for name in ("train", "val", "test")}
    assert all(splits.values())
    assert sum(len(s) for s in splits.values()) == len(corpus.questions)
    for a, b in (("train", "val"), ("train", "test"), ("val", "test")):
        assert not {q.id for q in splits[a]} & {q.id for q in splits[b]}
        assert not {q.question for q in splits[a]} & {q.question for q in splits[b]}
        assert not {s for q in splits[a] for s in q.source_ids} & {s for q in splits[b] for s in q.source_ids}
    assert len({q.question for q in corpus.questions}) == len(corpus.questions)


def test_every_split_has_every_kind(corpus: Corpus) -> None:
    for split in ("train", "val", "test"):
        assert {q.kind for q in corpus.split(split)} == {"subject", "body", "thread"}


def test_sources_exist_in_the_inbox_and_state_the_answer(corpus: Corpus) -> None:
    for q in corpus.questions:
        assert q.source_ids
        for source_id in q.source_ids:
            email = corpus.email(source_id)
            assert email.inbox == q.inbox
            assert q.answer.lower() in email.body.lower(), (q, email)


def test_subject_questions_show_the_answer_in_the_subject(corpus: Corpus) -> None:
    subject_questions = [q for q in corpus.questions if q.kind == "subject"]
    assert len(subject_questions) >= 0.2 * len(corpus.questions)  # the easy tier is sizeable
    for q in subject_questions:
        assert q.answer.lower() in corpus.email(q.source_ids[0]).subject.lower()


def test_thread_questions_are_answered_in_a_reply(corpus: Corpus) -> None:
    for q in (q for q in corpus.questions if q.kind == "thread"):
        assert corpus.email(q.source_ids[-1]).in_reply_to is not None


def test_threads_are_consistent(corpus: Corpus) -> None:
    by_id = {e.message_id: e for e in corpus.emails}
    assert len(by_id) == len(corpus.emails)
    for email in corpus.emails:
        if email.in_reply_to is not None:
            parent = by_id[email.in_reply_to]
            assert parent.thread_id == email.thread_id
            assert parent.sent_at < email.sent_at
            assert email.subject.startswith(("Re: ", "Fwd: "))
        else:
            assert email.thread_id == email.message_id


def test_database_has_every_email_and_a_working_fts5_index(corpus: Corpus, tmp_path: Path) -> None:
    path = build_database(corpus, tmp_path / "emails.sqlite")
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM emails").fetchone()[0] == len(corpus.emails)
        email = corpus.emails[123]
        word = email.subject.split()[-1]
        hits = db.execute("SELECT e.message_id FROM emails_fts JOIN emails e ON e.rowid = emails_fts.rowid "
                          "WHERE emails_fts MATCH ?", (f'"{word}"',)).fetchall()
        assert (email.message_id,) in hits
    assert not list(tmp_path.glob(".*.tmp"))  # the temp file was renamed into place


def test_load_or_build_reuses_the_database(tmp_path: Path) -> None:
    first = load_or_build(tmp_path, seed=3, inboxes=1, emails_per_inbox=60)
    built_at = first.db_path.stat().st_mtime_ns
    second = load_or_build(tmp_path, seed=3, inboxes=1, emails_per_inbox=60)
    assert second.db_path == first.db_path
    assert second.db_path.stat().st_mtime_ns == built_at
    other = load_or_build(tmp_path, seed=4, inboxes=1, emails_per_inbox=60)
    assert other.db_path != first.db_path


@pytest.mark.parametrize("kwargs", [{"inboxes": 0}, {"inboxes": 99}, {"emails_per_inbox": 5}])
def test_rejects_impossible_sizes(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        generate(0, **kwargs)
