"""Build zeroshard. The C++/CUDA flatten extension is optional (see zeroshard/ext.py).

Install with ``pip install --no-build-isolation -e .`` so that the installed torch is
importable here. The extension ``zeroshard._C`` is skipped (pure-torch fallback) when
ZEROSHARD_NO_BUILD_EXT=1, when torch's C++ toolchain is unusable, or when compiling
fails; installation itself never fails because of it. Nothing is downloaded.
"""
import os
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.develop import develop


def _warn(msg):
    print(f"WARNING: zeroshard: {msg}; using the pure-torch flatten fallback", file=sys.stderr)


def _extension_setup():
    """Returns (ext_modules, cmdclass) for setup()."""
    if os.environ.get("ZEROSHARD_NO_BUILD_EXT") == "1":
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except Exception as e:  # noqa: BLE001 - any import problem means "no extension"
        _warn(f"cannot import torch at build time ({e!r}); install with --no-build-isolation")
        return [], {}

    # at::parallel_for is an inline `#pragma omp parallel` in torch's headers when
    # ATen uses OpenMP: without -fopenmp our loop silently runs on one thread. Linking
    # libgomp is harmless: torch's bundled copy has the same soname and is loaded first.
    openmp = "OpenMP" in torch.__config__.parallel_info() and sys.platform.startswith("linux")
    cxx = ["-O3", "-g0"] + (["-fopenmp"] if openmp else [])  # -g0: no 10 MB of debug info
    link = ["-fopenmp"] if openmp else []
    sources = ["csrc/flatten.cpp", "csrc/plan.cpp"]

    # torch.cuda.is_available() is irrelevant at build time (build hosts often have no
    # GPU): what matters is a CUDA-enabled torch plus an nvcc to compile with.
    nvcc = cpp_extension.CUDA_HOME and os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
    if torch.version.cuda is not None and nvcc and os.path.exists(nvcc):
        ext = cpp_extension.CUDAExtension(
            "zeroshard._C",
            sources + ["csrc/flatten_cuda.cu"],
            define_macros=[("ZEROSHARD_WITH_CUDA", None)],
            depends=["csrc/runs.h", "csrc/copy_cpu.h", "csrc/py_args.h"],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]},
            extra_link_args=link,
        )
    else:
        ext = cpp_extension.CppExtension(
            "zeroshard._C", sources, depends=["csrc/runs.h", "csrc/copy_cpu.h", "csrc/py_args.h"], extra_compile_args={"cxx": cxx},
            extra_link_args=link,
        )

    class OptionalBuildExt(cpp_extension.BuildExtension):
        """BuildExtension whose failures downgrade to a warning."""

        def run(self):
            try:
                super().run()
            except Exception as e:  # noqa: BLE001 - no compiler, ABI check, compile error
                _warn(f"building the C++ extension failed ({e!r})")

    # Ninja is optional and would only parallelize over two source files.
    return [ext], {"build_ext": OptionalBuildExt.with_options(use_ninja=False)}


class NoIsolationDevelop(develop):
    """`setup.py develop` without build isolation.

    Without a pyproject.toml, `pip install --no-build-isolation -e .` runs this legacy
    command, and setuptools>=80 implements it as a nested `pip install -e . --use-pep517`
    that drops --no-build-isolation: the nested build would then fetch setuptools into an
    isolated env without torch and silently skip the extension. Legacy develop always ran
    in the current environment, so pass the flag on.
    """

    def run(self):
        cmd = [sys.executable, "-m", "pip", "install", "-e", ".", "--use-pep517"]
        cmd += ["--no-build-isolation"]
        cmd += ["--target", self.install_dir] * bool(self.install_dir)
        cmd += ["--no-deps"] * bool(self.no_deps) + ["--user"] * bool(self.user)
        cmd += ["--prefix", self.prefix] * bool(self.prefix)
        cmd += ["--index-url", self.index_url] * bool(self.index_url)
        subprocess.check_call(cmd)


ext_modules, cmdclass = _extension_setup()
cmdclass["develop"] = NoIsolationDevelop

setup(
    name="zeroshard",
    version="0.1.0",
    description="A from-scratch ZeRO-3 sharding engine for PyTorch with torch FSDP1 semantics",
    packages=find_packages(include=["zeroshard", "zeroshard.*"]),
    python_requires=">=3.10",
    install_requires=["torch==2.13.0"],
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
