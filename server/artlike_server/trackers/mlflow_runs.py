"""MLflow (`--mlflow-tracking-uri`): one MLflow run per trainable model in one experiment, found again after a
restart by its `artlike.model` tag, with every step's history-line metrics at that step (the reward's mean as
`reward/mean`), evaluations (`eval/*`), managed jobs' train configs as params (`<job id>/<key>`), alias moves
(the `alias/step` metric and tags) and exports (an `export/step<N>/<format>` tag).

Written through `MlflowClient` (no fluent API: its active run is global, one per thread, and a server tracks
many models at once). The library is imported only when the option is set; it does not import torch.
"""

from __future__ import annotations

import json
import time
from typing import Any

from .base import step_scalars

MODEL_TAG = "artlike.model"
MAX_RUNS = 50_000  # the runs read at start (MLflow's most per search)
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param's value
# A file store keeps each metric as a file at its name's path, so no name may also be another's folder:
# the reward's mean is `reward/mean` beside `reward/std`.
RENAMED = {"reward": "reward/mean"}


class MlflowTracker:
    def __init__(self, tracking_uri: str, experiment: str) -> None:
        # the optional dependency, imported only when asked for
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient

        self._metric, self._param, self._tag = Metric, Param, RunTag
        self.client = MlflowClient(tracking_uri=tracking_uri)
        # At start: a tracking URI MLflow refuses (or cannot reach) fails the server's start, not a step.
        found = self.client.get_experiment_by_name(experiment)
        self.experiment_id: str = found.experiment_id if found else self.client.create_experiment(experiment)
        self._runs: dict[str, str] = {}  # model -> run id, read once: a model's run goes on after a restart
        self._known = {run.data.tags[MODEL_TAG]: run.info.run_id for run in reversed(self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{MODEL_TAG}` != ''", max_results=MAX_RUNS,
            order_by=["attributes.start_time DESC"]))}

    def run_id(self, model: str) -> str:
        run_id = self._runs.get(model)
        if run_id is None:
            run_id = self._known.get(model)
            if run_id is not None:
                self.client.update_run(run_id, status="RUNNING")
            else:
                run_id = self.client.create_run(self.experiment_id, run_name=model,
                                                tags={MODEL_TAG: model}).info.run_id
            self._runs[model] = run_id
        return run_id

    def step(self, model: str, entry: dict[str, Any]) -> None:
        self._log(model, entry["step"], entry.get("time"), dict(step_scalars(entry)))

    def evaluation(self, model: str, entry: dict[str, Any]) -> None:
        self._log(model, entry["step"], entry.get("time"), dict(step_scalars(entry)))

    def train_config(self, model: str, job_id: str, config: dict[str, Any]) -> None:
        params = [self._param(f"{job_id}/{key}", _param_value(value)) for key, value in sorted(config.items())]
        self.client.log_batch(self.run_id(model), params=params)

    def alias_moved(self, model: str, step: int, reason: str) -> None:
        self.client.log_batch(self.run_id(model), metrics=[self._metric("alias/step", step, _ms(None), step)],
                              tags=[self._tag("alias.step", str(step)), self._tag("alias.reason", reason)])

    def exported(self, model: str, step: int, format: str, path: str) -> None:
        self.client.set_tag(self.run_id(model), f"export/step{step}/{format}", path)

    def close(self) -> None:
        runs, self._runs = list(self._runs.values()), {}
        for run_id in runs:
            self.client.set_terminated(run_id)

    def _log(self, model: str, step: int, when: float | None, values: dict[str, float]) -> None:
        if values:
            timestamp = _ms(when)
            metrics = [self._metric(metric_name(key), value, timestamp, step) for key, value in values.items()]
            self.client.log_batch(self.run_id(model), metrics=metrics)


def metric_name(tag: str) -> str:
    """The MLflow name of a `step_scalars` tag."""
    return RENAMED.get(tag, tag)


def _ms(when: float | None) -> int:
    return int((time.time() if when is None else when) * 1000)


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text[:MAX_PARAM_CHARS]
