"""Managed jobs: files, datasets, graders, the sandbox for user reward code, the job runner, and the fine-tuning
routes (OpenAI's and MotteRL's)."""
