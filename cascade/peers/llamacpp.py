"""llama.cpp built from the sources that the llama-cpp-python sdist on PyPI vendors (no git, no hub).

``ensure_built`` downloads the sdist with pip (never installing it), unpacks it, builds the tools
the benchmarks run (``TOOLS``) with cmake (Release, this CPU's native instructions, static, no
network features) and keeps them with the checkpoint converter under
``$CASCADE_HOME/peers/llama.cpp-<version>/``: ``bin/`` the tools, ``convert/`` the converter and its
gguf-py, ``build.json`` the manifest. It all happens in a staging directory renamed into place when
complete, and a finished build is found and reused. The sdist carries no git history, so the
llama.cpp commit it vendors is read from its changelog and compiled into the tools' build info
(``llama-bench`` reports it as ``build_commit``; the manifest keeps its ``--version`` line).

On a CPU with AMX, the build leaves out ggml's AMX int8 kernels: ``ggml_backend_amx_mul_mat``
faults on q8_0 weights there (a general protection fault on the development machine; llama.cpp
issue 20824). bf16 weights never run on them, so the bf16 peer is what a native build runs.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from cascade.errors import CascadeError
from cascade.home import peers_dir
from cascade.packages import pip_download, staged

logger = logging.getLogger(__name__)

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
"""The llama-cpp-python release whose vendored llama.cpp is built (llama.cpp commit 0c1e57098)."""
TOOLS = ("llama-bench", "llama-speculative")
CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion", "gguf-py", "models/templates")
"""What ``convert_hf_to_gguf.py`` reads besides the checkpoint (paths in the vendored tree)."""
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # -march=native: this CPU's vector instructions, as a user's own build has them
    "-DBUILD_SHARED_LIBS=OFF",  # static tools keep working after the rename into place
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_EXAMPLES=ON",  # llama-bench; llama-speculative
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
WITHOUT_AMX_INT8 = ("-DCMAKE_C_FLAGS=-mno-amx-int8", "-DCMAKE_CXX_FLAGS=-mno-amx-int8")
"""Explicit -mno flags win over -march=native in either order: no __AMX_INT8__, no AMX backend."""
MANIFEST = "build.json"


@dataclass(frozen=True)
class LlamaCpp:
    """A finished build: where its tools and converter are, and which llama.cpp it is."""

    root: Path
    llama_cpp_python: str
    """The release of the sdist it was built from."""
    commit: str
    """The llama.cpp commit that release vendors ('unknown' if its changelog does not say)."""
    version: str
    """What ``llama-bench --version`` prints: llama.cpp's version, build number, commit, compiler."""

    def tool(self, name: str) -> Path:
        return self.root / "bin" / name

    @property
    def converter(self) -> Path:
        return self.root / "convert" / "convert_hf_to_gguf.py"

    def describe(self) -> dict:
        """What a report records of it."""
        return {
            "llama_cpp_python": self.llama_cpp_python,
            "llama_cpp_commit": self.commit,
            "llama_cpp_version": self.version,
            "path": str(self.root),
        }


def build_root(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return peers_dir() / f"llama.cpp-{version}"


def installed_build(version: str = LLAMA_CPP_PYTHON_VERSION) -> LlamaCpp | None:
    """The finished build of ``version``, or None if there is none."""
    manifest = build_root(version) / MANIFEST
    if not manifest.is_file():
        return None
    record = json.loads(manifest.read_text())
    return LlamaCpp(manifest.parent, record["llama_cpp_python"], record["commit"], record["version"])


def ensure_built(version: str = LLAMA_CPP_PYTHON_VERSION) -> LlamaCpp:
    """The build of ``version``, made now (about 10 minutes on 2 cores) unless it exists."""
    if (build := installed_build(version)) is not None:
        return build
    if missing := missing_toolchain():
        raise CascadeError("building llama.cpp needs " + " and ".join(missing))
    sdist = pip_download(f"llama-cpp-python=={version}", sdist=True)
    final, build_log = build_root(version), peers_dir() / f"llama.cpp-{version}.build.log"
    with staged(final) as staging:
        release = unpack(sdist, staging / "sdist")
        commit = vendored_commit(release / "CHANGELOG.md", version)
        source = release / "vendor" / "llama.cpp"
        logger.info(f"building llama.cpp {commit} ({', '.join(TOOLS)}) from {sdist.name}; log in {build_log}")
        options = cmake_options(commit, cpu_flags())
        compile_tools(source, staging / "cmake-build", options, build_log)
        keep(staging / "cmake-build" / "bin", TOOLS, staging / "bin")
        keep(source, CONVERTER_FILES, staging / "convert")
        shutil.rmtree(staging / "sdist")
        shutil.rmtree(staging / "cmake-build")
        record = {
            "llama_cpp_python": version,
            "commit": commit,
            "version": tool_version(staging / "bin" / TOOLS[0]),
            "tools": TOOLS,
            "cmake_options": options,
        }
        (staging / MANIFEST).write_text(json.dumps(record, indent=2) + "\n")
    logger.info(f"llama.cpp {commit} built in {final}")
    return installed_build(version)


def cmake_options(commit: str, flags: set[str]) -> list[str]:
    """The configure options: ``CMAKE_OPTIONS``, the vendored commit as the build info (the build
    number is unknown: 0, not a git checkout's count), and no AMX int8 kernels on a CPU whose
    ``flags`` list them."""
    amx = WITHOUT_AMX_INT8 if "amx_int8" in flags else ()
    return [*CMAKE_OPTIONS, *amx, f"-DLLAMA_BUILD_COMMIT={commit}", "-DLLAMA_BUILD_NUMBER=0"]


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    return next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())


