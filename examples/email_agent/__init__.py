"""ART·E-style email agent: search an inbox with keyword search, read emails, answer with sources.

Modules: `data` (seeded synthetic inboxes + questions, SQLite FTS5), `tools` (the three tools the model
calls), `reward` (pure grading), `agent` (the OpenAI tool-calling loop), `rollout` (one artlike
trajectory), `evaluate` and `train` (the scripts). See README.md.
"""
