"""The fleet supervisor's settings (``FLATFARE_FLEET_*``), and the accelerators and budget they give."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

from pydantic import Field

from flatfare.fleet.decisions import Budget
from flatfare.settings import CommonSettings

# Host memory left to level-1 sleepers by default: this share of what is free when the fleet starts.
HOST_MEMORY_SHARE = 0.8
CPU_SLOT = "cpu"
GPU_TICK_S = 0.1
CPU_TICK_S = 0.5


class FleetSettings(CommonSettings):
    fleet_id: str = Field(default_factory=socket.gethostname)
    # GPU ids this fleet owns ("0,1,2"); "cpu": none, whatever the host has. Empty: CUDA_VISIBLE_DEVICES,
    # else every GPU nvidia-smi lists, else none.
    fleet_gpus: str = ""
    cuda_visible_devices: str = Field("", validation_alias="CUDA_VISIBLE_DEVICES")
    # Engines awake at once (starting, waking, warm, draining or going to sleep). 0: one per GPU, or on
    # a CPU host 1 up to 4 cores, else 2 (engines on the same cores slow each other down).
    fleet_max_awake: int = Field(0, ge=0)
    # Host memory (GiB) for the weights of engines asleep at level 1. 0: 80 % of what is free at start.
    fleet_host_memory_gb: float = Field(0.0, ge=0)
    # An on-demand model's engine idle this long sleeps (GPU) or stops (CPU), unless its catalog entry
    # sets its own idle_timeout_s.
    fleet_idle_timeout_s: float = Field(300.0, gt=0)
    # The catalog models this fleet serves; empty: every enabled one that fits its GPUs.
    fleet_models: list[str] = Field(default_factory=list)
    # Every model on demand here, pinned ones included: a small host that cannot keep them all up.
    fleet_on_demand: bool = False
    # Models started at once (then on demand like the rest): `flatfare up`'s default model.
    fleet_preload: list[str] = Field(default_factory=list)
    # Prometheus /metrics of the fleet. 0: any free port (logged); -1: off.
    fleet_metrics_port: int = 0
    fleet_metrics_host: str = "127.0.0.1"
    # How often it decides (s). 0: 0.1 s on a GPU host, where a wake's latency is two ticks' waits (the demand
    # seen, then the sleeper it put away seen asleep), 0.5 s on a CPU host, where an engine takes seconds to
    # start anyway (bench/results/fleet_gpu.md: 8B-shape wakes 1.47 s at 0.5 s, 1.33 s at 0.1 s, medians).
    fleet_tick_s: float = Field(0.0, ge=0)
    # At exit, how long its workers may drain before they are killed.
    fleet_stop_timeout_s: float = Field(60.0, gt=0)
    # Where vLLM keeps hub downloads: the fleet sizes a hub model's weights there.
    hf_home: str = Field("", validation_alias="HF_HOME")

    def gpus(self) -> list[str]:
        """The GPU ids this fleet owns ([] on a CPU host)."""
        chosen = self.fleet_gpus.strip() or self.cuda_visible_devices.strip()
        if chosen.lower() == CPU_SLOT:
            return []
        if chosen:
            return [g.strip() for g in chosen.split(",") if g.strip()]
        if shutil.which("nvidia-smi") is None:
            return []
        try:
            listed = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=30, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        return [line.strip() for line in listed.splitlines() if line.strip()]

    def tick_s(self, gpu: bool) -> float:
        return self.fleet_tick_s or (GPU_TICK_S if gpu else CPU_TICK_S)

    def budget(self) -> Budget:
        gpus = self.gpus()
        if gpus:
            default_awake = len(gpus)
        else:
            default_awake = 1 if (os.cpu_count() or 1) <= 4 else 2
        memory = self.fleet_host_memory_gb or HOST_MEMORY_SHARE * _free_memory_gb()
        return Budget(slots=tuple(gpus) or (CPU_SLOT,), max_awake=self.fleet_max_awake or default_awake,
                      host_memory_gb=round(memory, 1), gpu=bool(gpus))


def _free_memory_gb() -> float:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
