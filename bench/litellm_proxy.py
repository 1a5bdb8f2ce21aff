"""LiteLLM's proxy, the peer Flatfare is measured against, in a virtual environment of its own.

``litellm[proxy]`` pins its own fastapi/openai/pydantic, so it never goes into Flatfare's venv: the
bench creates ``bench/.venv-litellm`` (git-ignored) on first use. Its configuration is what a DB-less
operator would run: a master key every request must present and rate limits (a global cap on
parallel requests, an rpm limit on the deployment) set far above the load, so they are checked but
never refuse.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

from bench.procs import Service, Services, free_port, pinned
from bench.stack import http_get

# 1.108.7 is the newest 1.108 release whose pinned litellm-proxy-extras exists on PyPI.
LITELLM_VERSION = "1.108.7"
VENV_DIR = Path(__file__).resolve().parent / ".venv-litellm"
MASTER_KEY = "sk-bench-master-key-0123456789"


def ensure_venv(progress=print) -> Path:  # noqa: ANN001 - a print-like callable
    """The venv's ``litellm`` program, installing ``litellm[proxy]`` there first if needed (~3 min)."""
    program = VENV_DIR / "bin" / "litellm"
    marker = VENV_DIR / f".installed-{LITELLM_VERSION}"
    if program.exists() and marker.exists():
        return program
    progress(f"installing litellm[proxy]=={LITELLM_VERSION} into {VENV_DIR} (first run only, ~3 min)")
    venv.EnvBuilder(with_pip=True, clear=True).create(VENV_DIR)
    subprocess.run([str(VENV_DIR / "bin" / "python"), "-m", "pip", "install", "-q",
                    f"litellm[proxy]=={LITELLM_VERSION}"], check=True)
    marker.write_text("ok\n")
    return program


def version() -> str:
    python = VENV_DIR / "bin" / "python"
    done = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() or "?"


def write_config(path: Path, upstream_url: str, model: str) -> Path:
    path.write_text(f"""\
model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: {upstream_url}/v1
      api_key: none
      rpm: 10000000
general_settings:
  master_key: {MASTER_KEY}
  global_max_parallel_requests: 10000
litellm_settings:
  drop_params: true
  set_verbose: false
  telemetry: false
""")
    return path


def start(services: Services, workdir: Path, upstream_url: str, model: str, cpus: str | None,
          ready_timeout_s: float = 180) -> Service:
    program = ensure_venv()
    port = free_port()
    config = write_config(workdir / "litellm.yaml", upstream_url, model)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update({"LITELLM_LOG": "ERROR", "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False",
                "DISABLE_SCHEMA_UPDATE": "true", "NO_DOCS": "True"})
    service = services.start(Service(
        "litellm", pinned([str(program), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
                           "--num_workers", "1"], cpus), workdir / "litellm.log", env=env, cwd=str(workdir)))
    service.port = port  # type: ignore[attr-defined]
    service.wait_ready(lambda: http_get(f"http://127.0.0.1:{port}/health/liveliness")[0] == 200, ready_timeout_s)
    return service


if __name__ == "__main__":
    ensure_venv()
    sys.stdout.write(version() + "\n")
