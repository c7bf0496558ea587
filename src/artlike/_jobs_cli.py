"""`artlike jobs ...`: start, list, show, follow and cancel managed jobs from a shell.

    artlike jobs start --data rows.jsonl --reward reward.py --model BASE [--iterations 20] [-f]
    artlike jobs logs -f ftjob-...        # a progress bar over iterations, reward and loss per step

Connection: --base-url (or ARTLIKE_SERVER, the variable the examples read too; ARTLIKE_BASE_URL is
also accepted; default http://127.0.0.1:8000) and --api-key (or ARTLIKE_API_KEY). An API error prints one line and exits 2; `logs -f` and `start -f` exit 0 when the job
succeeded, 1 when it failed or was cancelled.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import Any

import orjson
from tqdm import tqdm

from ._errors import APIError, ArtlikeError
from ._jobs import Jobs
from .job_types import Job, JobEvent

DEFAULT_SERVER = "http://127.0.0.1:8000"


def default_server(environment: Mapping[str, str]) -> str:
    """`ARTLIKE_SERVER`, the name every example and the docs use; `ARTLIKE_BASE_URL` is read as well."""
    return environment.get("ARTLIKE_SERVER") or environment.get("ARTLIKE_BASE_URL") or DEFAULT_SERVER


def add_parser(commands: Any) -> None:
    jobs = commands.add_parser("jobs", help="managed training jobs: start, list, show, logs, cancel")
    jobs.add_argument("--base-url", default=default_server(os.environ),
                      help="the server (default: ARTLIKE_SERVER, else ARTLIKE_BASE_URL, else %(default)s)")
    jobs.add_argument("--api-key", default=None, help="default: ARTLIKE_API_KEY")
    actions = jobs.add_subparsers(dest="action", metavar="ACTION", required=True)
    start = actions.add_parser("start", help="upload a dataset and start a job")
    start.add_argument("--data", required=True, help="JSONL rows: {'prompt', ...} or {'messages', ...}")
    start.add_argument("--validation-data", help="JSONL rows scored before, during and after training")
    reward = start.add_mutually_exclusive_group()
    reward.add_argument("--reward", help="a .py file defining reward_fn(completion, **kwargs) or grade(sample, item)")
    reward.add_argument("--grader", help="a .json file with a grader (OpenAI's JSON or SeekrFlow's graders)")
    start.add_argument("--model", help="the server's base model or a trainable model (default: the base model)")
    start.add_argument("--method", choices=["reinforcement", "supervised", "dpo"], default="reinforcement")
    for name, kind in (("iterations", int), ("batch-size", int), ("group-size", int), ("learning-rate", float),
                       ("max-tokens", int), ("n-epochs", int), ("eval-interval", int), ("seed", int),
                       ("entropy-coef", float), ("epsilon-high", float), ("clip-cov-fraction", float),
                       ("positive-advantage-weight", float)):
        start.add_argument(f"--{name}", type=kind)
    start.add_argument("--entropy-target", type=float, metavar="NATS",
                       help="hold the sampling entropy near this (nats a token) with an entropy bonus that "
                            "moves after each iteration; -H entropy_control=... sets its step and bound too")
    start.add_argument("--dynamic-sampling", action="store_true", default=None,
                       help="roll out more rows when too few groups' rewards differ")
    start.add_argument("--guide-field", metavar="FIELD",
                       help="a row field with a reference answer, trained with the rows no rollout passes")
    start.add_argument("--hyperparameter", "-H", action="append", default=[], type=_hyperparameter,
                       metavar="NAME=JSON", help="any other hyperparameter, e.g. "
                       "temperature_schedule='{\"start\": 1.2, \"end\": 1.0, \"steps\": 50}' (repeatable)")
    start.add_argument("--suffix")
    start.add_argument("-f", "--follow", action="store_true", help="follow the job until it ends")
    actions.add_parser("list", help="the latest jobs")
    show = actions.add_parser("show", help="one job as JSON")
    show.add_argument("job_id")
    logs = actions.add_parser("logs", help="a job's events")
    logs.add_argument("job_id")
    logs.add_argument("-f", "--follow", action="store_true", help="follow until the job ends, with a progress bar")
    cancel = actions.add_parser("cancel", help="cancel a job (a running one stops after its current step)")
    cancel.add_argument("job_id")


def _describe(job: Job) -> str:
    progress = job.artlike
    where = f"{progress.get('iteration', '?')}/{progress.get('total_iterations', '?')}" if progress else ""
    pending = progress.get("stop_request")  # a cancel or pause waiting for the end of the current step
    return (f"{job.id}  {job.status:<10} {where:>7}  {job.fine_tuned_model or progress.get('target_model', '')}"
            + (f"  ({pending} pending: after the current step)" if pending else ""))


def follow(jobs: Jobs, job_id: str, out: Any = sys.stdout) -> int:
    bar: tqdm[Any] | None = None
    for event in jobs.follow_sync(job_id):
        bar = _show(event, bar, out)
    if bar is not None:
        bar.close()
    job = jobs.get_sync(job_id)
    print(f"{job.id} {job.status}" + (f": {job.fine_tuned_model}" if job.fine_tuned_model else "")
          + (f" ({job.error.message})" if job.error else ""), file=out)
    return 0 if job.status == "succeeded" else 1


def _show(event: JobEvent, bar: tqdm[Any] | None, out: Any) -> tqdm[Any] | None:
    data = event.data or {}
    if event.type == "metrics" and "total_iterations" in data and not data.get("eval"):
        if bar is None:
            bar = tqdm(total=int(data["total_iterations"]), desc="iterations", file=out, dynamic_ncols=True)
        bar.n = int(data["iteration"])
        bar.set_postfix(reward=f"{data.get('reward_mean', 0.0):.3f}", loss=f"{data.get('loss', 0.0):.4f}")
        bar.write(f"iteration {data['iteration']}: reward {data.get('reward_mean', 0.0):.3f}, "
                  f"loss {data.get('loss', 0.0):.4f}", file=out)
        return bar
    line = f"[{event.level}] {event.message}"
    if bar is not None:
        bar.write(line, file=out)
    else:
        print(line, file=out)
    return bar


def _hyperparameter(text: str) -> tuple[str, Any]:
    """`NAME=JSON` (a bare word that is not JSON is a string)."""
    name, separator, value = text.partition("=")
    if not separator or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=JSON, got {text!r}")
    try:
        return name, orjson.loads(value)
    except orjson.JSONDecodeError:
        return name, value


def run(arguments: argparse.Namespace, out: Any = sys.stdout, *, jobs: Jobs | None = None) -> int:
    jobs = jobs or Jobs(arguments.base_url, arguments.api_key)
    try:
        if arguments.action == "start":
            hyper = {k: getattr(arguments, k) for k in ("iterations", "batch_size", "group_size", "learning_rate",
                                                        "max_tokens", "n_epochs", "eval_interval", "entropy_coef",
                                                        "epsilon_high", "clip_cov_fraction",
                                                        "positive_advantage_weight", "dynamic_sampling",
                                                        "guide_field")}
            if arguments.entropy_target is not None:
                hyper["entropy_control"] = {"target": arguments.entropy_target}
            hyper |= dict(arguments.hyperparameter)
            job = jobs.start_sync(data=arguments.data, validation_data=arguments.validation_data,
                                  reward=arguments.reward, grader=arguments.grader,
                                  model=arguments.model or jobs.base_model_sync(), method=arguments.method,
                                  suffix=arguments.suffix, seed=arguments.seed,
                                  **{k: v for k, v in hyper.items() if v is not None})
            print(f"started {_describe(job)}", file=out)
            return follow(jobs, job.id, out) if arguments.follow else 0
        if arguments.action == "list":
            for job in jobs.list_sync(limit=50):
                print(_describe(job), file=out)
            return 0
        if arguments.action == "show":
            print(jobs.get_sync(arguments.job_id).model_dump_json(indent=2), file=out)
            return 0
        if arguments.action == "logs":
            if arguments.follow:
                return follow(jobs, arguments.job_id, out)
            for event in reversed(jobs.events_sync(arguments.job_id, limit=1000)):
                _show(event, None, out)
            return 0
        job = jobs.cancel_sync(arguments.job_id)
        print(_describe(job), file=out)
        return 0
    except APIError as error:
        print(f"artlike jobs: {error.status_code} {error.code or error.type}: {error.message}", file=sys.stderr)
        return 2
    except (ArtlikeError, ValueError, OSError) as error:
        print(f"artlike jobs: {error}", file=sys.stderr)
        return 2
    finally:
        jobs.close()
