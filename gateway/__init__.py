"""The Flatfare gateway: OpenAI-compatible HTTP in front of Redis queues and GPU worker pools."""
