"""Build the wheelhouse the images install from: every third-party wheel, for the images' Python and glibc.

    python3 scripts/wheelhouse.py                    # the GPU images: PyPI's torch (CUDA 13), Python 3.12
    python3 scripts/wheelhouse.py -- --extra-index-url https://download.pytorch.org/whl/cpu   # CPU torch

Run it where pip reaches an index (your pip configuration applies; pip options go after `--`). It downloads
wheels only, for the target given by --python-version / --glibc (not this machine's), then writes one pinned
requirements file per image: <dest>/engine.txt (engine and worker, `.[engine,worker]`) and
<dest>/gateway.txt (`.[gateway]`), resolved from the downloaded wheels alone. The Dockerfiles install those
with `pip install --no-index`, so `docker compose build` needs no Python index: an air-gapped site copies
the repository with its wheelhouse/ and builds there (deploy/README.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Image -> the pyproject extras it installs (docker/gpu.Dockerfile, docker/gateway.Dockerfile).
IMAGES = {"engine": ("engine", "worker"), "gateway": ("gateway",)}


def requirements(pyproject: dict, extras: tuple[str, ...]) -> list[str]:
    """The project's own dependencies plus those of ``extras``, as written in pyproject.toml."""
    project = pyproject["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return list(dict.fromkeys(reqs))


def marker_environment(python_version: str) -> dict[str, str]:
    """The environment markers of the images (CPython ``python_version`` on x86_64 Linux). pip's
    --python-version and --platform choose wheel tags but evaluate markers against the interpreter running
    it (a `python_full_version < "3.11.3"` or `platform_system == "Linux"` dependency would be dropped or
    added wrongly), so pip runs with these instead."""
    parts = python_version.split(".")
    return {"python_version": ".".join(parts[:2]), "python_full_version": ".".join((parts + ["0"])[:3]),
            "implementation_name": "cpython", "implementation_version": ".".join((parts + ["0"])[:3]),
            "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
            "os_name": "posix", "platform_machine": "x86_64"}


# pip with its marker environment replaced (pip has no option for it): argv[1] the markers as JSON.
PIP_WITH_MARKERS = """
import json, sys
from pip._vendor.packaging import markers
env = {**markers.default_environment(), **json.loads(sys.argv[1])}
markers.default_environment = lambda: dict(env)
from pip._internal.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


def target_flags(python_version: str, glibc: str) -> list[str]:
    """pip flags selecting wheels for CPython ``python_version`` on x86_64 Linux with glibc ``glibc``.
    pip does not widen an explicit --platform to older manylinux tags, so each is listed."""
    major, minor = (int(x) for x in glibc.split("."))
    tags = [f"manylinux_{major}_{m}_x86_64" for m in range(minor, 4, -1)]
    tags += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    flags = ["--only-binary=:all:", "--implementation", "cp", "--python-version", python_version]
    for tag in tags:
        flags += ["--platform", tag]
    return flags


def pip(python_version: str, *args: str) -> None:
    subprocess.run([sys.executable, "-c", PIP_WITH_MARKERS, json.dumps(marker_environment(python_version)),
                    "--disable-pip-version-check", *args], check=True)


def pinned(dest: Path, reqs: list[str], python_version: str, flags: list[str]) -> list[str]:
    """``reqs`` resolved against the wheels in ``dest`` only (no index, no pip configuration): name==version."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pip(python_version, "install", "--isolated", "--quiet", "--dry-run", "--ignore-installed", "--no-index",
            "--find-links", str(dest), "--target", str(Path(tmp) / "target"), "--report", str(report),
            *flags, *reqs)
        installs = json.loads(report.read_text())["install"]
    return sorted(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in installs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Arguments after `--` go to `pip download` (e.g. --index-url).")
    parser.add_argument("--dest", default=str(REPO / "wheelhouse"),
                        help="the wheelhouse directory; the Dockerfiles' WHEELHOUSE build arg names it "
                             "(default: wheelhouse/ at the repository root, the Dockerfiles' default)")
    parser.add_argument("--python-version", default="3.12.3",
                        help="the images' Python, X.Y.Z (default 3.12.3: Ubuntu 24.04's in the GPU image; the "
                             "gateway image's python:3.12 agrees up to the patch level)")
    parser.add_argument("--glibc", default="2.35",
                        help="newest manylinux glibc the images accept (default 2.35; Ubuntu 24.04 has 2.39, "
                             "Debian 12 2.36)")
    parser.add_argument("pip_args", nargs="*", help="options for `pip download`, after `--`")
    args = parser.parse_args(argv)

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    dest = Path(args.dest).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    flags = target_flags(args.python_version, args.glibc)
    everything = requirements(pyproject, tuple(e for extras in IMAGES.values() for e in extras))
    # The build backend too: the images install the project itself from source with --no-index.
    build = pyproject["build-system"]["requires"]
    pip(args.python_version, "download", "--dest", str(dest), *flags, *args.pip_args, *everything, *build)
    for image, extras in IMAGES.items():
        lines = pinned(dest, requirements(pyproject, extras) + build, args.python_version, flags)
        (dest / f"{image}.txt").write_text(
            f"# {image} image: .[{','.join(extras)}] for CPython {args.python_version}, written by "
            f"scripts/wheelhouse.py\n" + "\n".join(lines) + "\n")
        print(f"wheelhouse: {dest / f'{image}.txt'} ({len(lines)} packages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
