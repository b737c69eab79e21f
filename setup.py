"""The extension of moed's Python package, moed._C, built by CMake (pyproject.toml has the rest).

pip builds in the source tree, so this reuses the CMake build in build/ ($MOED_BUILD_DIR if set)
and only brings the target moed_python up to date; with no build there yet it configures one
(Release) for the running interpreter. setuptools' own files go to <build>/setuptools.
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD_DIR = os.path.abspath(os.environ.get("MOED_BUILD_DIR") or os.path.join(ROOT, "build"))


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        if not os.path.exists(os.path.join(BUILD_DIR, "CMakeCache.txt")):
            # NOTE: the interpreter behind a virtual environment, so that the tests CMake
            # registers keep working without it; the extension's ABI is the same.
            python = os.path.realpath(sys.executable)
            cmd = ["cmake", "-S", ROOT, "-B", BUILD_DIR, "-DCMAKE_BUILD_TYPE=Release",
                   f"-DPython3_EXECUTABLE={python}"]
            if shutil.which("ninja"):
                cmd += ["-G", "Ninja"]
            subprocess.run(cmd, check=True)
        subprocess.run(["cmake", "--build", BUILD_DIR, "--target", "moed_python", "-j",
                        str(os.cpu_count() or 1)], check=True)
        built = os.path.join(BUILD_DIR, "python", "moed", "_C" + sysconfig.get_config_var("EXT_SUFFIX"))
        if not os.path.exists(built):
            found = glob.glob(os.path.join(BUILD_DIR, "python", "moed", "_C*.so"))
            sys.exit(f"moed: {BUILD_DIR} has {found or 'no moed._C'}, not {os.path.basename(built)} "
                     f"for {sys.executable}; build with -DPython3_EXECUTABLE=<this python> "
                     "or set MOED_BUILD_DIR to another build directory")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy(built, target)


os.makedirs(BUILD_DIR, exist_ok=True)
setup(ext_modules=[Extension("moed._C", sources=[])], cmdclass={"build_ext": CMakeBuild},
      options={"build": {"build_base": os.path.join(BUILD_DIR, "setuptools")},
               "egg_info": {"egg_base": BUILD_DIR}})
