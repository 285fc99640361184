"""scripts/check-disk.sh: `make` refuses a first install on a full disk with one line naming the folder,
instead of pip failing half-way with "No space left on device"."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check-disk.sh"


def _check(need_gib: int, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TANDEM_SETUP_NEED_GIB": str(need_gib), "TMPDIR": str(tmp_path)}
    return subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True)


def test_enough_space_passes_quietly(tmp_path):
    done = _check(0, tmp_path)
    assert done.returncode == 0 and done.stderr == ""


def test_too_little_space_is_refused_naming_the_folder(tmp_path):
    done = _check(1 << 30, tmp_path)  # an exbibyte: no disk here has it
    assert done.returncode == 1
    assert f"setup: {tmp_path} has " in done.stderr and "needs ~1073741824 GiB" in done.stderr
