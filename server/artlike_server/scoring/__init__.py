"""Reward models at work: `POST /v1/rewards` scores conversations with a reward model step."""
