"""RULER-style relative judging: an LLM scores the trajectories of one group against each other.

Why relative: GRPO only uses how a trajectory compares with the rest of its group (advantage = reward -
group mean), and a judge ranks several attempts at one task far more consistently than it scores one alone
(OpenPipe ART's RULER). So one judge request sees a whole group: the shared task once, each distinct
conversation numbered, a rubric; it answers `{"scores": [{"trajectory_id", "explanation", "score"}, ...]}`.

`judge_group` in order:
1. conversations: an offline trajectory's messages; a recorded one's last completion as the server shows it
   (`GET /v1/trajectories/{id}/view`: its prompt messages and its decoded answer; the plain record holds
   only token ids, and the client has no tokenizer);
2. prompt: the messages every conversation starts with before the first assistant turn are the task, shown
   once; identical conversations are judged once and share a score;
3. the cache (same model, messages and sampling parameters: the stored answer, no request);
4. the judge's chat completion, asking for a JSON schema (`response_format`), or JSON in plain text from a
   judge that rejects the schema;
5. validation (pydantic): one score in [0, 1] per trajectory, else `JudgeError`;
6. a new group: copies whose `reward` is the judge's score, the earlier reward kept as
   `metrics["independent_reward"]`, the explanation in `metadata["judge_explanation"]`.

Nothing here turns a failure into a reward: a judge that errs or answers badly raises `JudgeError`, and
`judge_groups` drops (or keeps unjudged, or raises for) the groups that failed, and says how many.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import math
import os
import re
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeAlias, overload

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError
from tqdm.auto import tqdm

from ._errors import APIConnectionError, APIError, JudgeError
from ._tasks import in_turn_of_finishing
from ._trajectory import PLACEHOLDER_API_KEY, Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    import openai  # slow to import on a small CPU: imported where a client is built

__all__ = ["Judge", "judge_group", "judge_group_sync", "judge_groups", "judge_groups_sync"]

logger = logging.getLogger("artlike")

ResponseFormat: TypeAlias = Literal["auto", "json_schema", "structured_outputs", "json_object", "text"]
OnFailure: TypeAlias = Literal["drop", "keep", "raise"]
Message: TypeAlias = Mapping[str, Any]

DEFAULT_RUBRIC = """\
- A trajectory that achieves its goal should always score significantly higher than one that does not.
- A trajectory that achieves its goal more efficiently (e.g. without unproductive detours) should score \
higher than one that achieves it less efficiently.
- If one trajectory is only slightly better than another, their scores should differ a little; if it is \
much better, they should differ a lot.
- Give partial credit to a trajectory that makes progress towards its goal without reaching it."""

SYSTEM_PROMPT = """\
All of the trajectories below were given the same task. Consider each of them and give it a score between \
0 and 1 for how well it achieves the task's goal, compared with the others. Use your best judgement of what \
the goal is.

Grading standards:
{rubric}

