"""The Tinker API: Thinking Machines' training SDK (`tinker`) and its cookbook, served by this server."""
