"""Trajectories (one rollout, rewarded) and trajectory groups (rollouts of one task, compared by GRPO).

A trajectory is either
- recorded: made by `model.trajectory()`. Its id is in `base_url` (`{server}/t/{id}/v1`), so every
  completion any OpenAI client makes through that URL is recorded by the server, token-exact. Training
  sends only `{trajectory_id, reward, metrics}`.
- offline: `Trajectory(messages_and_choices=[...], reward=...)` from messages the server never saw.
  Items are message dicts, `ChatCompletionMessage`s or `Choice`s (a Choice that carries vLLM's
  `token_ids` and logprobs is trained on exactly those tokens, with those behaviour logprobs).

Used as a context manager (`async with` or `with`), a trajectory catches an `Exception` raised in its
block: `t.exception` is set and `t.failed` is True, and the code after the block goes on, so one broken
rollout does not lose its whole group. Failed trajectories never train; `gather_trajectory_groups`
counts them against `max_exceptions` (by default it raises the first one).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from inspect import isawaitable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeAlias
from uuid import uuid4

from ._backend import Backend
from ._syncify import syncify
from .types import OfflineTrajectory, TrajectoryRecord, TrajectoryRef

if TYPE_CHECKING:
    # `import openai` is slow on a small CPU; only rollouts need it, so it is imported where used.
    import openai
    from openai.types.chat import ChatCompletionMessage
    from openai.types.chat.chat_completion import Choice

__all__ = ["MessageOrChoice", "Trajectory", "TrajectoryGroup", "choice_to_message"]

logger = logging.getLogger("artlike")

MessageOrChoice: TypeAlias = "Mapping[str, Any] | ChatCompletionMessage | Choice"
# The openai SDK refuses to build a client without a key; a server without auth ignores it.
PLACEHOLDER_API_KEY = "artlike"


def choice_to_message(choice: Choice) -> dict[str, Any]:
    """The assistant message of a chat completion choice, with vLLM's sampled `token_ids` and their
    `logprobs` when the response carried them (`return_token_ids` and `logprobs` requested)."""
    message: dict[str, Any] = {"role": "assistant", "content": choice.message.content}
    if choice.message.tool_calls:
        message["tool_calls"] = [call.model_dump(mode="json", exclude_none=True) for call in choice.message.tool_calls]
    token_ids = (choice.model_extra or {}).get("token_ids")
    if token_ids is None:
        return message
    message["token_ids"] = list(token_ids)
    if choice.logprobs is not None and choice.logprobs.content is not None:
        logprobs = [entry.logprob for entry in choice.logprobs.content]
        if len(logprobs) != len(token_ids):
            raise ValueError(
                f"choice {choice.index} has {len(token_ids)} token_ids but {len(logprobs)} logprobs; "
                "they must describe the same sampled tokens"
            )
        message["logprobs"] = logprobs
    return message


def _to_message(item: MessageOrChoice) -> dict[str, Any]:
    if isinstance(item, Mapping):
        return dict(item)
    from openai.types.chat import ChatCompletionMessage
    from openai.types.chat.chat_completion import Choice

    if isinstance(item, Choice):
        return choice_to_message(item)
    if isinstance(item, ChatCompletionMessage):
        return item.model_dump(mode="json", exclude_none=True)
    raise TypeError(f"messages_and_choices items are message dicts, ChatCompletionMessage or Choice, not {type(item)!r}")


@dataclass(frozen=True)
class _Recording:
    id: str
    base_url: str
    model: str
    backend: Backend


class Trajectory:
    """One rollout and its reward. See the module docstring for recorded vs offline trajectories."""

    def __init__(
        self,
        messages_and_choices: Sequence[MessageOrChoice] | None = None,
        *,
        reward: float | None = None,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self.messages_and_choices: list[MessageOrChoice] = list(messages_and_choices or [])
        self.tools = tools
        self.reward = reward  # None until scored: training refuses it, unless PPO's reward_model scores it
        self.metrics: dict[str, float] = dict(metrics or {})
        self.metadata: dict[str, Any] = dict(metadata or {})  # yours; never sent to the server
        self.exception: Exception | None = None
        self._recording: _Recording | None = None  # set for trajectories made by model.trajectory()
        self._sync_clients: list[openai.OpenAI] = []  # closed when the block ends
        self._async_clients: list[openai.AsyncOpenAI] = []

    @classmethod
    def _recorded(cls, backend: Backend, model: str, metadata: Mapping[str, Any] | None = None) -> Trajectory:
        trajectory = cls(metadata=metadata)
        trajectory_id = uuid4().hex  # matches types.TRAJECTORY_ID_PATTERN
        trajectory._recording = _Recording(
            id=trajectory_id, base_url=f"{backend.connection.base_url}/t/{trajectory_id}/v1", model=model,
            backend=backend,
        )
        return trajectory

    @property
    def failed(self) -> bool:
        return self.exception is not None

    @property
    def recorded(self) -> bool:
        """True when the server records this trajectory's completions (made by `model.trajectory()`)."""
        return self._recording is not None

    # The recorded trajectory's coordinates; an offline trajectory has none and raises RuntimeError.

    @property
    def id(self) -> str:
        return self._require_recording().id

    @property
    def base_url(self) -> str:
        """`{server}/t/{id}/v1`: give it to any OpenAI-compatible client."""
        return self._require_recording().base_url

    @property
    def model(self) -> str:
        """The trainable model's name (its latest step): pass it as `model=` to your client."""
        return self._require_recording().model

    @property
    def api_key(self) -> str:
        """The key to give any OpenAI-compatible client (a placeholder when the server needs none)."""
        return self._require_recording().backend.connection.api_key or PLACEHOLDER_API_KEY

    # -------------------------------------------------------------------------------- OpenAI clients

    def openai_client(self, **kwargs: Any) -> openai.OpenAI:
        """An `openai.OpenAI` client on this trajectory's `base_url` (closed when the `with` block ends)."""
        import openai

        client = openai.OpenAI(**self._client_options(kwargs, openai.DefaultHttpxClient))
        self._sync_clients.append(client)
        return client

    def async_openai_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        """An `openai.AsyncOpenAI` client on this trajectory's `base_url` (closed when `async with` ends)."""
        import openai

        client = openai.AsyncOpenAI(**self._client_options(kwargs, openai.DefaultAsyncHttpxClient))
        self._async_clients.append(client)
        return client

    def _client_options(self, overrides: dict[str, Any], http_client: type) -> dict[str, Any]:
        connection = self._require_recording().backend.connection
        options: dict[str, Any] = {
            "base_url": self.base_url,
            "api_key": self.api_key,
            "max_retries": connection.retry.max_retries,
        }
        if "http_client" not in overrides:
            # A shared SSL context makes a client cheap to build: building the context is the costly part.
            options["http_client"] = http_client(verify=connection.ssl_context)
        return options | overrides

    # ---------------------------------------------------------------------------------- the record

    async def get_record(self) -> TrajectoryRecord:
        """What the server recorded for this trajectory: every completion, token-exact."""
        recording = self._require_recording()
        return await recording.backend.get_trajectory(recording.id)

    get_record_sync = syncify(get_record)

    def messages(self) -> list[dict[str, Any]]:
        """`messages_and_choices` as plain chat messages (offline trajectories)."""
        return [_to_message(item) for item in self.messages_and_choices]

    def _require_recording(self) -> _Recording:
        if self._recording is None:
            raise RuntimeError("an offline trajectory has no id or base_url: create one with model.trajectory()")
        return self._recording

    def _to_wire(self, *, reward_required: bool = True) -> TrajectoryRef | OfflineTrajectory:
        """The training request's form of this trajectory; raises ValueError when it cannot train.
        `reward_required=False`: a reward model scores it (PPO with a `reward_model`), so None may go."""
        if self.exception is not None:
            raise ValueError(f"{self!r} failed ({self.exception!r}) and cannot be trained on")
        if self.reward is None and reward_required:
            raise ValueError(f"{self!r} has no reward: set `t.reward` before training (or train with "
                             "objective='ppo' and a reward_model that scores it)")
        if self._recording is not None:
            if self.messages_and_choices:
                raise ValueError(
                    f"{self!r} is recorded by the server, which trains on the recorded completions; "
                    "messages_and_choices is for offline trajectories, Trajectory(messages_and_choices=...)"
                )
            return TrajectoryRef(trajectory_id=self._recording.id, reward=self.reward, metrics=self.metrics)
        return OfflineTrajectory(messages=self.messages(), tools=self.tools, reward=self.reward, metrics=self.metrics)

    # ------------------------------------------------------------------------------ context manager

    def __enter__(self) -> Trajectory:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        self._close_sync_clients()  # async clients cannot be closed from sync code: use `async with` for them
        return self._capture(exc)

    async def __aenter__(self) -> Trajectory:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        self._close_sync_clients()
        clients, self._async_clients = self._async_clients, []
        for client in clients:
            await client.close()
        return self._capture(exc)

    def _close_sync_clients(self) -> None:
        clients, self._sync_clients = self._sync_clients, []
        for client in clients:
            client.close()

    def _capture(self, exc: BaseException | None) -> bool:
        # Only Exceptions: cancellation, KeyboardInterrupt and SystemExit must keep propagating.
        if not isinstance(exc, Exception):
            return False
        self.exception = exc
        logger.info("%r failed: %r", self, exc)
        return True

    def __repr__(self) -> str:
        recording = self._recording
        kind = f"id={recording.id!r}" if recording else f"offline, {len(self.messages_and_choices)} messages"
        failed = f", failed={self.exception!r}" if self.exception is not None else ""
        return f"Trajectory({kind}, reward={self.reward!r}{failed})"