Answer with JSON only: one entry per trajectory, in order, with a short explanation before its score:
{{"scores": [{{"trajectory_id": "1", "explanation": "...", "score": 0.0}}, ...]}}"""

CACHE_FORMAT = 1  # part of every cache key: bump it when the stored answer's meaning changes
_THINKING = re.compile(r"<think>.*?</think>", re.DOTALL)


# ------------------------------------------------------------------------------------------- the judge


@dataclass(eq=False)
class Judge:
    """An OpenAI-compatible chat model that judges groups, with its sampling parameters and its cache.

        judge = art.Judge(model="Qwen/Qwen2.5-7B-Instruct", base_url="http://gpu-box:8000/v1", api_key=key)
        judge = art.Judge(model="gpt-4.1-mini")                       # OPENAI_API_KEY / OPENAI_BASE_URL
        judge = art.Judge(model="m", client=openai.AsyncOpenAI(...))  # your client, used as is

    Make one and reuse it: its cache (an LRU of `cache_size` answers, plus one JSON file per answer in
    `cache_dir` when given) lives as long as it does. Without `client`, each call opens its own client and
    closes it (an async client belongs to the event loop that opened it, so a long-lived one would break
    the `_sync` twins). `response_format`: "auto" asks for a JSON schema and, when the judge rejects that
    (400 or 422), asks for JSON in plain text from then on; "json_schema", "json_object" and "text" ask
    only that way; "structured_outputs" sends the schema in vLLM's own `structured_outputs` field with
    whitespace between JSON tokens off (vLLM servers only: the most robust with a small judge). `max_explanation_chars` bounds each explanation in the schema (`maxLength`: a constrained
    decoder such as vLLM's then cannot ramble past max_tokens; OpenAI's strict mode does not take it).
    `max_retries` is the openai client's own retrying of 429s, 5xx and dropped connections.
    """

    DEFAULT_RUBRIC: ClassVar[str] = DEFAULT_RUBRIC

    model: str
    base_url: str | None = None
    api_key: str | None = field(default=None, repr=False)
    temperature: float = 0.0
    max_tokens: int | None = None
    extra_body: Mapping[str, Any] | None = None
    response_format: ResponseFormat = "auto"
    max_explanation_chars: int | None = None
    timeout: float = 120.0
    max_retries: int = 2
    cache_size: int = 1024
    cache_dir: str | os.PathLike[str] | None = None
    client: openai.AsyncOpenAI | None = field(default=None, repr=False)
    _cache: _AnswerCache = field(init=False, repr=False)
    _schema_rejected: bool = field(init=False, default=False, repr=False)

    def __post_init__(self) -> None:
        if self.response_format not in ("auto", "json_schema", "structured_outputs", "json_object", "text"):
            raise ValueError(f"response_format must be auto, json_schema, structured_outputs, json_object or text, "
                             f"not {self.response_format!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.max_explanation_chars is not None and self.max_explanation_chars < 1:
            raise ValueError(f"max_explanation_chars must be >= 1, got {self.max_explanation_chars}")
        if self.cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {self.cache_size}")
        if self.client is not None and (self.base_url or self.api_key):
            raise TypeError("base_url and api_key configure the judge's own client; "
                            "a judge given client= uses that client as is")
        self._cache = _AnswerCache(self.cache_size, Path(self.cache_dir) if self.cache_dir is not None else None)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[openai.AsyncOpenAI]:
        """The client for one call: yours (left open), or one of its own, closed at the end."""
        if self.client is not None:
            yield self.client
            return
        import openai

        client = openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key or os.environ.get("OPENAI_API_KEY") or PLACEHOLDER_API_KEY,
            timeout=self.timeout, max_retries=self.max_retries,
        )
        try:
            yield client
        finally:
            await client.close()

    def cache_key(self, messages: Sequence[Message], count: int) -> str:
        """sha256 of everything that decides the answer: model, messages, sampling parameters, group size.
        Not the response format: every format yields the same validated scores."""
        request = {"v": CACHE_FORMAT, "model": self.model, "messages": messages, "count": count,
                   "temperature": self.temperature, "max_tokens": self.max_tokens, "extra_body": self.extra_body,
                   "max_explanation_chars": self.max_explanation_chars}
        return hashlib.sha256(orjson.dumps(request, option=orjson.OPT_SORT_KEYS)).hexdigest()

    def request_body(self, messages: Sequence[Message], count: int, response_format: ResponseFormat) -> dict[str, Any]:
        """The chat completion's arguments for the openai SDK."""
        body: dict[str, Any] = {"model": self.model, "messages": list(messages), "temperature": self.temperature}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.extra_body:
            body["extra_body"] = dict(self.extra_body)
        if response_format == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "trajectory_scores", "schema": scores_schema(count, self.max_explanation_chars), "strict": True}}
        elif response_format == "structured_outputs":
            # vLLM's own form of the same schema, with whitespace between JSON tokens turned off: a small judge
            # otherwise may pad its answer with spaces and newlines until max_tokens cuts it off. (vLLM 0.32
            # refuses `disable_any_whitespace` together with `response_format`.)
            extra = dict(body.get("extra_body") or {})
            extra["structured_outputs"] = {"json": scores_schema(count, self.max_explanation_chars),
                                           "disable_any_whitespace": True}
            body["extra_body"] = extra
        elif response_format == "json_object":
            body["response_format"] = {"type": "json_object"}
        return body


