"""Helpers for the metrics tests: groups whose ranks serve /metrics on free ports (started by
tests/lib/embps_servers.py), scrapes, a small parser of the text exposition format, promtool.
grouplib (tests/group/grouplib.py) is imported for the tests' raw gRPC clients.

Tests that need Debian's prometheus package (promtool, prometheus) exit 77 without it."""
import os
import re
import shutil
import subprocess
import sys
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "group"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "lib"))

import grouplib  # noqa: E402,F401
from embps_servers import Group, cli_binary, wait_for  # noqa: E402,F401

SKIP = 77


def need(tool):
    path = shutil.which(tool) or ("/usr/bin/" + tool if os.path.exists("/usr/bin/" + tool) else None)
    if not path:
        print("SKIP: %s is not installed (Debian's prometheus package; deploy/packages.sh "
              "installs it)" % tool)
        sys.exit(SKIP)
    return path


def metrics_group(n, *flags):
    """An n-rank CPU group, every rank with --metrics-listen on a free port; returns (group,
    [metrics URL per rank])."""
    g = Group(n, "--device", "cpu", *flags,
              rank_flags={r: ["--metrics-listen", "127.0.0.1:0"] for r in range(n)})
    urls = []
    for r, p in enumerate(g.procs):
        m = None
        ok = wait_for(lambda: re.search(r"metrics on (http://\S+/metrics)", p.text()), 10)
        m = re.search(r"metrics on (http://\S+/metrics)", p.text()) if ok else None
        if not m:
            g.close()
            raise RuntimeError("rank %d did not say where its metrics are:\n%s" % (r, g.logs()))
        urls.append(m.group(1))
    return g, urls


def scrape(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        assert r.status == 200, r.status
        ctype = r.headers.get("Content-Type", "")
        assert ctype.startswith("text/plain; version=0.0.4"), ctype
        return r.read().decode()


def cli(servers, *args, timeout=60):
    r = subprocess.run([cli_binary(), "--servers", servers, *args], capture_output=True,
                       text=True, timeout=timeout)
    if r.returncode != 0:
        raise AssertionError("embps %s failed (%d): %s%s" % (" ".join(args), r.returncode,
                                                             r.stdout, r.stderr))
    return r.stdout


def promtool_check(text):
    """Runs `promtool check metrics` on text; returns (ok, output)."""
    r = subprocess.run([need("promtool"), "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=60)
    return r.returncode == 0, r.stdout + r.stderr


SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text):
    """{(name, frozenset(labels.items())): value} and {name: type} of an exposition text."""
    samples, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split(" ", 3)
            types[name] = typ
        elif line and not line.startswith("#"):
            m = SAMPLE.match(line)
            assert m, "not a sample line: %r" % line
            labels = frozenset(LABEL.findall(m.group(2) or ""))
            samples[(m.group(1), labels)] = float(m.group(3))
    return samples, types


def value(samples, name, **labels):
    """The sample of name whose labels include labels (exactly one must match)."""
    want = set(labels.items())
    hits = [v for (n, ls), v in samples.items() if n == name and want <= set(ls)]
    assert len(hits) == 1, "%s%s: %d samples match" % (name, labels, len(hits))
    return hits[0]
