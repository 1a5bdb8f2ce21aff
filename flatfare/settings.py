"""Settings every Flatfare process shares; each process extends this into its own class."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL = "smollm2-135m-instruct"


def _default_data_dir() -> Path:
    return Path.home() / ".flatfare"


class CommonSettings(BaseSettings):
    """Read from ``FLATFARE_*`` variables and a ``.env`` file in the working directory."""

    model_config = SettingsConfigDict(env_prefix="FLATFARE_", env_file=".env", extra="ignore")

    data_dir: Path = Field(default_factory=_default_data_dir)
    # Empty means "a SQLite file in data_dir".
    database_url: str = ""
    # Empty means "no shared Redis": only `flatfare up` may then start a private one.
    redis_url: str = ""
    # Where prepared models live; empty means "models/ in data_dir".
    models_dir: Path | None = None
    log_level: str = "info"
    # "json": one JSON object per line (request id, account, model); "text" for a terminal.
    log_format: Literal["json", "text"] = "json"
    # Log prompts and outputs. Off by default: they are the customers' data.
    log_prompts: bool = False
    # A job a worker holds but stops renewing (it died) is taken over after this long. Workers hold their
    # jobs under it; gateways check their lost_job_after_s against it (flatfare.contract.timing).
    job_lease_s: float = Field(default=15.0, gt=0)
    # Flatfare's own spans over OTLP/HTTP (flatfare.tracing), e.g. http://127.0.0.1:4318: off unless both
    # are set. The ratio is the share of requests without a client's sampled traceparent that are
    # traced (decided at the gateway; the worker follows the job's flag). Every process of a platform
    # gets the same two.
    traces_endpoint: str = Field(default="", max_length=512)
    traces_sample_ratio: float = Field(default=0.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _default_models_dir(self) -> CommonSettings:
        if self.models_dir is None:
            self.models_dir = self.data_dir / "models"
        return self

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{self.data_dir / 'flatfare.db'}"
