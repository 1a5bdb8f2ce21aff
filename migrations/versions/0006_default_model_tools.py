"""The default model calls functions out of the box: the seeded smollm2-135m-instruct entry gains the
Hermes tool-call parser, automatic tool choice, calls held to the tools' schemas and Flatfare's ChatML
template with tools (its own
template has none, and fails on the assistant turn of a tool call, whose content is null).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

MODEL = "smollm2-135m-instruct"
SEEDED = {"dtype": "float32", "max_model_len": 2048}
# "parameter": vLLM constrains every call to its tool's schema, so even a 135M model's calls parse.
TOOLS = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True, "tool_strict_level": "parameter",
         "chat_template": "chatml-tools"}

_models = sa.table("models", sa.column("name", sa.String), sa.column("engine_options", sa.JSON))


def _set(before: dict, after: dict) -> None:
    """Replace the entry's options only while they are exactly ``before``: an operator's edit stays."""
    bind = op.get_bind()
    current = bind.execute(sa.select(_models.c.engine_options).where(_models.c.name == MODEL)).scalar()
    if current == before:
        bind.execute(_models.update().where(_models.c.name == MODEL).values(engine_options=after))


def upgrade() -> None:
    _set(SEEDED, {**SEEDED, **TOOLS})


def downgrade() -> None:
    _set({**SEEDED, **TOOLS}, SEEDED)
