"""The trainer's worker process: torch, PEFT and the objectives. Started by `training.trainer_client`.

Everything here may import torch, so the server process never imports this package; both sides share only
the torch-free `artlike_server.trainer_ipc` (enforced by the import contracts in pyproject.toml).
"""
