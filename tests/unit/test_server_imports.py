"""The server process stays light: torch is the trainer worker's, never the proxy's (memory, start-up time and
a smaller heap for the garbage collector on the request path)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_the_server_app_does_not_import_torch() -> None:
    check = "import sys, artlike_server.app, artlike_server.cli; print(sorted({'torch', 'transformers', 'peft'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_loading_the_tokenizer_for_offline_trajectories_does_not_import_torch() -> None:
    check = ("import sys; from artlike_server.default_model import ensure_default_model; "
             "from artlike_server.tokenizer import load_chat_tokenizer; "
             "tokenizer = load_chat_tokenizer(ensure_default_model()); "
             "assert tokenizer.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=True); "
             "print(sorted({'torch', 'peft'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout + result.stderr


def test_writing_tensorboard_files_does_not_import_torch(tmp_path: object) -> None:
    # tensorboardX imports torch whenever it is installed; TensorBoard's own writer does not.
    check = ("import sys, pathlib; from artlike_server.trackers.tensorboard import TensorBoardLog; "
             f"log = TensorBoardLog(pathlib.Path({str(tmp_path)!r})); "
             "log.write_step('m', {'step': 1, 'reward': {'mean': 0.5}}); log.close(); "
             "print(sorted({'torch', 'tensorflow'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout + result.stderr


def test_the_wandb_and_mlflow_trackers_do_not_import_torch(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    check = ("import sys, pathlib; from artlike_server.services import build_trackers; "
             "from artlike_server.settings import TrackerSettings; "
             f"trackers = build_trackers(TrackerSettings(wandb_project='p', mlflow_tracking_uri={(tmp_path / 'mlruns').as_uri()!r})); "
             "trackers.observe_history('m', {'step': 1, 'reward': {'mean': 0.5}}); trackers.close(); "
             "print(sorted({'torch', 'tensorflow'} & set(sys.modules)))")
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(tmp_path), MLFLOW_ALLOW_FILE_STORE="true")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True, env=env)
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout + result.stderr