def tool_version(tool: Path) -> str:
    """``tool --version`` on one line, e.g. "version: 0.5.0-dev (build 0, commit 0c1e57098); built with GNU ..."."""
    result = subprocess.run([str(tool), "--version"], check=False, capture_output=True, text=True)
    return "; ".join(line.strip() for line in (result.stdout + result.stderr).splitlines() if line.strip())


def missing_toolchain() -> list[str]:
    """What the build needs and this machine lacks, each with how to get it."""
    missing = []
    if shutil.which("cmake") is None:
        missing.append("cmake (`pip install cmake`, or the system's cmake package)")
    if not any(shutil.which(compiler) for compiler in (os.environ.get("CXX") or "c++", "g++", "clang++")):
        missing.append("a C++ compiler (the system's g++ or clang++ package, or CXX=path)")
    if not (shutil.which("make") or os.environ.get("CMAKE_GENERATOR")):
        missing.append("make (the system's make package, or CMAKE_GENERATOR=Ninja with ninja installed)")
    return missing


def unpack(sdist: Path, dest: Path) -> Path:
    """Extract ``sdist`` into ``dest`` -> the release's top directory."""
    try:
        with tarfile.open(sdist) as archive:
            archive.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise CascadeError(f"cannot unpack {sdist}: {exc} (a partial download? delete it and try again)") from None
    tops = list(dest.iterdir())
    if len(tops) != 1 or not (tops[0] / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        raise CascadeError(f"{sdist} does not hold llama-cpp-python's vendor/llama.cpp sources")
    return tops[0]


def vendored_commit(changelog: Path, version: str) -> str:
    """The llama.cpp commit of ``version``'s changelog entry ("update llama.cpp to ...@<commit>")."""
    text = changelog.read_text() if changelog.is_file() else ""
    entry = re.search(rf"^## \[{re.escape(version)}\]\n(.*?)(?=^## \[|\Z)", text, flags=re.MULTILINE | re.DOTALL)
    commit = re.search(r"llama\.cpp@([0-9a-f]{7,40})", entry.group(1)) if entry else None
    return commit.group(1) if commit else "unknown"


def compile_tools(source: Path, build: Path, options: list[str], build_log: Path) -> None:
    """Configure with ``options`` and build ``TOOLS``; output goes to ``build_log``, whose tail a failure quotes."""
    configure = ["cmake", "-S", str(source), "-B", str(build), *options]
    compile_ = [
        "cmake",
        "--build",
        str(build),
        "--config",
        "Release",
        "-j",
        str(os.cpu_count() or 1),
        "--target",
        *TOOLS,
    ]
    build_log.parent.mkdir(parents=True, exist_ok=True)
    with build_log.open("w") as out:
        for command in (configure, compile_):
            out.write(f"$ {shlex.join(command)}\n")
            out.flush()
            if subprocess.run(command, check=False, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise CascadeError(
                    f"building llama.cpp failed in `{shlex.join(command[:2])}`; the end of "
                    f"{build_log}:\n{tail(build_log)}"
                )


def tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def keep(source: Path, names: tuple[str, ...], dest: Path) -> None:
    """Move ``source / name`` to ``dest / name`` for every name (a path relative to both)."""
    for name in names:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(source / name, dest / name)