# ------------------------------------------------------------------------------------------ the answer


class JudgedScore(BaseModel):
    """One trajectory's verdict. Lenient where judges vary harmlessly (an id given as a number, no
    explanation); `parse_scores` is strict about what matters (every id once, a score in [0, 1])."""

    model_config = ConfigDict(coerce_numbers_to_str=True)

    trajectory_id: str
    explanation: str = ""
    score: float


class Verdict(BaseModel):
    scores: list[JudgedScore]


def scores_schema(count: int, max_explanation_chars: int | None = None) -> dict[str, Any]:
    """The answer's JSON schema, exact for `count` trajectories: a constrained decoder (vLLM's xgrammar)
    cannot then produce a wrong number of scores, an unknown id or a score outside [0, 1]. The explanation
    comes before the score, so that the judge reasons before it commits."""
    explanation: dict[str, Any] = {"type": "string"}
    if max_explanation_chars is not None:
        explanation["maxLength"] = max_explanation_chars
    entry = {
        "type": "object",
        "properties": {
            "trajectory_id": {"type": "string", "enum": [str(number) for number in range(1, count + 1)]},
            "explanation": explanation,
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["trajectory_id", "explanation", "score"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"scores": {"type": "array", "items": entry, "minItems": count, "maxItems": count}},
        "required": ["scores"],
        "additionalProperties": False,
    }


def parse_scores(content: str | None, count: int, *, finish_reason: str | None = None) -> list[JudgedScore]:
    """The judge's scores for trajectories "1".."count", in that order; JudgeError("invalid_output") for
    anything else: no JSON, another shape, an id missing or repeated, a score outside [0, 1].

    >>> [s.score for s in parse_scores('Sure! {"scores": [{"trajectory_id": 2, "score": 0.5}, '
    ...                                '{"trajectory_id": "1", "explanation": "best", "score": 1}]}', 2)]
    [1.0, 0.5]
    """
    verdict = _parse_verdict(content or "", finish_reason)
    by_id = {score.trajectory_id.strip(): score for score in verdict.scores}
    expected = [str(number) for number in range(1, count + 1)]
    if len(verdict.scores) != count or sorted(by_id) != sorted(expected):
        given = [score.trajectory_id for score in verdict.scores]
        raise JudgeError(f"the judge scored trajectories {given}, expected each of {expected} once",
                         code="invalid_output", raw=content)
    for score in verdict.scores:
        if not (math.isfinite(score.score) and 0.0 <= score.score <= 1.0):
            raise JudgeError(f"the judge gave trajectory {score.trajectory_id} the score {score.score}, "
                             "outside [0, 1]", code="invalid_output", raw=content)
    return [by_id[number] for number in expected]


def _parse_verdict(content: str, finish_reason: str | None) -> Verdict:
    """The JSON object in the answer: all of it, else from its first `{` to its last `}` (prose or a code
    fence around it, a reasoning model's <think> block before it)."""
    text = _THINKING.sub("", content).strip()
    candidates = [text]
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end and (start, end) != (0, len(text) - 1):
        candidates.append(text[start:end + 1])
    error: ValidationError | None = None
    for candidate in candidates:
        try:
            return Verdict.model_validate_json(candidate)
        except ValidationError as exc:
            error = exc
    cut = " (cut off at max_tokens: raise the judge's max_tokens)" if finish_reason == "length" else ""
    raise JudgeError(f"the judge's answer is not the JSON asked for{cut}: {_first_error(error)}",
                     code="invalid_output", raw=content)


def _first_error(error: ValidationError | None) -> str:
    if error is None:
        return "empty answer"
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}" if where else first["msg"]


