"""Alembic's scripts, installed as ``flatfare.migrations`` (see pyproject.toml); alembic runs env.py itself."""
