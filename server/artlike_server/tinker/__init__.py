"""The Tinker API: the training and sampling routes of Thinking Machines' `tinker` SDK, served by this server."""
