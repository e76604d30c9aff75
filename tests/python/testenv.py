"""Imports the embps package (python/) and tests/group/grouplib.py into one process.

They collide on the name `embps`: grouplib's stubs (tests/interop/embps_testlib.py) are generated
as a package embps.v1 in a temporary folder put first on sys.path, while the library is the
package embps. So the library is imported first and set aside, grouplib is imported (binding its
embps.v1 modules), and then the library's modules are put back under their names; grouplib only
uses the message classes it bound at import, so both work. The library's message classes live
in a private descriptor pool (python/embps/_stubs.py), so the two sets of classes never meet.

Usage: from testenv import embps, gl (gl is grouplib)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PYTHON_DIR = os.path.join(ROOT, "python")

if PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)


def _ours(name):
    return name == "embps" or name.startswith("embps.")


import embps  # noqa: E402

_library = {k: v for k, v in sys.modules.items() if _ours(k)}
for _k in _library:
    del sys.modules[_k]
sys.path.insert(0, os.path.join(ROOT, "tests", "group"))
import grouplib as gl  # noqa: E402,F401

for _k in [k for k in sys.modules if _ours(k)]:
    del sys.modules[_k]
sys.modules.update(_library)
assert sys.modules["embps"] is embps and hasattr(embps, "Client")
