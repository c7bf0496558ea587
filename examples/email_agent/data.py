"""Synthetic inboxes and questions, generated offline from a seed, stored in SQLite with an FTS5 index.

    corpus = generate(seed=0)                       # ~3,000 emails in 4 inboxes, ~600 questions
    build_database(corpus, "emails.sqlite")         # table `emails` + FTS5 table `emails_fts`
    data = load_or_build(DEFAULT_DATA_DIR, seed=0)  # both, with the database cached by content hash

Each inbox belongs to one employee of a fictional company: colleagues with roles, a manager, vendors,
a recruiter, travel and shop notifications, newsletters and office chatter, as threads with replies over
2024. About a third of the threads carry a fact (a meeting time, an invoice amount, a vendor decision,
a flight confirmation code, a file name...) that exactly one question asks about. Question kinds:

    subject  the answer is in the subject line: one search shows it in the results (the easy tier)
    body     the answer is only in the body: search, then read the email
    thread   the answer is in a reply (a rescheduled meeting, a decision on a proposal, a payment)

Every source email of a question contains the answer verbatim. Splits are stratified by kind and share
no question (nor any source email: each fact thread yields one question).
"""

from __future__ import annotations

import hashlib
import os
import random
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from examples.email_agent import _scenarios
from examples.email_agent.records import Email, Question, QuestionKind, Split

__all__ = [
    "DEFAULT_DATA_DIR", "DEFAULT_INBOXES", "MAX_INBOXES", "Corpus", "Email", "EmailData", "Question",
    "QuestionKind", "Split", "build_database", "generate", "load_or_build",
]
SPLIT_FRACTIONS: dict[Split, float] = {"train": 0.7, "val": 0.1, "test": 0.2}

DEFAULT_SEED = 0
DEFAULT_INBOXES = 4
MAX_INBOXES = _scenarios.MAX_INBOXES
DEFAULT_EMAILS_PER_INBOX = 750
DEFAULT_DATA_DIR = Path(__file__).parent / "data"  # gitignored


@dataclass(frozen=True)
class Corpus:
    seed: int
    inboxes: tuple[str, ...]
    emails: tuple[Email, ...]
    questions: tuple[Question, ...]
    _by_id: dict[str, Email] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {e.message_id: e for e in self.emails})

    def email(self, message_id: str) -> Email:
        return self._by_id[message_id]

    def split(self, name: Split) -> list[Question]:
        return [q for q in self.questions if q.split == name]

    def fingerprint(self) -> str:
        """Content hash: two corpora with the same fingerprint are identical."""
        payload = orjson.dumps([self.seed, self.inboxes, self.emails, self.questions])
        return hashlib.sha256(payload).hexdigest()[:16]


@dataclass(frozen=True)
class EmailData:
    corpus: Corpus
    db_path: Path


def generate(
    seed: int = DEFAULT_SEED,
    *,
    inboxes: int = DEFAULT_INBOXES,
    emails_per_inbox: int = DEFAULT_EMAILS_PER_INBOX,
) -> Corpus:
    """The whole corpus, a pure function of its arguments. Each inbox gets at least `emails_per_inbox`."""
    if not 1 <= inboxes <= MAX_INBOXES:
        raise ValueError(f"inboxes must be between 1 and {MAX_INBOXES}, got {inboxes}")
    if emails_per_inbox < 20:
        raise ValueError(f"emails_per_inbox must be at least 20, got {emails_per_inbox}")
    rng = random.Random(seed)
    pools = _scenarios.Pools(rng)
    companies, projects = _scenarios.draw_companies_and_projects(rng, inboxes)
    emails: list[Email] = []
    drafts: list[_scenarios.QuestionDraft] = []
    owners: list[str] = []
    for index, ((company, domain), inbox_projects) in enumerate(zip(companies, projects, strict=True)):
        world = _scenarios.InboxWorld.create(rng, pools, company, domain, inbox_projects, index)
        owners.append(world.owner.addr)
        inbox_emails, inbox_drafts = _scenarios.write_inbox(world, rng, pools, emails_per_inbox)
        emails.extend(inbox_emails)
        drafts.extend(inbox_drafts)
    questions = _assign_splits(drafts, rng)
    return Corpus(seed=seed, inboxes=tuple(owners), emails=tuple(emails), questions=tuple(questions))


