"""The worker process's settings."""

from __future__ import annotations

import os
import socket
import uuid
from typing import Literal

from pydantic import Field

from flatfare.settings import DEFAULT_MODEL, CommonSettings


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class WorkerSettings(CommonSettings):
    model: str = DEFAULT_MODEL
    # A dedicated pool (an enterprise account's): the worker serves the model as model@pool.
    pool: str = ""
    # "vllm", or "instant": the benchmark/test engine that answers at once with no model.
    engine: Literal["vllm", "instant"] = "vllm"
    # Tokens the instant engine streams per request.
    instant_tokens: int = 16
    # Seconds the instant engine waits before its first token, between tokens, and before it is
    # ready: tests use them to catch a request or a worker in a given state.
    instant_first_token_delay_s: float = 0.0
    instant_token_delay_s: float = 0.0
    instant_start_delay_s: float = 0.0
    # Seconds the instant engine takes to sleep and to wake (a fleet's tests catch it in between).
    instant_sleep_delay_s: float = 0.0
    instant_wake_delay_s: float = 0.0
    # The fleet supervisor that started this worker (`flatfare worker --fleet`): heartbeated, so only
    # that fleet sends it commands. "" for a worker started on its own.
    fleet_id: str = ""
    # Start the engine with vLLM's sleep mode, so a fleet's sleep command frees its accelerator memory.
    # Where the platform has none (vLLM's CPU build) the engine starts without it and refuses to sleep.
    sleep_mode: bool = False
    worker_id: str = Field(default_factory=_default_worker_id)
    # Where the model comes from when the catalog has no entry for it (a folder or hub id).
    source: str = ""
    # JSON object of engine options that override the catalog's, e.g. {"max_model_len": 4096}.
    engine_options: dict[str, object] = Field(default_factory=dict)
    # Jobs held at once; 0 means the engine's batch capacity (max_num_seqs).
    max_inflight: int = 0
    # Of those, slots the standard lane may not fill, kept for premium jobs; -1: an eighth of them.
    premium_reserve: int = -1
    # Batch API lines this worker may hold at once, and while it runs live jobs. -1: by device. On the
    # CPU every sequence in the engine's batch slows every other, so one line at a time, and none
    # started while a live job runs: a live request meets at most one line's remaining tokens. On an
    # accelerator, whose decode steps barely slow with a few more sequences, no bound beyond the
    # slots kept for live requests.
    batch_slots: int = -1
    batch_while_live: int = -1
    # The pace governor (flatfare.workers.pace): under a standard backlog, standard jobs and batch lines
    # running at once are limited so that the engine's time per output token stays within this factor of
    # its pace while it keeps up with its demand. 0: off; -1: by device (1.3 on an accelerator, where a
    # full batch slows every stream, premium's too; off on the CPU, whose capacity is a handful of jobs).
    pace_slack: float = -1.0
    # The least the governed limit may be (0: a sixty-fourth of the capacity, at least 4), so the standard
    # lane always moves.
    pace_floor: int = 0
    # On SIGTERM, how long running jobs may take to finish before they are handed back.
    drain_timeout_s: float = 30.0
    # Prometheus /metrics of this worker. Port 0: any free port (logged, and announced in the worker's
    # heartbeat as extra.metrics_port), so several workers on one host never clash; -1: off.
    # Containers set a fixed port (deploy/ uses 9400) and host 0.0.0.0.
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    # Also export vLLM's engine metrics (running/waiting requests, KV-cache use, tokens) on it.
    engine_metrics: bool = True
