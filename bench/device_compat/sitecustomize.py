"""Loaded by every Python process of a device run that puts this folder on PYTHONPATH (gpu_device.sh
capabilities, the llava entry only).

vLLM 0.26's LLaVA module imports its Pixtral sibling, which imports ``PixtralRotaryEmbedding`` (and two
helpers) from transformers; the device's transformers (5.x, newer than vLLM 0.26 supports) renamed the
class ``PixtralVisionRotaryEmbedding``. LLaVA-1.5 runs a CLIP vision tower and never calls them: the
names only have to exist for the import to pass. Each missing one gets its renamed twin, or a stand-in
that fails loudly if anything ever calls it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_MODULE = "transformers.models.pixtral.modeling_pixtral"
_RENAMED = {"PixtralRotaryEmbedding": "PixtralVisionRotaryEmbedding"}
_NEEDED = ("PixtralRotaryEmbedding", "apply_rotary_pos_emb", "position_ids_in_meshgrid")


def _unused(name: str):
    def call(*_args, **_kwargs):
        raise RuntimeError(f"{name} is a stand-in of bench/device_compat (absent from this transformers)")
    return call


class _Aliases(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            for name in _NEEDED:
                if not hasattr(module, name):
                    twin = _RENAMED.get(name)
                    setattr(module, name, getattr(module, twin) if twin and hasattr(module, twin) else _unused(name))

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Aliases())
