"""The server side of training (no torch): `/_train_model`, job orchestration, the trainer client, sequence
building and advantages. The worker process it drives is `artlike_server.trainer`."""
