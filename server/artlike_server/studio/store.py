"""The studio's SQLite file (`<data-dir>/studio.sqlite`, WAL): ratings, continual policies, trained rewards.

    ratings              one row per (completion, rater); a new rating of the same pair replaces it (new id)
    policies             the continual-training policy of each model (JSON)
    continual            per model: the rating id up to which the last continual attempt looked
    trajectory_rewards   the reward each recorded trajectory was trained with (from /_train_model)

Blocking methods, one connection behind a lock: call them with `asyncio.to_thread` from async code.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from artlike.studio_types import ContinualPolicy, Rating

SCHEMA = (
    """
    CREATE TABLE IF NOT EXISTS ratings (
        id              INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: ids are cursors and watermarks
        completion_id   INTEGER NOT NULL,
        trajectory_id   TEXT    NOT NULL,
        model           TEXT    NOT NULL,
        step            INTEGER,
        prompt_key      TEXT    NOT NULL,
        kind            TEXT    NOT NULL,
        value           TEXT,             -- JSON
        reward          REAL,
        ranking_id      TEXT,
        comment         TEXT,
        rater           TEXT    NOT NULL,
        split           TEXT    NOT NULL,
        created_at      REAL    NOT NULL,
        trained_in_step INTEGER,
        UNIQUE (completion_id, rater)
    )
    """,
    "CREATE INDEX IF NOT EXISTS ratings_by_model ON ratings (model, id)",
    "CREATE TABLE IF NOT EXISTS policies (model TEXT PRIMARY KEY, policy TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS continual (model TEXT PRIMARY KEY, attempted_through INTEGER NOT NULL)",
    """
    CREATE TABLE IF NOT EXISTS trajectory_rewards (
        trajectory_id TEXT PRIMARY KEY, model TEXT NOT NULL, step INTEGER NOT NULL, reward REAL NOT NULL,
        time REAL NOT NULL
    )
    """,
)
_COLUMNS = ("id, completion_id, trajectory_id, model, step, prompt_key, kind, value, reward, ranking_id, comment, "
            "rater, split, created_at, trained_in_step")


@dataclass(frozen=True)
class NewRating:
    completion_id: int
    trajectory_id: str
    model: str
    step: int | None
    prompt_key: str
    kind: str
    value: str | int | None
    reward: float | None
    ranking_id: str | None
    comment: str | None
    rater: str
    split: str


@dataclass(frozen=True)
class StoredRating:
    rating: Rating
    prompt_key: str


def _rating(row: Sequence[Any]) -> StoredRating:
    return StoredRating(
        Rating(id=row[0], completion_id=row[1], trajectory_id=row[2], model=row[3], step=row[4], kind=row[6],
               value=None if row[7] is None else orjson.loads(row[7]), reward=row[8], ranking_id=row[9],
               comment=row[10], rater=row[11], split=row[12], created_at=row[13], trained_in_step=row[14]),
        prompt_key=row[5])


class StudioStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._lock = threading.Lock()
        with self._lock:
            for statement in SCHEMA:
                self._db.execute(statement)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------------------------ ratings

    def add_ratings(self, ratings: Sequence[NewRating]) -> list[Rating]:
        """Insert in one transaction; a rating of a (completion, rater) already rated replaces the old row."""
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                ids = []
                for r in ratings:
                    self._db.execute("DELETE FROM ratings WHERE completion_id = ? AND rater = ?",
                                     (r.completion_id, r.rater))
                    cursor = self._db.execute(
                        "INSERT INTO ratings (completion_id, trajectory_id, model, step, prompt_key, kind, value, "
                        "reward, ranking_id, comment, rater, split, created_at) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (r.completion_id, r.trajectory_id, r.model, r.step, r.prompt_key, r.kind,
                         None if r.value is None else orjson.dumps(r.value).decode(), r.reward, r.ranking_id,
                         r.comment, r.rater, r.split, now))
                    ids.append(cursor.lastrowid)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            rows = self._db.execute(f"SELECT {_COLUMNS} FROM ratings WHERE id IN ({', '.join('?' * len(ids))}) "
                                    "ORDER BY id", ids).fetchall()
        return [_rating(row).rating for row in rows]

    def list_ratings(self, *, model: str | None = None, step: int | None = None, rater: str | None = None,
                     kind: str | None = None, after: int | None = None, limit: int | None = None,
                     untrained: bool | None = None, split: str | None = None) -> list[StoredRating]:
        clauses, params = [], []
        for column, value in (("model", model), ("step", step), ("rater", rater), ("kind", kind), ("split", split)):
            if value is not None:
                clauses.append(f"{column} = ?")
                params.append(value)
        if after is not None:
            clauses.append("id > ?")
            params.append(after)
        if untrained is not None:
            clauses.append("trained_in_step IS NULL" if untrained else "trained_in_step IS NOT NULL")
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        query = f"SELECT {_COLUMNS} FROM ratings{where} ORDER BY id" + (" LIMIT ?" if limit is not None else "")
        with self._lock:
            rows = self._db.execute(query, [*params, *([limit] if limit is not None else [])]).fetchall()
        return [_rating(row) for row in rows]

    def ratings_of_prompts(self, model: str, prompt_keys: Iterable[str]) -> list[StoredRating]:
        keys = list(set(prompt_keys))
        if not keys:
            return []
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM ratings WHERE model = ? AND prompt_key IN ({', '.join('?' * len(keys))}) "
                "ORDER BY id", [model, *keys]).fetchall()
        return [_rating(row) for row in rows]

    def rated_completion_ids(self, completion_ids: Iterable[int]) -> set[int]:
        ids = list(completion_ids)
        if not ids:
            return set()
        with self._lock:
            rows = self._db.execute(
                f"SELECT DISTINCT completion_id FROM ratings WHERE completion_id IN ({', '.join('?' * len(ids))})",
                ids).fetchall()
        return {row[0] for row in rows}

    def rating_means(self, trajectory_ids: Iterable[str]) -> dict[str, float]:
        ids = list(trajectory_ids)
        if not ids:
            return {}
        with self._lock:
            rows = self._db.execute(
                f"SELECT trajectory_id, AVG(reward) FROM ratings WHERE reward IS NOT NULL AND trajectory_id IN "
                f"({', '.join('?' * len(ids))}) GROUP BY trajectory_id", ids).fetchall()
        return {row[0]: row[1] for row in rows}

    def mark_trained(self, rating_ids: Sequence[int], step: int) -> None:
        with self._lock:
            self._db.executemany("UPDATE ratings SET trained_in_step = ? WHERE id = ?", [(step, i) for i in rating_ids])

    def count(self, model: str, *, untrained: bool, split: str = "train", after: int = 0) -> int:
        """Ratings with a reward, (un)trained, of one split, with ids above `after`."""
        condition = "trained_in_step IS NULL" if untrained else "trained_in_step IS NOT NULL"
        with self._lock:
            row = self._db.execute(f"SELECT COUNT(*) FROM ratings WHERE model = ? AND split = ? AND reward IS NOT "
                                   f"NULL AND {condition} AND id > ?", (model, split, after)).fetchone()
        return int(row[0])

    # ------------------------------------------------------------------------------ continual policy

    def policy(self, model: str) -> ContinualPolicy:
        with self._lock:
            row = self._db.execute("SELECT policy FROM policies WHERE model = ?", (model,)).fetchone()
        return ContinualPolicy.model_validate_json(row[0]) if row else ContinualPolicy()

    def set_policy(self, model: str, policy: ContinualPolicy) -> None:
        with self._lock:
            self._db.execute("INSERT INTO policies (model, policy) VALUES (?, ?) ON CONFLICT (model) DO UPDATE "
                             "SET policy = excluded.policy", (model, policy.model_dump_json()))

    def enabled_models(self) -> list[str]:
        with self._lock:
            rows = self._db.execute("SELECT model, policy FROM policies").fetchall()
        return [model for model, policy in rows if ContinualPolicy.model_validate_json(policy).enabled]

    def attempted_through(self, model: str) -> int:
        with self._lock:
            row = self._db.execute("SELECT attempted_through FROM continual WHERE model = ?", (model,)).fetchone()
        return int(row[0]) if row else 0

    def set_attempted_through(self, model: str, rating_id: int) -> None:
        with self._lock:
            self._db.execute("INSERT INTO continual (model, attempted_through) VALUES (?, ?) ON CONFLICT (model) "
                             "DO UPDATE SET attempted_through = excluded.attempted_through", (model, rating_id))

    # ---------------------------------------------------------------------------- trajectory rewards

    def record_rewards(self, model: str, step: int, rewards: Sequence[tuple[str, float]]) -> None:
        now = time.time()
        with self._lock:
            self._db.executemany(
                "INSERT INTO trajectory_rewards (trajectory_id, model, step, reward, time) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (trajectory_id) DO UPDATE SET model = excluded.model, step = excluded.step, "
                "reward = excluded.reward, time = excluded.time",
                [(tid, model, step, reward, now) for tid, reward in rewards])

    def rewards(self, trajectory_ids: Iterable[str]) -> dict[str, float]:
        ids = list(trajectory_ids)
        if not ids:
            return {}
        with self._lock:
            rows = self._db.execute(f"SELECT trajectory_id, reward FROM trajectory_rewards WHERE trajectory_id IN "
                                    f"({', '.join('?' * len(ids))})", ids).fetchall()
        return dict(rows)

    def trajectories_with_reward(self, low: float | None, high: float | None, limit: int = 10_000) -> list[str]:
        clauses, params = [], []
        if low is not None:
            clauses.append("reward >= ?")
            params.append(low)
        if high is not None:
            clauses.append("reward <= ?")
            params.append(high)
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        with self._lock:
            rows = self._db.execute(f"SELECT trajectory_id FROM trajectory_rewards{where} ORDER BY time DESC "
                                    "LIMIT ?", [*params, limit]).fetchall()
        return [row[0] for row in rows]
