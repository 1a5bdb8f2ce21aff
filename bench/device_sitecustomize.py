"""Installed as ``sitecustomize`` on the GPU machine only (bench/gpu_device.sh): shims for vLLM 0.26 beside
the device's newer transformers, each applied when its module is first imported (nothing eagerly).

- ``vllm.v1.engine.async_llm``: Flatfare's worker calls ``AsyncLLM.get_num_unfinished_requests()``
  (workers/engine.py), which vLLM 0.32 has and 0.26 lacks; this adds it with what 0.32's returns (the
  output processor's count).
- ``transformers.models.pixtral.modeling_pixtral``: vLLM 0.26's LLaVA imports its Pixtral sibling, which
  imports ``PixtralRotaryEmbedding`` and two helpers that transformers 5 renamed or dropped
  (``PixtralVisionRotaryEmbedding``). LLaVA-1.5 runs a CLIP vision tower and never calls them: the names
  only have to exist for the import to pass. Each missing one gets its renamed twin, or a stand-in that
  fails loudly if anything ever calls it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType

_PIXTRAL_RENAMED = {"PixtralRotaryEmbedding": "PixtralVisionRotaryEmbedding"}
_PIXTRAL_NEEDED = ("PixtralRotaryEmbedding", "apply_rotary_pos_emb", "position_ids_in_meshgrid")


def _async_llm(module: ModuleType) -> None:
    llm = getattr(module, "AsyncLLM", None)
    if llm is not None and not hasattr(llm, "get_num_unfinished_requests"):
        llm.get_num_unfinished_requests = lambda self: self.output_processor.get_num_unfinished_requests()


def _unused(name: str) -> Callable[..., None]:
    def call(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError(f"{name} is a stand-in of bench/device_sitecustomize.py (absent from this transformers)")
    return call


def _pixtral(module: ModuleType) -> None:
    for name in _PIXTRAL_NEEDED:
        if not hasattr(module, name):
            twin = _PIXTRAL_RENAMED.get(name)
            setattr(module, name, getattr(module, twin) if twin and hasattr(module, twin) else _unused(name))


_PATCHES = {"vllm.v1.engine.async_llm": _async_llm, "transformers.models.pixtral.modeling_pixtral": _pixtral}


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 - the finder protocol
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        original = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _Patch())
