"""Builds the embps Python package with its own copy of the .proto files.

setuptools' build_py is extended to copy proto/embps/v1/embps.proto and
proto/grpc/health/v1/health.proto into the built package as embps/_proto/, and, when
grpc_tools is importable, to compile them there into the descriptor set the package would
otherwise build into a cache at first import (embps/_stubs.py). An installed copy thus needs
neither the source tree nor grpc_tools. The .proto files are read from $EMBPS_PROTO_DIR, else
../proto next to this file (the source tree).

    pip install --no-build-isolation ./python      # or: python3 python/setup.py build
"""
import importlib.util
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_stubs():
    """embps/_stubs.py loaded alone (importing the package would need the descriptors)."""
    spec = importlib.util.spec_from_file_location("_embps_stubs_for_setup",
                                                  os.path.join(HERE, "embps", "_stubs.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildWithProto(build_py):
    def run(self):
        super().run()
        stubs = _load_stubs()
        src = os.environ.get("EMBPS_PROTO_DIR") or os.path.join(os.path.dirname(HERE), "proto")
        dst = os.path.join(self.build_lib, "embps", "_proto")
        for f in stubs.PROTO_FILES:
            if not os.path.isfile(os.path.join(src, f)):
                raise SystemExit("embps setup: %s not found in %s (set EMBPS_PROTO_DIR to embps's "
                                 "proto/ directory)" % (f, src))
        if os.path.isdir(dst):
            shutil.rmtree(dst)
        for f in stubs.PROTO_FILES:
            os.makedirs(os.path.dirname(os.path.join(dst, f)), exist_ok=True)
            shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))
        try:
            stubs.generate(dst, os.path.join(dst, stubs.descriptor_name(stubs.proto_hash(dst))))
        except ImportError as e:  # no grpc_tools here: the package builds them at first import
            print("embps setup: descriptors not prebuilt (%s)" % e)


setup(cmdclass={"build_py": BuildWithProto})