# ------------------------------------------------------------------------------------------- the prompt


@dataclass(frozen=True)
class JudgePrompt:
    """The judge's messages for one group, and which numbered conversation each trajectory is."""

    messages: list[dict[str, str]]
    slots: list[int]  # slots[i]: the 0-based number of trajectory i's (distinct) conversation
    count: int  # distinct conversations: the number of scores the judge gives


def build_prompt(conversations: Sequence[Sequence[Message]], rubric: str | None = None) -> JudgePrompt:
    """The judge's system prompt (instructions, rubric, answer format) and user message (the task, then
    each distinct conversation after it, numbered from 1)."""
    rendered = [tuple(render_message(message) for message in conversation) for conversation in conversations]
    numbers: dict[tuple[str, ...], int] = {}
    slots = [numbers.setdefault(conversation, len(numbers)) for conversation in rendered]
    distinct = list(numbers)
    shared = _task_length(conversations[0], distinct) if conversations else 0
    sections = []
    if shared:
        sections.append("<task>\n" + "\n\n".join(distinct[0][:shared]) + "\n</task>")
    for number, conversation in enumerate(distinct, start=1):
        body = "\n\n".join(conversation[shared:]) or "(nothing: it ended without an answer)"
        sections.append(f'<trajectory id="{number}">\n{body}\n</trajectory>')
    sections.append(f"Score each of the {len(distinct)} trajectories.")
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT.format(rubric=(rubric or DEFAULT_RUBRIC).strip())},
        {"role": "user", "content": "\n\n".join(sections)},
    ]
    return JudgePrompt(messages=messages, slots=slots, count=len(distinct))


def _task_length(first: Sequence[Message], distinct: list[tuple[str, ...]]) -> int:
    """How many leading messages every conversation shares, up to the first assistant turn: the task.
    `first` is the first trajectory's conversation, `distinct[0]` its rendering."""
    length = 0
    for index, message in enumerate(first):
        if message.get("role") == "assistant" or any(
                len(conversation) <= index or conversation[index] != distinct[0][index] for conversation in distinct):
            break
        length += 1
    return length


def render_message(message: Message) -> str:
    """One message as the judge reads it: `[role]`, its text, its tool calls. Token ids, logprobs and other
    wire fields are left out: they cost tokens and say nothing to a judge."""
    role = str(message.get("role") or message.get("type") or "message")
    if role == "tool" and message.get("tool_call_id"):
        header = f"[tool result for {message['tool_call_id']}]"
    else:
        header = f"[{role}: {message['name']}]" if message.get("name") else f"[{role}]"
    lines = [header]
    text = _text(message.get("content"))
    if text:
        lines.append(text)
    for call in message.get("tool_calls") or []:
        function = (call.get("function") or {}) if isinstance(call, Mapping) else {}
        lines.append(f"-> calls {function.get('name')}({function.get('arguments', '')})")
    if len(lines) == 1 and "role" not in message:  # a Responses item such as a function_call: show its fields
        rest = {key: value for key, value in message.items() if key not in ("type", "token_ids", "logprobs")}
        lines.append(orjson.dumps(rest, default=str).decode())
    return "\n".join(lines)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_part_text(part) for part in content)
    return orjson.dumps(content, default=str).decode()


def _part_text(part: Any) -> str:
    if isinstance(part, Mapping):
        if isinstance(part.get("text"), str):
            return str(part["text"])
        return f"[{part.get('type', 'part')}]"  # an image or a file: named, not shown
    return str(part)


