"""The server side of training (no torch): `/_train_model`, job orchestration, public training sessions, the
trainer client and advantages. The worker process it drives is `artlike_server.torch_worker`; the two share
only `artlike_server.trainer_ipc`."""
