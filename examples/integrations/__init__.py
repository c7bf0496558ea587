"""Agent frameworks run unchanged against artlike: each module runs one on a trajectory URL."""
