"""Running the lane queue's scripts: by SHA (EVALSHA) on the hot path, loaded by EVAL when the server
does not know it yet (a restart, a SCRIPT FLUSH)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import NoScriptError


@dataclass(frozen=True, slots=True)
class Lua:
    text: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.text.encode()).hexdigest())

    async def run(self, redis: Any, keys: list[Any], args: list[Any]) -> Any:
        """The script's answer. EVALSHA directly: redis-py's Script.__call__ adds an isinstance check
        against a Protocol class and copies its arguments, a visible cost on the admission path."""
        try:
            return await redis.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:  # a restarted or flushed server: EVAL loads it
            return await redis.eval(self.text, len(keys), *keys, *args)
