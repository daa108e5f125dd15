"""Builds the C codec (`lynx_kernels._ckernels`, kernels/csrc/); everything else about the package
is in pyproject.toml. The extension is optional: without a compiler the package still installs and
lynx_kernels falls back to its torch reference (`lynx_kernels.ops_cpu.unavailable_reason()`)."""

from pathlib import Path

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "lynx_kernels._ckernels",
    sources=["kernels/csrc/lynx_codec.c", "kernels/csrc/module.c"],
    depends=sorted(str(p) for p in Path("kernels/csrc").glob("*.h")),
    # IEEE-exact: no multiply-add contraction, no fast-math reassociation, so the C kernels round
    # exactly like the torch reference.
    extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math"],
    optional=True,
)])
