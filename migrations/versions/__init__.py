"""The revisions, oldest first by number; alembic skips this file."""
