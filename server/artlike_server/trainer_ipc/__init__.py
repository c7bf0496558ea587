"""What crosses the pipe between the server and the torch worker, importable from both sides (no torch).

`protocol` (the commands and events), `sequences` (the training sequences built from completions and
trajectories), `batch_file` (a batch's tensors on disk, handed over by path) and `steps` (how many optimizer
steps a job makes). The server side (`artlike_server.training`) and the worker (`artlike_server.torch_worker`)
each import this package and never each other.
"""
