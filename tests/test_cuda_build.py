"""The CUDA build of zeroshard._C, compiled (not run) on a machine without a GPU.

setup.py compiles csrc/flatten_cuda.cu (and flatten.cpp / plan.cpp with
ZEROSHARD_WITH_CUDA) only where torch has CUDA, which CI's CPU torch has not:
a change to the host code that those files share (runs.h, copy_cpu.h) would
otherwise first fail to build on a lent GPU machine. Where nvcc is installed
and torch's headers include c10/cuda, this compiles the three sources as the
CUDA build does and checks that every zeroshard function one object calls is
defined, with the same signature, in another (what linking them would check).
The kernels themselves run in tests/test_cuda.py, tests/test_ext.py and
tests/test_copy_plan.py on a GPU.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = ["flatten_cuda.cu", "flatten.cpp", "plan.cpp"]
# What flatten.cpp and plan.cpp call in flatten_cuda.cu: were the build to
# lose ZEROSHARD_WITH_CUDA, nothing would be undefined and the check below vacuous.
CUDA_ENTRY_POINTS = ["copy_runs_cuda(", "upload_runs_cuda(", "launch_runs_cuda("]

NVCC = shutil.which("nvcc")
TORCH_INCLUDE = cpp_extension.include_paths()
HAVE_C10_CUDA = any((Path(p) / "c10" / "cuda" / "CUDAStream.h").exists() for p in TORCH_INCLUDE)
pytestmark = pytest.mark.skipif(
    NVCC is None or shutil.which("nm") is None or not HAVE_C10_CUDA,
    reason="needs nvcc, nm and torch headers with c10/cuda to compile the CUDA build",
)


def _compile(src: str, out: Path, includes: list[str]) -> subprocess.CompletedProcess:
    # The flags torch.utils.cpp_extension gives a CUDAExtension (language
    # standard, ABI, extension macros, nvcc's half/bf16 settings), host code at
    # -O0: this checks that the code compiles, not how fast it is.
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [NVCC, "-c", str(CSRC / src), "-o", str(out), "-std=c++20", "-O0", "-DZEROSHARD_WITH_CUDA",
           "-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           "-Xcompiler", "-fPIC", "-Xcompiler", "-fopenmp", "-w"]
    cmd += [f"-I{p}" for p in includes]
    if src.endswith(".cu"):
        cmd += cpp_extension.COMMON_NVCC_FLAGS + ["-gencode=arch=compute_90,code=sm_90"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


_NM_LINE = re.compile(r"^\s*(?:[0-9a-fA-F]+\s+)?[A-Za-z]\s+(.+)$")


def _symbols(obj: Path, which: str) -> set[str]:
    """zeroshard:: functions an object defines (which="defined") or calls
    but leaves to others ("undefined"), demangled with their signatures."""
    out = subprocess.run(["nm", "-C", f"--{which}-only", str(obj)], capture_output=True, text=True, check=True).stdout
    # "[address] type name": an undefined symbol has no address, and a
    # demangled name holds spaces.
    names = (m.group(1) for m in map(_NM_LINE.match, out.splitlines()) if m)
    return {n for n in names if n.startswith("zeroshard::")}


def test_cuda_build_compiles_and_links(tmp_path):
    includes = TORCH_INCLUDE + [sysconfig.get_paths()["include"]]
    macros = "c10/cuda/impl/cuda_cmake_macros.h"
    if not any((Path(p) / macros).exists() for p in TORCH_INCLUDE):
        # A CPU wheel ships c10/cuda's headers but not this generated one; a
        # CUDA wheel's holds only this define (c10_cuda is a shared library).
        (tmp_path / macros).parent.mkdir(parents=True)
        (tmp_path / macros).write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes.append(str(tmp_path))
    objs = {src: tmp_path / (src + ".o") for src in SOURCES}
    with ThreadPoolExecutor(max(1, min(len(SOURCES), os.cpu_count() or 1))) as pool:
        done = dict(zip(SOURCES, pool.map(lambda s: _compile(s, objs[s], includes), SOURCES)))
    failed = {s: r.stderr[-4000:] for s, r in done.items() if r.returncode != 0}
    assert not failed, "the CUDA build of zeroshard._C does not compile:\n" + "\n".join(
        f"--- {s}\n{err}" for s, err in failed.items())

    defined = set().union(*(_symbols(o, "defined") for o in objs.values()))
    called = set().union(*(_symbols(o, "undefined") for o in objs.values()))
    for entry in CUDA_ENTRY_POINTS:
        assert any(entry in s for s in called), f"no object calls zeroshard::{entry}...): built without CUDA?"
        assert any(entry in s for s in _symbols(objs["flatten_cuda.cu"], "defined")), entry
    missing = sorted(called - defined)
    assert not missing, f"called but defined nowhere (a declaration and its definition differ?): {missing}"
