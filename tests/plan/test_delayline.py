"""tests/plan/delayline.c alone (the delay line test_plan_delay.py routes packets through): in a
namespace of its own, with a 1 MB ring and a 1 s delay, UDP datagrams of 8000 bytes sent to an
address routed into its tun in three bursts:
- A, 60 at t = 0: all held (they fill 480 KB of the ring);
- B, 200 at t = 0.3 s, while A is held: some 60 fit between A and the ring's end, the rest are
  dropped and counted;
- C, 30 at t = 1.15 s, after A went out (t = 1 s) and before B goes (t = 1.3 s): they no longer
  fit at the end, so the ring wraps around to its start, freed by A.
At SIGTERM (t = 2.4 s) its counters must add up: every packet in went out or was dropped, none
still held, no write errors, bytes out equal to the packets out times their size, drops in B
alone (0 < dropped < 200, out >= 90), and the ring wrapped. The bursts' times leave 150 ms either
side. Also its usage errors (exit 2) and its exit at the end of its stdin.

Needs root and /dev/net/tun, else prints "SKIP: ..." and exits 77. EMBPS_DELAYLINE_BIN names
the binary."""
import os
import re
import subprocess
import sys
import time

import planlib
from planlib import sh, skip

NS = "embps-dl-%d" % os.getpid()
SIZE = 8000  # UDP payload; + 28 bytes of IPv4 and UDP headers on the tun


def binary():
    return os.environ.get("EMBPS_DELAYLINE_BIN", os.path.join(
        planlib.HERE, "..", "..", "build", "bin", "delayline"))


def burst(count):
    """count datagrams to 10.99.0.1 (routed into the tun) from inside the namespace."""
    code = ("import socket\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
            "for i in range(%d): s.sendto(bytes(%d),('10.99.0.1',9))\n" % (count, SIZE))
    sh("ip", "netns", "exec", NS, sys.executable, "-c", code)


def counters(text):
    m = re.search(r"in (\d+) packets (\d+) bytes; out (\d+) packets (\d+) bytes; dropped (\d+) "
                  r"\(ring full\); write errors (\d+); held at exit (\d+);.*; wrapped (\d+);",
                  text)
    if not m:
        raise AssertionError("no counters in the delay line's output: %r" % text)
    return dict(zip(("in", "in_bytes", "out", "out_bytes", "dropped", "write_errors", "held",
                     "wrapped"),
                    map(int, m.groups())))


def main():
    if os.geteuid() != 0:
        skip("a tun in a namespace needs root (uid %d)" % os.geteuid())
    if not os.access(binary(), os.X_OK):
        skip("no delay line binary at %s (EMBPS_DELAYLINE_BIN)" % binary())
    if not os.path.exists("/dev/net/tun"):
        skip("/dev/net/tun is missing: no tun driver")
    for args in (["--tun", "x", "--delay-ms", "-1"], ["--tun", "x", "--delay-ms", "1",
                                                      "--ring-mbytes", "0"],
                 ["--delay-ms", "1"], ["--tun", "x", "--delay-ms", "1ms"], ["--tun"]):
        r = subprocess.run([binary(), *args], capture_output=True, text=True, timeout=10)
        if r.returncode != 2 or "usage:" not in r.stderr:
            raise AssertionError("delayline %s: exit %d, %r" % (" ".join(args), r.returncode,
                                                                r.stderr))
    r = sh("ip", "netns", "add", NS, check=False)
    if r.returncode != 0:
        skip("ip netns add is not permitted here: " + r.stderr.strip())
    line = None
    try:
        line = subprocess.Popen(["ip", "netns", "exec", NS, binary(), "--tun", "dl0",
                                 "--delay-ms", "1000", "--ring-mbytes", "1"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = line.stdout.readline()
        if ready.strip() != "ready dl0":
            raise AssertionError("the delay line did not start: %r" % ready)
        # No IPv6 on the tun (before it is up): its router solicitations and reports would be
        # packets this test did not send.
        sh("ip", "netns", "exec", NS, "sysctl", "-qw", "net.ipv6.conf.dl0.disable_ipv6=1")
        sh("ip", "-n", NS, "link", "set", "dl0", "mtu", "9000", "up")
        sh("ip", "-n", NS, "route", "add", "10.99.0.0/24", "dev", "dl0")
        t0 = time.monotonic()
        for at, count in ((0.0, 60), (0.3, 200), (1.15, 30), (2.4, 0)):
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            if count:
                burst(count)
        line.terminate()
        out, _ = line.communicate(timeout=10)
    finally:
        if line and line.poll() is None:
            line.kill()
            line.communicate()
        sh("ip", "netns", "del", NS, check=False)
    print("[delayline] " + out.strip())
    c = counters(out)
    pkt = SIZE + 28
    ok = (c["in"] == 290 and c["in_bytes"] == 290 * pkt and c["held"] == 0
          and c["write_errors"] == 0 and c["out"] + c["dropped"] == c["in"]
          and c["out_bytes"] == c["out"] * pkt and 0 < c["dropped"] < 200
          and c["out"] >= 60 + 30 and c["wrapped"] >= 1)
    if not ok:
        print("FAIL: the counters do not add up for 60, 200 and 30 packets of %d bytes through "
              "a 1 MB ring with a wrap: %s" % (pkt, c))
        return 1
    # Its stdin at EOF: it exits by itself.
    sh("ip", "netns", "add", NS)
    try:
        p = subprocess.Popen(["ip", "netns", "exec", NS, binary(), "--tun", "dl1", "--delay-ms",
                              "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        p.stdout.readline()
        p.stdin.close()
        if p.wait(10) != 0:
            raise AssertionError("the delay line exited %d at EOF on stdin" % p.returncode)
    finally:
        sh("ip", "netns", "del", NS, check=False)
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
