"""The package's PEP 517 build backend: maturin's, after the workspace's programs are put in
`python/edl/_bin/` so that the wheel carries them (`edl-ps`, `edlctl`, `edl-worker`,
`edl-local`, `edl-sched`: `edl.local` finds them there, with no checkout and no
`EDL_BIN_DIR`). maturin alone packs only the crates of its own package's targets.

The programs are built with `cargo build --locked` in the workspace's own `target/` (before
maturin's build, not inside it: no second target folder, nothing built twice), in the profile
maturin is given (`MATURIN_PEP517_ARGS="--profile dev"`; release otherwise), or copied from
`EDL_WHEEL_BINS` (a folder that holds them already, e.g. `target/debug` after `cargo build
--workspace`: a build of these packages alone would choose other features and rebuild much of
the workspace). `EDL_WHEEL_BINS=none` packs none (the package then finds them as before:
`EDL_BIN_DIR`, `PATH`, `~/.cargo/bin`, a checkout's `target/`).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import maturin
from maturin import (  # noqa: F401 (re-exported: the rest of the PEP 517 interface)
    build_sdist,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

#: The programs the wheel carries, by the workspace package that builds each.
PROGRAMS = {"edl-ps": "edl-ps", "edlctl": "edl-ps", "edl-worker": "edl-worker",
            "edl-local": "edl-deploy", "edl-sched": "edl-sched"}

HERE = Path(__file__).resolve().parent
BIN = HERE / "python" / "edl" / "_bin"


def _profile() -> str:
    args = shlex.split(os.environ.get("MATURIN_PEP517_ARGS", ""))
    for i, a in enumerate(args):
        if a == "--profile" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--profile="):
            return a.split("=", 1)[1]
    return "release"


def _say(msg: str) -> None:
    print(f"edl build: {msg}", file=sys.stderr, flush=True)


def _programs() -> None:
    """Fills python/edl/_bin with the programs (see the module's documentation)."""
    shutil.rmtree(BIN, ignore_errors=True)
    given = os.environ.get("EDL_WHEEL_BINS")
    if given == "none":
        _say("EDL_WHEEL_BINS=none: the wheel carries no programs")
        return
    if given:
        src = Path(given)
    else:
        profile = _profile()
        packages = sorted(set(PROGRAMS.values()))
        cmd = ["cargo", "build", "--locked", "--profile", profile]
        for p in packages:
            cmd += ["-p", p]
        for b in PROGRAMS:
            cmd += ["--bin", b]
        _say(" ".join(cmd))
        subprocess.run(cmd, cwd=HERE, check=True)
        meta = subprocess.run(["cargo", "metadata", "--no-deps", "--format-version", "1"],
                              cwd=HERE, check=True, capture_output=True, text=True)
        target = Path(json.loads(meta.stdout)["target_directory"])
        src = target / ("debug" if profile == "dev" else profile)
    BIN.mkdir(parents=True)
    for name in PROGRAMS:
        f = src / name
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing: build the workspace's programs "
                                    f"(cargo build --workspace --bins), or set EDL_WHEEL_BINS")
        shutil.copy2(f, BIN / name)
    _say(f"the wheel carries {', '.join(PROGRAMS)} from {src}")


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _programs()
    return maturin.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _programs()
    return maturin.build_editable(wheel_directory, config_settings, metadata_directory)
