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
