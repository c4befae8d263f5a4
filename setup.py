"""pip install --no-build-isolation [-e] .

Builds through the project's CMake (the same build the C++ tests and examples use) and puts
zeroshard._C and libzeroshard.so into the package; only those two are built, and
ZEROSHARD_CMAKE_ARGS="-DZEROSHARD_BUILD_TESTS=ON -DZEROSHARD_BUILD_EXAMPLES=ON" adds the Catch2
tests and the C++ examples. Build isolation must be off: the extension is compiled against the
torch already installed in this environment.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent

try:
    import torch  # noqa: F401
except ImportError:
    sys.exit(
        "zeroshard builds against the installed torch, which this environment lacks.\n"
        "Install torch first (pip install torch==2.13.0), then: pip install --no-build-isolation ."
    )


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = Path(os.environ.get("ZEROSHARD_BUILD_DIR", ROOT / "build"))
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('ZEROSHARD_BUILD_TYPE', 'Release')}",
        ]
        if shutil.which("ninja") and not (build_dir / "CMakeCache.txt").exists():
            configure += ["-G", "Ninja"]
        # What a user imports, and no more: the Catch2 suite and the examples are about half the
        # compile time. Stated every time, since a build directory keeps a configure's options;
        # ZEROSHARD_CMAKE_ARGS comes after it and may turn them on (scripts/setup.sh --all does).
        configure += ["-DZEROSHARD_BUILD_TESTS=OFF", "-DZEROSHARD_BUILD_EXAMPLES=OFF"]
        if os.environ.get("ZEROSHARD_CMAKE_ARGS"):
            configure += os.environ["ZEROSHARD_CMAKE_ARGS"].split()
        subprocess.check_call(configure)
        jobs = os.environ.get("ZEROSHARD_BUILD_JOBS", str(os.cpu_count() or 2))
        subprocess.check_call(["cmake", "--build", str(build_dir), "--parallel", jobs])

        # The module and the core library it links travel together inside the package.
        destination = Path(self.get_ext_fullpath(ext.name)).parent
        destination.mkdir(parents=True, exist_ok=True)
        built = build_dir / "python" / "zeroshard"
        for library in list(built.glob("_C*.so")) + list(built.glob("libzeroshard.so*")):
            shutil.copy2(library, destination / library.name)


setup(
    name="zeroshard",
    version="0.1.0",
    description="ZeRO stages 1-3 sharding engine for PyTorch, written as a LibTorch extension",
    package_dir={"": "python"},
    packages=["zeroshard", "zeroshard.deepspeed", "zeroshard.planner"],
    ext_modules=[CMakeExtension("zeroshard._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
    zip_safe=False,
)
