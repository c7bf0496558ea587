"""The public surface of `import artlike`: the export list, its types, and that importing it stays light."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import artlike
from artlike._cli import INSTALL_SERVER_HINT, main

EXPECTED_EXPORTS = {
    # the workflow
    "TrainableModel", "Trajectory", "TrajectoryGroup", "gather_trajectory_groups", "choice_to_message",
    "RetryPolicy", "__version__", "best_of_groups", "preference_pairs", "score", "score_sync",
    "Judge", "judge_group", "judge_group_sync", "judge_groups", "judge_groups_sync",
    "PipelineTrainer", "PipelineStep", "PipelineResult", "DynamicSampling", "EntropyControl", "PassRateCurriculum", "RetryFailedGroups", "CurriculumSampler",
    "Schedule", "rollout_temperature",
    # low-level primitives
    "TrainingSession", "Jobs", "Job", "JobEvent", "Checkpoint", "AdamParams", "PassResult", "OptimStepResult", "SavedState", "SessionInfo", "SessionSequence",
    # wire types users read or build
    "LoraConfig", "TrainConfig", "GRPOConfig", "CISPOConfig", "GSPOConfig", "SFTConfig", "DPOConfig",
    "PPOConfig", "RewardModelConfig", "RewardHeadConfig", "ScoredExample", "RewardScore",
    "ModelInfo", "StepInfo", "TrajectoryRecord", "StepRetention", "KeepBest",
    # the train stream
    "STREAM_VERSION", "TrainEvent", "StartEvent", "StatusEvent", "StepEvent", "DoneEvent", "ErrorEvent",
    "UnknownEvent", "TrainResult", "TrainStream", "parse_event", "NoSignalWarning",
    # errors
    "ArtlikeError", "APIError", "BadRequestError", "AuthenticationError", "NotFoundError", "ConflictError",
    "PayloadTooLargeError", "ServiceUnavailableError", "InternalServerError", "APIConnectionError",
    "APITimeoutError", "TrainingError", "JudgeError",
}
# The client must install and import without the server stack. openai is slow to import and only needed
# once a rollout builds a client, so it is imported lazily too.
MUST_NOT_IMPORT = ["torch", "vllm", "fastapi", "starlette", "uvicorn", "transformers", "artlike_server", "openai"]


def test_all_is_the_expected_list_and_every_name_resolves() -> None:
    assert sorted(artlike.__all__) == sorted(EXPECTED_EXPORTS)
    assert len(artlike.__all__) == len(set(artlike.__all__))
    for name in artlike.__all__:
        assert getattr(artlike, name) is not None, name


def test_errors_form_the_documented_tree() -> None:
    status_errors = [artlike.BadRequestError, artlike.AuthenticationError, artlike.NotFoundError,
                     artlike.ConflictError, artlike.PayloadTooLargeError, artlike.ServiceUnavailableError,
                     artlike.InternalServerError]
    for error in status_errors:
        assert issubclass(error, artlike.APIError)
    for error in (artlike.APIError, artlike.APIConnectionError, artlike.TrainingError):
        assert issubclass(error, artlike.ArtlikeError)
    assert issubclass(artlike.APITimeoutError, artlike.APIConnectionError)
    assert not issubclass(artlike.TrainingError, artlike.APIError)


def test_package_is_marked_typed() -> None:
    assert (Path(artlike.__file__).parent / "py.typed").is_file()


def test_version_is_the_installed_distributions() -> None:
    assert artlike.__version__ == version("artlike")


def test_import_artlike_leaves_the_server_stack_unimported() -> None:
    code = (
        "import json, sys, artlike\n"
        "artlike.TrainableModel('m', 'base', 'http://127.0.0.1:1').trajectory()\n"
        f"print(json.dumps([name for name in {MUST_NOT_IMPORT!r} if name in sys.modules]))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(result.stdout) == []


def test_cli_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"artlike {artlike.__version__}"


def test_cli_serve_without_the_server_says_how_to_install_it() -> None:
    # `sys.modules[name] = None` is Python's own way to make `import name` fail as if it were absent.
    code = "import sys; sys.modules['artlike_server'] = None; from artlike._cli import main; sys.exit(main(['serve']))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 2
    assert INSTALL_SERVER_HINT in result.stderr
