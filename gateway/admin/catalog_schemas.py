"""Admin wire models of the model catalog: what an operator sends and sees for one model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import Field, field_validator

from flatfare.capabilities import capabilities_of
from flatfare.gateway.admin.model_options import EngineOptions
from flatfare.gateway.admin.schemas import ModelName, Name, Timestamp, _In, _Out, _refuse_null

# Stored with the engine options (the flag vLLM takes), but set only through the entry's own field.
TRUST_REMOTE_CODE = "trust_remote_code"


class _ModelFields(_In):
    source: Annotated[str, Field(min_length=1, max_length=512)] | None = None
    engine_options: EngineOptions | None = None
    # Runs the model repository's own Python in the workers (Kimi K2, some DeepSeek and vision
    # models need it). Off unless an operator turns it on for this entry; engine_options cannot.
    trust_remote_code: bool | None = None
    plans: list[Name] | None = None
    pinned: bool | None = None
    min_workers: Annotated[int, Field(ge=0, le=1024)] | None = None
    # An on-demand model's engines are put to sleep (stopped, on a CPU host) after this long unused;
    # null: the fleet's default (FLATFARE_FLEET_IDLE_TIMEOUT_S).
    idle_timeout_s: Annotated[int, Field(ge=10, le=86400)] | None = None
    # A LoRA variant: ``source`` is the adapter, served by this catalog model's engines (which need
    # enable_lora); null: a model of its own.
    base_model: ModelName | None = None
    enabled: bool | None = None

    _not_null = field_validator("source", "pinned", "min_workers", "enabled", "trust_remote_code")(_refuse_null)

    def options(self, current: dict[str, Any] | None = None) -> dict[str, Any]:
        """The engine options to store: the sent ones (else ``current``'s), with the entry's
        ``trust_remote_code`` (as sent, else as it was)."""
        current = current or {}
        fields = self.model_dump(exclude_unset=True)
        if "engine_options" in fields:
            options = self.engine_options.as_options() if self.engine_options else {}
        else:
            options = {k: v for k, v in current.items() if k != TRUST_REMOTE_CODE}
        trust = self.trust_remote_code if "trust_remote_code" in fields else bool(current.get(TRUST_REMOTE_CODE))
        return {**options, TRUST_REMOTE_CODE: True} if trust else options


class ModelCreate(_ModelFields):
    name: ModelName
    source: Annotated[str, Field(min_length=1, max_length=512)]


class ModelUpdate(_ModelFields):
    pass


class WorkerPublic(_Out):
    """One live worker of the model, as its last heartbeat said."""

    worker_id: str
    pool: str
    state: str
    engine: str
    max_model_len: int
    capacity: int
    inflight: int
    started_ms: int
    # What its engine actually started with (vLLM's effective configuration; {} before it started).
    engine_config: dict[str, Any] = Field(default_factory=dict)
    # Its pace governor (flatfare.workers.pace): the standard limit, the engine's pace, baseline and target.
    governor: dict[str, Any] | None = None

    @classmethod
    def of(cls, worker: Any) -> WorkerPublic:
        return cls(worker_id=worker.worker_id, pool=worker.pool or worker.model, state=str(worker.state.value),
                   engine=worker.engine, max_model_len=worker.max_model_len, capacity=worker.capacity,
                   inflight=worker.inflight, started_ms=worker.started_ms,
                   engine_config=worker.extra.get("engine_config") or {}, governor=worker.extra.get("governor"))


class FleetServing(_Out):
    """A fleet supervisor that can start the model on its host, and why it has not yet (when it says)."""

    fleet_id: str
    host: str
    waiting: str | None = None


class ModelPublic(_Out):
    name: str
    source: str
    engine_options: dict[str, Any]
    trust_remote_code: bool = False
    # What the API offers on this model, from its engine options (as /v1/models shows it).
    capabilities: dict[str, bool] = Field(default_factory=dict)
    plans: list[str] | None
    pinned: bool
    min_workers: int
    idle_timeout_s: int | None = None
    base_model: str | None = None
    enabled: bool
    created_at: Timestamp
    live_workers: int = 0
    # The live workers of its shared pool (a variant's: its base model's), each with the engine
    # configuration it runs and its state (warm, asleep, ...).
    workers: list[WorkerPublic] = Field(default_factory=list)
    # The live fleets that list it (GET /admin/v1/fleets has the rest of their state).
    fleets: list[FleetServing] = Field(default_factory=list)

    @classmethod
    def of(cls, model: Any, workers: Sequence[Any], base: Any = None, fleets: Sequence[Any] = ()) -> ModelPublic:
        """``base``: a variant's base model, whose engines (and so capabilities) serve it; ``fleets``: the
        live fleets' statuses."""
        options = dict(model.engine_options or {})
        return cls.model_validate(model).model_copy(update={
            "engine_options": {k: v for k, v in options.items() if k != TRUST_REMOTE_CODE},
            "trust_remote_code": bool(options.get(TRUST_REMOTE_CODE)),
            "capabilities": capabilities_of(base.engine_options or {} if base is not None else options).public(),
            "live_workers": len(workers),
            "workers": [WorkerPublic.of(w) for w in workers],
            "fleets": [FleetServing(fleet_id=f.fleet_id, host=f.host,
                                    waiting=f.waiting.get(model.base_model or model.name))
                       for f in fleets if model.name in f.models]})