def _assign_splits(drafts: list[_scenarios.QuestionDraft], rng: random.Random) -> list[Question]:
    """Stratified by kind, so every split has the same mix of easy and hard questions."""
    split_of: dict[int, Split] = {}
    for kind in ("subject", "body", "thread"):
        indices = [i for i, d in enumerate(drafts) if d.kind == kind]
        rng.shuffle(indices)
        n_test = round(len(indices) * SPLIT_FRACTIONS["test"])
        n_val = round(len(indices) * SPLIT_FRACTIONS["val"])
        for position, i in enumerate(indices):
            split_of[i] = "test" if position < n_test else "val" if position < n_test + n_val else "train"
    return [
        Question(
            id=f"q{i:05d}",
            inbox=d.inbox,
            question=d.question,
            answer=d.answer,
            answer_aliases=d.aliases,
            source_ids=tuple(e.message_id for e in d.sources),
            kind=d.kind,
            split=split_of[i],
        )
        for i, d in enumerate(drafts)
    ]


# ------------------------------------------------------------------------------------------ database

_SCHEMA = """
CREATE TABLE emails (
    rowid INTEGER PRIMARY KEY,
    message_id TEXT NOT NULL UNIQUE,
    inbox TEXT NOT NULL,
    from_addr TEXT NOT NULL,
    to_addrs TEXT NOT NULL,      -- comma-separated
    cc TEXT NOT NULL,            -- comma-separated
    subject TEXT NOT NULL,
    body TEXT NOT NULL,
    sent_at TEXT NOT NULL,       -- ISO 8601: string order is time order
    thread_id TEXT NOT NULL,
    in_reply_to TEXT,
    attachments TEXT NOT NULL    -- comma-separated file names
);
CREATE INDEX emails_inbox_sent_at ON emails (inbox, sent_at);
-- External-content FTS5 index over subject and body; porter stemming so "invoices" finds "invoice".
CREATE VIRTUAL TABLE emails_fts USING fts5 (
    subject, body, content='emails', content_rowid='rowid', tokenize='porter unicode61'
);
"""


def build_database(corpus: Corpus, path: str | Path) -> Path:
    """Write the corpus to a new SQLite file (atomically: a temp file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    connection = sqlite3.connect(tmp)
    try:
        connection.executescript(_SCHEMA)
        connection.executemany(
            "INSERT INTO emails (message_id, inbox, from_addr, to_addrs, cc, subject, body, sent_at,"
            " thread_id, in_reply_to, attachments) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                (e.message_id, e.inbox, e.from_addr, ", ".join(e.to_addrs), ", ".join(e.cc), e.subject,
                 e.body, e.sent_at, e.thread_id, e.in_reply_to, ", ".join(e.attachments))
                for e in corpus.emails
            ),
        )
        connection.execute("INSERT INTO emails_fts (emails_fts) VALUES ('rebuild')")
        connection.commit()
    finally:
        connection.close()
    tmp.replace(path)
    return path


def load_or_build(
    data_dir: str | Path = DEFAULT_DATA_DIR,
    seed: int = DEFAULT_SEED,
    *,
    inboxes: int = DEFAULT_INBOXES,
    emails_per_inbox: int = DEFAULT_EMAILS_PER_INBOX,
) -> EmailData:
    """Generate the corpus (fast, deterministic) and reuse its database if one with the same content exists."""
    corpus = generate(seed, inboxes=inboxes, emails_per_inbox=emails_per_inbox)
    db_path = Path(data_dir) / f"emails-seed{seed}-{corpus.fingerprint()}.sqlite"
    if not db_path.exists():
        build_database(corpus, db_path)
    return EmailData(corpus=corpus, db_path=db_path)


def iter_questions(corpus: Corpus, split: Split, kinds: tuple[QuestionKind, ...] | None = None) -> Iterator[Question]:
    for q in corpus.split(split):
        if kinds is None or q.kind in kinds:
            yield q
