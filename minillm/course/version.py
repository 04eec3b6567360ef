"""The first code cell of every chapter: which code and which machine made the outputs below it."""
from __future__ import annotations

import minillm
from minillm.hardware.machine import compile_target, describe_machine, package_versions


def version_line() -> str:
    versions = package_versions()
    target = compile_target()
    packages = " · ".join(f"{name} {versions.get(name, 'absent')}" for name in ("python", "numpy", "numba", "torch"))
    isa = target.isa + (" + VNNI" if target.vnni else "")
    return (f"minillm fingerprint {minillm.fingerprint()} · {packages} · {describe_machine().cpu_model} · "
            f"Numba compiles for {target.cpu_name} ({isa})")


def version_cell() -> None:
    """Print one line: the package's source fingerprint, the versions and the CPU Numba targets.
    A test compares the committed fingerprint with the code's (``make notebooks`` refreshes it)."""
    print(version_line())