async def conversation_of(trajectory: Trajectory) -> list[dict[str, Any]]:
    """What the judge sees of one trajectory. Recorded: the prompt messages of its last completion and the
    decoded answer (in a multi-turn rollout that prompt holds every earlier turn). Offline: its messages."""
    if not trajectory.recorded:
        return trajectory.messages()
    backend = trajectory._require_recording().backend
    try:
        view = await backend.view_trajectory(trajectory.id)
    except (APIError, APIConnectionError) as error:
        raise JudgeError(f"could not read {trajectory!r} from the server: {error}",
                         code="trajectory_unavailable") from error
    if not view.completions:
        raise JudgeError(f"the server shows no completion for {trajectory!r}", code="trajectory_unavailable")
    last = max(view.completions, key=lambda completion: completion.id)
    return [*last.messages, {"role": "assistant", **last.response}]


# -------------------------------------------------------------------------------------------- the cache


class _AnswerCache:
    """Validated answers by `Judge.cache_key`: an LRU in memory and, with a directory, one JSON file per
    key. A file is written to a temporary name and renamed into place, so processes sharing the directory
    never read half a file; an unreadable file is a miss."""

    def __init__(self, size: int, directory: Path | None) -> None:
        self.size = size
        self.directory = directory
        self.memory: OrderedDict[str, list[JudgedScore]] = OrderedDict()

    async def get(self, key: str) -> list[JudgedScore] | None:
        if key in self.memory:
            self.memory.move_to_end(key)
            return self.memory[key]
        if self.directory is None:
            return None
        scores = await asyncio.to_thread(self._read, self.directory / f"{key}.json")
        if scores is not None:
            self._remember(key, scores)
        return scores

    async def put(self, key: str, scores: list[JudgedScore]) -> None:
        self._remember(key, scores)
        if self.directory is not None:
            await asyncio.to_thread(self._write, self.directory, key, scores)

    def _remember(self, key: str, scores: list[JudgedScore]) -> None:
        if self.size == 0:
            return
        self.memory[key] = scores
        self.memory.move_to_end(key)
        while len(self.memory) > self.size:
            self.memory.popitem(last=False)

    @staticmethod
    def _read(path: Path) -> list[JudgedScore] | None:
        try:
            return Verdict.model_validate_json(path.read_bytes()).scores
        except FileNotFoundError:
            return None
        except (OSError, ValidationError) as error:
            logger.warning("artlike: ignoring unreadable judge cache file %s: %s", path, error)
            return None

    @staticmethod
    def _write(directory: Path, key: str, scores: list[JudgedScore]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        temporary = directory / f".{key}.{uuid.uuid4().hex}.tmp"
        temporary.write_bytes(Verdict(scores=scores).model_dump_json().encode())
        os.replace(temporary, directory / f"{key}.json")


# ------------------------------------------------------------------------------------ asking the judge


async def ask_judge(
    judge: Judge, client: openai.AsyncOpenAI, prompt: JudgePrompt, *, cache: bool = True, retries: int = 1
) -> tuple[list[JudgedScore], bool]:
    """The judge's scores for the prompt's conversations and whether they came from the cache. An answer
    that is not valid, or a failed request, is asked again up to `retries` times; only valid answers are
    cached."""
    key = judge.cache_key(prompt.messages, prompt.count)
    if cache and (hit := await judge._cache.get(key)) is not None:
        return hit, True
    for attempt in range(retries + 1):
        try:
            scores = await _ask_once(judge, client, prompt)
            break
        except JudgeError as error:
            error.attempts = attempt + 1
            if not error.retryable or attempt == retries:
                raise
            logger.info("artlike: judging attempt %d of %d failed, asking again: %s", attempt + 1, retries + 1, error)
    if cache:
        await judge._cache.put(key, scores)
    return scores, False


async def _ask_once(judge: Judge, client: openai.AsyncOpenAI, prompt: JudgePrompt) -> list[JudgedScore]:
    import openai

    mode: ResponseFormat = judge.response_format
    if mode == "auto":
        mode = "text" if judge._schema_rejected else "json_schema"
    try:
        completion = await _complete(judge, client, prompt, mode)
    except (openai.BadRequestError, openai.UnprocessableEntityError) as error:
        if judge.response_format != "auto" or mode != "json_schema":
            raise _api_error(judge, error) from error
        completion = await _complete(judge, client, prompt, "text")  # raises if the judge refuses this too
        judge._schema_rejected = True  # only now: a 400 for another reason (a prompt too long) fails again
        logger.warning("artlike: judge %r rejected response_format json_schema (%s); asking it for JSON in "
                       "plain text from now on", judge.model, error)
    if not completion.choices:
        raise JudgeError("the judge answered with no choices", code="invalid_output")
    choice = completion.choices[0]
    return parse_scores(choice.message.content, prompt.count, finish_reason=choice.finish_reason)


async def _complete(judge: Judge, client: openai.AsyncOpenAI, prompt: JudgePrompt,
                    mode: ResponseFormat) -> openai.types.chat.ChatCompletion:
    import openai

    try:
        completion: openai.types.chat.ChatCompletion = await client.chat.completions.create(
            **judge.request_body(prompt.messages, prompt.count, mode))
    except (openai.BadRequestError, openai.UnprocessableEntityError):
        raise  # the caller decides: a rejected schema falls back to text
    except openai.APIError as error:
        raise _api_error(judge, error) from error
    return completion


def _api_error(judge: Judge, error: openai.APIError) -> JudgeError:
    import openai

    status = getattr(error, "status_code", None)
    if isinstance(error, openai.AuthenticationError | openai.PermissionDeniedError | openai.NotFoundError):
        return JudgeError(f"judge {judge.model!r} cannot be used ({status}): {error}", code="judge_unavailable")
    retryable = not isinstance(error, openai.BadRequestError | openai.UnprocessableEntityError)
    where = f" ({status})" if status else ""
    return JudgeError(f"the request to judge {judge.model!r} failed{where}: {error}", code="api_error",
                      retryable=retryable)


# ------------------------------------------------------------------------------------------ the results


def _judged_copy(trajectory: Trajectory, score: JudgedScore, judge: Judge, cached: bool) -> Trajectory:
    """A copy whose reward is the judge's score; the earlier reward stays as metrics["independent_reward"]
    (kept from a first judging when a group is judged again)."""
    judged = _copy(trajectory)
    already_judged = "judge_score" in trajectory.metadata  # its reward is a judge's: the original is kept already
    if trajectory.reward is not None and not already_judged:
        judged.metrics["independent_reward"] = float(trajectory.reward)
    judged.reward = score.score
    judged.metadata.update(judge_model=judge.model, judge_score=score.score,
                           judge_explanation=score.explanation, judge_cached=cached)
    judged.metadata.pop("judge_error", None)
    return judged


def _copy(trajectory: Trajectory) -> Trajectory:
    """A shallow copy with its own metrics and metadata; the recording (id, URL) is shared."""
    duplicate = copy.copy(trajectory)
    duplicate.metrics = dict(trajectory.metrics)
    duplicate.metadata = dict(trajectory.metadata)
    duplicate._sync_clients, duplicate._async_clients = [], []
    return duplicate


def _split(group: TrajectoryGroup | Iterable[Trajectory]) -> tuple[list[Trajectory], list[Exception]]:
    """The trajectories to judge, and the failures that ride along in the new group's `exceptions`."""
    if isinstance(group, TrajectoryGroup) and group.pending:
        raise ValueError(f"{group!r} has rollouts still pending: run art.gather_trajectory_groups first")
    trajectories = list(group)
    failures = [*(group.exceptions if isinstance(group, TrajectoryGroup) else [])]
    failures += [t.exception for t in trajectories if t.exception is not None]
    return [t for t in trajectories if not t.failed], failures


async def _judge_one(group: TrajectoryGroup | Iterable[Trajectory], judge: Judge, client: openai.AsyncOpenAI,
                     rubric: str | None, cache: bool, retries: int) -> TrajectoryGroup:
    trajectories, failures = _split(group)
    if not trajectories:
        return TrajectoryGroup([], exceptions=failures)
    conversations = await asyncio.gather(*(conversation_of(t) for t in trajectories))
    prompt = build_prompt(conversations, rubric)
    scores, cached = await ask_judge(judge, client, prompt, cache=cache, retries=retries)
    judged = [_judged_copy(t, scores[slot], judge, cached) for t, slot in zip(trajectories, prompt.slots, strict=True)]
    return TrajectoryGroup(judged, exceptions=failures)


def _unjudged(group: TrajectoryGroup, error: JudgeError) -> TrajectoryGroup:
    """on_failure="keep": the group with its own rewards, the failure noted on each trajectory."""
    trajectories, failures = _split(group)
    kept = [_copy(t) for t in trajectories]
    for trajectory in kept:
        trajectory.metadata["judge_error"] = str(error)
    return TrajectoryGroup(kept, exceptions=failures)


# ---------------------------------------------------------------------------------------- the public API


def _check_retries(retries: int) -> None:
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")


@overload
async def judge_group(group: TrajectoryGroup | Iterable[Trajectory], judge: Judge, rubric: str | None = None, *,
                      cache: bool = True, retries: int = 1, swallow_exceptions: Literal[False] = False
                      ) -> TrajectoryGroup: ...


@overload
async def judge_group(group: TrajectoryGroup | Iterable[Trajectory], judge: Judge, rubric: str | None = None, *,
                      cache: bool = True, retries: int = 1, swallow_exceptions: bool) -> TrajectoryGroup | None: ...


async def judge_group(
    group: TrajectoryGroup | Iterable[Trajectory],
    judge: Judge,
    rubric: str | None = None,
    *,
    cache: bool = True,
    retries: int = 1,
    swallow_exceptions: bool = False,
) -> TrajectoryGroup | None:
    """Score a group's trajectories against each other with `judge`; returns a new group of copies whose
    `reward` is the judge's score in [0, 1] (the input group is left as it was).

    Each copy keeps its earlier reward as `metrics["independent_reward"]` and gets `metadata`
    `judge_explanation`, `judge_score`, `judge_model` and `judge_cached`. Failed trajectories are not judged
    (their exceptions ride along in the new group's `exceptions`). `rubric`: your grading standards
    (default `Judge.DEFAULT_RUBRIC`); `cache=False` neither reads nor fills the judge's cache; `retries`:
    how many times a failed request or an invalid answer is asked again. Raises `JudgeError`, or with
    `swallow_exceptions=True` logs it and returns None, except for a judge that cannot be used at all
    (`code="judge_unavailable"`: wrong key, unknown model), which always raises.
    """
    _check_retries(retries)
    try:
        async with judge.session() as client:
            return await _judge_one(group, judge, client, rubric, cache, retries)
    except JudgeError as error:
        if not swallow_exceptions or error.code == "judge_unavailable":
            raise
        logger.warning("artlike: judging a group failed, returning None: %s", error)
        return None


async def judge_groups(
    groups: Iterable[TrajectoryGroup],
    judge: Judge,
    rubric: str | None = None,
    *,
    concurrency: int = 8,
    on_failure: OnFailure = "drop",
    cache: bool = True,
    retries: int = 1,
    progress: bool = True,
) -> list[TrajectoryGroup]:
    """`judge_group` for many groups, at most `concurrency` judge requests at once, in the groups' order.

    A group whose judging failed (after `retries`) is dropped with a warning (`on_failure="drop"`: training
    on judged and unjudged rewards together would mix two scales), kept with its own rewards and
    `metadata["judge_error"]` (`"keep"`), or raised at once, cancelling the rest (`"raise"`). A judge that
    cannot be used at all (`JudgeError` code "judge_unavailable") always raises.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if on_failure not in ("drop", "keep", "raise"):
        raise ValueError(f"on_failure must be drop, keep or raise, not {on_failure!r}")
    _check_retries(retries)
    groups = list(groups)
    limit = asyncio.Semaphore(concurrency)
    outcomes: list[TrajectoryGroup | JudgeError | None] = [None] * len(groups)

    async def one(index: int, client: openai.AsyncOpenAI) -> tuple[int, TrajectoryGroup | JudgeError]:
        async with limit:
            try:
                return index, await _judge_one(groups[index], judge, client, rubric, cache, retries)
            except JudgeError as error:
                if error.code == "judge_unavailable":
                    raise
                return index, error

    bar = tqdm(total=len(groups), desc="judging", unit="group", disable=not progress)
    try:
        async with judge.session() as client, \
                in_turn_of_finishing(one(index, client) for index in range(len(groups))) as finished:
            for next_done in finished:
                index, outcome = await next_done
                if isinstance(outcome, JudgeError) and on_failure == "raise":
                    raise outcome
                outcomes[index] = outcome
                bar.update(1)
    finally:
        bar.close()
    return _assemble(groups, outcomes, on_failure)


def _assemble(groups: list[TrajectoryGroup], outcomes: list[TrajectoryGroup | JudgeError | None],
              on_failure: OnFailure) -> list[TrajectoryGroup]:
    result: list[TrajectoryGroup] = []
    errors: list[tuple[int, JudgeError]] = []
    for index, (group, outcome) in enumerate(zip(groups, outcomes, strict=True)):
        if isinstance(outcome, TrajectoryGroup):
            result.append(outcome)
        elif isinstance(outcome, JudgeError):
            errors.append((index, outcome))
            if on_failure == "keep":
                result.append(_unjudged(group, outcome))
    if errors:
        action = "kept with their own rewards" if on_failure == "keep" else "dropped"
        details = "; ".join(f"group {index}: {error}" for index, error in errors[:3])
        more = f"; and {len(errors) - 3} more" if len(errors) > 3 else ""
        logger.warning("artlike: judging failed for %d of %d groups (%s): %s%s",
                       len(errors), len(groups), action, details, more)
    return result


@overload
def judge_group_sync(group: TrajectoryGroup | Iterable[Trajectory], judge: Judge, rubric: str | None = None, *,
                     cache: bool = True, retries: int = 1, swallow_exceptions: Literal[False] = False
                     ) -> TrajectoryGroup: ...


@overload
def judge_group_sync(group: TrajectoryGroup | Iterable[Trajectory], judge: Judge, rubric: str | None = None, *,
                     cache: bool = True, retries: int = 1, swallow_exceptions: bool) -> TrajectoryGroup | None: ...


def judge_group_sync(
    group: TrajectoryGroup | Iterable[Trajectory],
    judge: Judge,
    rubric: str | None = None,
    *,
    cache: bool = True,
    retries: int = 1,
    swallow_exceptions: bool = False,
) -> TrajectoryGroup | None:
    """`judge_group` for sync code (not from inside a running event loop)."""
    return asyncio.run(judge_group(group, judge, rubric, cache=cache, retries=retries,
                                   swallow_exceptions=swallow_exceptions))


def judge_groups_sync(
    groups: Iterable[TrajectoryGroup],
    judge: Judge,
    rubric: str | None = None,
    *,
    concurrency: int = 8,
    on_failure: OnFailure = "drop",
    cache: bool = True,
    retries: int = 1,
    progress: bool = True,
) -> list[TrajectoryGroup]:
    """`judge_groups` for sync code (not from inside a running event loop)."""
    return asyncio.run(judge_groups(groups, judge, rubric, concurrency=concurrency, on_failure=on_failure,
                                    cache=cache, retries=retries, progress=progress))
