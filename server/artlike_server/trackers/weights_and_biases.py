"""Weights & Biases (`--wandb-project`): one W&B run per trainable model, resumed across server restarts (its
id is the model's name), with every step's history-line metrics, evaluations (`eval/*`), managed jobs' train
configs (`config["jobs"][job id]`), alias moves and exports.

Metrics are plotted against the model's step (`step`, W&B's `define_metric`), not W&B's own row counter, so an
evaluation of an older step lands at that step. W&B's own environment applies (WANDB_MODE=offline, WANDB_DIR,
WANDB_API_KEY, ...). The library is imported only when the option is set; it does not import torch.
"""

from __future__ import annotations

import re
from typing import Any

from .base import step_scalars

STEP_METRICS = ("reward*", "loss", "kl", "entropy", "grad_norm", "clip_fraction", "logprob_mismatch",
                "groups_skipped", "trainable_tokens", "train_seconds", "swap_seconds", "tokens_per_second",
                "zero_variance_fraction", "groups_all_wrong", "groups_mixed", "groups_all_right", "pass_rate",
                "response_tokens_mean", "sampling_entropy", "kl_to_base",
                "metrics/*", "objective/*", "eval/*", "alias/step", "config/*")


class WandbTracker:
    def __init__(self, project: str, *, entity: str | None = None, run_name_prefix: str = "") -> None:
        import wandb  # the optional dependency, imported only when asked for

        self._wandb = wandb
        self.project, self.entity, self.prefix = project, entity, run_name_prefix
        self._runs: dict[str, Any] = {}

    def run_id(self, model: str) -> str:
        """The model's run id: W&B ids may not hold / \\ # ? % or :, model names may."""
        return re.sub(r"[^A-Za-z0-9_.-]", "-", f"{self.prefix}{model}")

    def step(self, model: str, entry: dict[str, Any]) -> None:
        self._log(model, entry["step"], dict(step_scalars(entry)))

    def evaluation(self, model: str, entry: dict[str, Any]) -> None:
        self._log(model, entry["step"], dict(step_scalars(entry)))

    def train_config(self, model: str, job_id: str, config: dict[str, Any]) -> None:
        self._run(model).config.update({"jobs": {job_id: config}}, allow_val_change=True)

    def alias_moved(self, model: str, step: int, reason: str) -> None:
        run = self._run(model)
        run.log({"step": step, "alias/step": step})
        run.summary.update({"alias/step": step, "alias/reason": reason})

    def exported(self, model: str, step: int, format: str, path: str) -> None:
        self._run(model).summary.update({f"export/step{step}/{format}": path})

    def close(self) -> None:
        runs, self._runs = list(self._runs.values()), {}
        for run in runs:
            run.finish()

    def _log(self, model: str, step: int, values: dict[str, float]) -> None:
        if values:
            self._run(model).log({"step": step, **values})  # each call its own row: written at once

    def _run(self, model: str) -> Any:
        run = self._runs.get(model)
        if run is None:
            run = self._wandb.init(
                project=self.project, entity=self.entity, id=self.run_id(model), name=f"{self.prefix}{model}",
                resume="allow", reinit="create_new", config={"model": model},
                # the server's own output is its log, not the run's; the machine's stats are not the model's
                settings=self._wandb.Settings(console="off", x_disable_stats=True, disable_git=True,
                                              save_code=False, silent=True))
            run.define_metric("step", hidden=True)
            for pattern in STEP_METRICS:
                run.define_metric(pattern, step_metric="step")
            self._runs[model] = run
        return run