class TrajectoryGroup:
    """Trajectories of one task, compared with each other by GRPO (advantage = reward - group mean).

    Takes finished trajectories and/or awaitables that return one (e.g. `rollout(task)` coroutines);
    `gather_trajectory_groups` runs the awaitables.
    """

    def __init__(
        self,
        trajectories: Iterable[Trajectory | Awaitable[Trajectory]] = (),
        *,
        exceptions: Iterable[Exception] = (),
    ) -> None:
        self.trajectories: list[Trajectory] = []
        self.pending: list[Awaitable[Trajectory]] = []
        for item in trajectories:
            if isinstance(item, Trajectory):
                self.trajectories.append(item)
            elif isawaitable(item):
                self.pending.append(item)
            else:
                raise TypeError(f"a TrajectoryGroup holds Trajectory objects or awaitables of one, not {type(item)!r}")
        self.exceptions: list[Exception] = list(exceptions)  # rollouts of this group that failed

    @property
    def rewards(self) -> list[float | None]:
        return [trajectory.reward for trajectory in self.trajectories]

    def __len__(self) -> int:
        return len(self.trajectories) + len(self.pending)

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(self.trajectories)

    def __repr__(self) -> str:
        pending = f", {len(self.pending)} pending" if self.pending else ""
        failed = f", {len(self.exceptions)} failed" if self.exceptions else ""
        return f"TrajectoryGroup({len(self.trajectories)} trajectories{pending}{failed}, rewards={self.rewards})"
