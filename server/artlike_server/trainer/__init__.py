"""The trainer worker process: torch, PEFT and the objectives. Started by `training.trainer_client`.

Everything here may import torch; nothing in the server process imports this package except the torch-free
IPC modules (`protocol`, `batch_file`), which the trainer client uses to talk to the worker.
"""
