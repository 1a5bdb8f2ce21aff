"""Installed as ``sitecustomize`` on the GPU machine only (bench/gpu_device.sh): a vLLM 0.26 shim.

Flatfare's worker calls ``AsyncLLM.get_num_unfinished_requests()`` (workers/engine.py), which vLLM
0.32 has and 0.26 lacks; there the worker dies right after its engine starts. Until the worker
handles both, this adds the method to 0.26's AsyncLLM when that module is first imported, with what
0.32's method returns (the output processor's count). Nothing is imported eagerly.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_TARGET = "vllm.v1.engine.async_llm"


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 - the finder protocol
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        original = spec.loader.exec_module

        def exec_module(module) -> None:  # noqa: ANN001
            original(module)
            llm = getattr(module, "AsyncLLM", None)
            if llm is not None and not hasattr(llm, "get_num_unfinished_requests"):
                llm.get_num_unfinished_requests = lambda self: self.output_processor.get_num_unfinished_requests()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _Patch())
