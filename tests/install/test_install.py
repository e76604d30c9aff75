"""The installed C client library, used from outside the tree as a user would use it.

`cmake --install` puts the build tree into a temporary prefix; then, with nothing of the source
tree on any path:
  - every installed header compiles alone (C11, -pedantic, -Werror; and as C++ when a C++
    compiler is there), so <embps/embps.h> is self-contained;
  - libembps.so's SONAME is libembps.so.<SOVERSION>, its symlinks are in place, and its dynamic
    symbols are exactly the functions the installed headers declare, each with EMBPS_EXPORT (a
    declared function that is not exported, or an internal one that leaks, fails);
  - example.c (a user's program) is built four times: with `pkg-config --cflags --libs embps`
    (shared), with `pkg-config --static` against libembps.a, and by a CMake project with
    find_package(embps) linking embps::embps and embps::embps_static;
  - each build runs against a real embps-server on a free loopback port and must exit 0.
Environment (set by CMakeLists.txt): EMBPS_BUILD_DIR, EMBPS_SERVER_BIN, EMBPS_CMAKE, EMBPS_CC,
EMBPS_NM, EMBPS_READELF, EMBPS_PKG_CONFIG, EMBPS_VERSION_EXPECTED, EMBPS_SOVERSION and
EMBPS_SANITIZE (the build's sanitizers, which the user's program must be built with too).
Standard library only; every subprocess has a timeout.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "lib"))
import embps_servers  # noqa: E402

ENV = os.environ
BUILD_DIR = ENV["EMBPS_BUILD_DIR"]
SERVER_BIN = ENV["EMBPS_SERVER_BIN"]
CMAKE = ENV.get("EMBPS_CMAKE", "cmake")
CC = ENV.get("EMBPS_CC", "cc")
NM = ENV.get("EMBPS_NM", "nm")
READELF = ENV.get("EMBPS_READELF", "readelf")
PKG_CONFIG = ENV.get("EMBPS_PKG_CONFIG", "pkg-config")
VERSION = ENV["EMBPS_VERSION_EXPECTED"]
SOVERSION = ENV["EMBPS_SOVERSION"]
SANITIZE = ["-fsanitize=" + ENV["EMBPS_SANITIZE"]] if ENV.get("EMBPS_SANITIZE") else []
TIMEOUT = 60

STRICT = ["-std=c11", "-Wall", "-Wextra", "-pedantic", "-Werror"]


def run(cmd, env=None, cwd=None, timeout=TIMEOUT):
    """Runs cmd and returns its stdout; fails the test with its output when it exits non-zero."""
    full_env = dict(ENV)
    full_env.update(env or {})
    p = subprocess.run(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError("%s exited with %d:\n%s" % (shlex.join(cmd), p.returncode, p.stdout))
    return p.stdout


class Server(embps_servers.Server):
    """embps-server on a free loopback port, up once its group is ready (tests/lib/
    embps_servers.py); close() prints its log when it does not exit 0."""

    def __init__(self):
        super().__init__(binary=SERVER_BIN, prefix="embps-install-server-")

    def close(self):
        rc = super().close()
        if rc != 0:
            print("embps-server exited with %s; its log:\n%s" % (rc, self.last_log))
        return rc


class InstalledLibraryTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="embps-install-")
        cls.prefix = os.path.join(cls.tmp, "prefix")
        run([CMAKE, "--install", BUILD_DIR, "--prefix", cls.prefix])
        cls.pc_dir = find_one(cls.prefix, "embps.pc")
        cls.pc_env = {"PKG_CONFIG_PATH": cls.pc_dir}
        cls.libdir = pkg_config(cls, "--variable=libdir").strip()
        cls.includedir = pkg_config(cls, "--variable=includedir").strip()
        # A user's program, away from the tree.
        cls.example = os.path.join(cls.tmp, "example.c")
        shutil.copy(os.path.join(HERE, "example.c"), cls.example)
        cls.server = Server()
        cls.tables = 0

    @classmethod
    def tearDownClass(cls):
        rc = cls.server.close()
        shutil.rmtree(cls.tmp, ignore_errors=True)
        if rc != 0:
            raise AssertionError("embps-server exited with %s" % rc)

    def run_example(self, binary):
        """Runs a build of example.c against the server with a table of its own."""
        type(self).tables += 1
        out = run([binary, self.server.address, "install_t%d" % self.tables])
        self.assertIn("ok:", out)

    def test_layout(self):
        self.assertEqual(self.libdir, os.path.join(self.prefix, "lib"))
        self.assertEqual(self.includedir, os.path.join(self.prefix, "include"))
        for name in ["embps.h", "status.h", "dtype.h", "optimizer.h", "eviction.h", "pooling.h"]:
            self.assertTrue(os.path.isfile(os.path.join(self.includedir, "embps", name)), name)
        real = "libembps.so." + VERSION
        self.assertTrue(os.path.isfile(os.path.join(self.libdir, real)))
        self.assertEqual(os.readlink(os.path.join(self.libdir, "libembps.so." + SOVERSION)), real)
        self.assertEqual(os.readlink(os.path.join(self.libdir, "libembps.so")),
                         "libembps.so." + SOVERSION)
        self.assertTrue(os.path.isfile(os.path.join(self.libdir, "libembps.a")))
        for name in ["embps-config.cmake", "embps-config-version.cmake", "embps-targets.cmake"]:
            self.assertTrue(os.path.isfile(os.path.join(self.libdir, "cmake", "embps", name)))
        self.assertEqual(pkg_config(self, "--modversion").strip(), VERSION)
        dynamic = run([READELF, "-d", os.path.join(self.libdir, real)])
        self.assertIn("Library soname: [libembps.so.%s]" % SOVERSION, dynamic)
        self.assertNotRegex(dynamic, r"\((RPATH|RUNPATH)\)")

    def test_headers_self_contained(self):
        headers = sorted(os.listdir(os.path.join(self.includedir, "embps")))
        self.assertIn("embps.h", headers)
        compilers = [(CC, ["-x", "c"] + STRICT)]
        cxx = shutil.which("c++")
        if cxx:
            compilers.append((cxx, ["-x", "c++", "-std=c++11", "-Wall", "-Wextra", "-pedantic",
                                    "-Werror"]))
        for compiler, flags in compilers:
            for h in headers:
                src = "#include <embps/%s>\n#include <embps/%s>\nint main(void) { return 0; }\n" % (
                    h, h)  # twice: the include guard works
                p = subprocess.run([compiler, *flags, "-fsyntax-only", "-I" + self.includedir,
                                    "-"], input=src, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)
                self.assertEqual(p.returncode, 0, "%s alone (%s):\n%s" % (h, compiler, p.stdout))

    def test_exports_are_the_declared_api(self):
        header = ""
        for h in os.listdir(os.path.join(self.includedir, "embps")):
            with open(os.path.join(self.includedir, "embps", h)) as f:
                header += f.read()
        # Every function declaration starts a line (comments, preprocessor lines and typedefs
        # aside) and must carry EMBPS_EXPORT.
        declared = set()
        for m in re.finditer(r"^(?![#/ }]|typedef)([^\n(]*?)\b(embps_\w+)\s*\(", header, re.M):
            self.assertIn("EMBPS_EXPORT", m.group(1), "%s is declared without EMBPS_EXPORT"
                          % m.group(2))
            declared.add(m.group(2))
        self.assertGreater(len(declared), 20)
        so = os.path.join(self.libdir, "libembps.so")
        exported = set()
        for line in run([NM, "-D", "--defined-only", so]).splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] in "TtWwDdBbRrVvi":
                exported.add(parts[2])
        self.assertEqual(sorted(declared - exported), [], "declared but not exported")
        self.assertEqual(sorted(exported - declared), [], "exported but not declared")

    def test_pkg_config_shared(self):
        flags = shlex.split(pkg_config(self, "--cflags", "--libs"))
        self.assertIn("-I" + self.includedir, flags)
        exe = os.path.join(self.tmp, "example_pc_shared")
        run([CC, *STRICT, *SANITIZE, self.example, "-o", exe, *flags,
             "-Wl,-rpath," + self.libdir, "-lm"], cwd=self.tmp)
        self.assertIn("libembps.so." + SOVERSION, needed(exe))
        self.run_example(exe)

    def test_pkg_config_static(self):
        cflags = shlex.split(pkg_config(self, "--cflags"))
        libs = shlex.split(pkg_config(self, "--static", "--libs"))
        self.assertIn("-lembps", libs)
        libs = [os.path.join(self.libdir, "libembps.a") if x == "-lembps" else x for x in libs]
        exe = os.path.join(self.tmp, "example_pc_static")
        run([CC, *STRICT, *SANITIZE, *cflags, self.example, "-o", exe, *libs, "-lm"],
            cwd=self.tmp)
        self.assertFalse([n for n in needed(exe) if n.startswith("libembps")])
        self.run_example(exe)

    def test_cmake_find_package(self):
        build = os.path.join(self.tmp, "cmake-build")
        flags = " ".join(SANITIZE)
        run([CMAKE, "-S", os.path.join(HERE, "project"), "-B", build,
             "-DCMAKE_PREFIX_PATH=" + self.prefix, "-DCMAKE_C_COMPILER=" + CC,
             "-DCMAKE_C_STANDARD=11", "-DCMAKE_C_FLAGS=-Wall -Wextra -pedantic -Werror " + flags,
             "-DCMAKE_EXE_LINKER_FLAGS=" + flags, "-DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF",
             "-DEXAMPLE_SOURCE=" + self.example, "-DEXPECTED_VERSION=" + VERSION])
        with open(os.path.join(build, "CMakeCache.txt")) as f:
            m = re.search(r"^embps_DIR:PATH=(.*)$", f.read(), re.M)
        self.assertTrue(m and m.group(1).startswith(self.prefix + os.sep),
                        "find_package(embps) did not find the installed copy: %r" % (m and m.group(1)))
        run([CMAKE, "--build", build, "-j", "2"])
        shared = os.path.join(build, "example_shared")
        static = os.path.join(build, "example_static")
        self.assertIn("libembps.so." + SOVERSION, needed(shared))
        self.assertFalse([n for n in needed(static) if n.startswith("libembps")])
        self.run_example(shared)
        self.run_example(static)


def find_one(root, name):
    """The directory under root holding the file name."""
    hits = [d for d, _, files in os.walk(root) if name in files]
    if len(hits) != 1:
        raise AssertionError("%s: %d copies of %s installed" % (root, len(hits), name))
    return hits[0]


def pkg_config(test, *args):
    return run([PKG_CONFIG, *args, "embps"], env=test.pc_env)


def needed(binary):
    """The DT_NEEDED entries of an ELF file."""
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", run([READELF, "-d", binary]))


if __name__ == "__main__":
    unittest.main(verbosity=2)
