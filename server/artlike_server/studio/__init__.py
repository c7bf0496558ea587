"""The studio: the `/ui` page and what it needs behind it (ratings, continual training from them, browsing)."""
