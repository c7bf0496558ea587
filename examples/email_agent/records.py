"""The records of the email corpus: an email and a question about it. Plain frozen dataclasses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

QuestionKind = Literal["subject", "body", "thread"]
Split = Literal["train", "val", "test"]


@dataclass(frozen=True)
class Email:
    message_id: str
    inbox: str  # the address of the mailbox owner
    from_addr: str
    to_addrs: tuple[str, ...]
    cc: tuple[str, ...]
    subject: str
    body: str
    sent_at: str  # ISO 8601, no timezone: "2024-03-14T09:25:00"; string order is time order
    thread_id: str  # message id of the first email of the thread
    in_reply_to: str | None
    attachments: tuple[str, ...] = ()


@dataclass(frozen=True)
class Question:
    id: str
    inbox: str
    question: str
    answer: str
    answer_aliases: tuple[str, ...]  # other accepted spellings the normaliser cannot derive ("UA482")
    source_ids: tuple[str, ...]  # the emails that state the answer, oldest first
    kind: QuestionKind
    split: Split
