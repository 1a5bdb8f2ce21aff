"""A model's weight size, which decides whether a sleeper keeps them in host memory (level 1): the
weight files of its prepared folder, local folder or Hugging Face cache snapshot."""

from __future__ import annotations

from pathlib import Path

from flatfare.fleet.weights import weights_gb


def _file(path: Path, mib: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        handle.truncate(mib * 2**20)


def test_weight_files_are_summed_wherever_the_model_lives(tmp_path: Path) -> None:
    models = tmp_path / "models"
    _file(models / "tiny" / "model.safetensors", 512)
    _file(models / "tiny" / "tokenizer.json", 300)  # not weights
    assert weights_gb("builtin:tiny", models, "") == 0.5
    _file(tmp_path / "local" / "a.gguf", 256)
    _file(tmp_path / "local" / "sub" / "b.safetensors", 256)
    assert weights_gb(str(tmp_path / "local"), models, "") == 0.5
    snapshot = tmp_path / "hf" / "hub" / "models--org--name" / "snapshots" / "abc"
    _file(snapshot / "model-00001-of-00002.safetensors", 1024)
    _file(snapshot / "model-00002-of-00002.safetensors", 1024)
    assert weights_gb("org/name", models, str(tmp_path / "hf")) == 2.0


def test_a_model_not_prepared_or_downloaded_yet_weighs_nothing_known(tmp_path: Path) -> None:
    assert weights_gb("builtin:missing", tmp_path, "") == 0.0
    assert weights_gb("org/absent", tmp_path, str(tmp_path)) == 0.0
    assert weights_gb("not a path or hub id", tmp_path, "") == 0.0
