"""How much host memory a model's weights take: what a level-1 sleeper keeps in RAM."""

from __future__ import annotations

from pathlib import Path


BUILTIN_PREFIX = "builtin:"
WEIGHT_FILES = ("*.safetensors", "*.gguf", "*.bin")


def weights_gb(source: str, models_dir: Path | None, hf_home: str) -> float:
    """The size of the weight files in the model's folder (a prepared built-in model, a local folder, or a
    hub model in the Hugging Face cache); 0 when no folder is found (not yet prepared or downloaded)."""
    folder = _folder(source, models_dir, hf_home)
    if folder is None:
        return 0.0
    total = sum(f.stat().st_size for pattern in WEIGHT_FILES for f in folder.rglob(pattern) if f.is_file())
    return round(total / 2**30, 2)


def _folder(source: str, models_dir: Path | None, hf_home: str) -> Path | None:
    if source.startswith(BUILTIN_PREFIX):
        folder = (models_dir or Path()) / source.removeprefix(BUILTIN_PREFIX)
        return folder if folder.is_dir() else None
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if source.count("/") != 1:
        return None
    cache = Path(hf_home).expanduser() / "hub" if hf_home else Path.home() / ".cache" / "huggingface" / "hub"
    snapshots = cache / f"models--{source.replace('/', '--')}" / "snapshots"
    latest = max(snapshots.glob("*"), key=lambda p: p.stat().st_mtime, default=None) if snapshots.is_dir() else None
    return latest
