"""Flatfare's shared core: the queue contract, settings, storage and the ``flatfare`` command."""
