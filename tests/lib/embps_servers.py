"""embps-server processes for the Python tests, started and stopped in one place.

Every Python test that needs a running server or group gets it here: tests/interop
(embps_testlib.Server), tests/group and tests/python (grouplib.Group, grouplib.Proc), tests/metrics
(through grouplib), tests/system (test_cli.py, test_cli_auth.py). This module

  - finds the build's binaries (EMBPS_SERVER_BIN, EMBPS_CLI_BIN, else build/bin/);
  - picks free loopback ports (pick_ports: client ports and a peer-port offset, checked by
    binding);
  - starts one server alone (Server: --listen 127.0.0.1:0, its port read from its log) or an
    N-rank group (Group: --rank/--peers/--peer-port-offset, retried on new ports when a start
    fails), with extra flags, per-rank flags, environment and binary;
  - waits until each process has logged both "listening on 127.0.0.1:PORT" and "the group is
    ready": before the second a rank answers every call but health with UNAVAILABLE, and
    forming the group (even of one) takes seconds under a sanitizer (commit 027aa81: CI failed
    when a test called a one-rank server that only listened);
  - keeps each process's output (stdout and stderr) in a log file (Proc.text(), Group.logs());
  - stops with SIGTERM, bounded, and reports the exit code (0 is a clean exit; a process that
    does not exit is killed and reported as HUNG), and kills what it started when a start fails.

Tests of start-up itself (bad flags, exit codes, a rank failing bootstrap, refused restores)
use Proc directly, or subprocess, and read what the process did. Standard library only, so that
the tests without gRPC (tests/system) can use it.
"""
import os
import random
import re
import signal
import socket
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
READY_TIMEOUT = 60.0  # from start to "the group is ready", under a sanitizer too
STOP_TIMEOUT = 20.0  # from SIGTERM to exit
HUNG = "hung on SIGTERM (killed)"
READY_LINE = "the group is ready"

_rng = random.Random(int.from_bytes(os.urandom(8), "little"))


def server_binary():
    return os.environ.get("EMBPS_SERVER_BIN", os.path.join(ROOT, "build", "bin", "embps-server"))


def cli_binary():
    return os.environ.get("EMBPS_CLI_BIN", os.path.join(ROOT, "build", "bin", "embps"))


def wait_for(pred, timeout, interval=0.02):
    """pred() until it is true or timeout seconds have passed; returns its last value."""
    deadline = time.time() + timeout
    while True:
        v = pred()
        if v or time.time() >= deadline:
            return v
        time.sleep(interval)


# ---- ports ---------------------------------------------------------------------------------------

def port_free(port):
    """True when 127.0.0.1:port can be bound right now (no SO_REUSEADDR, so TIME_WAIT counts)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def port_open(port):
    """True when something accepts connections on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def free_ephemeral_port():
    """A port the kernel just handed out on 127.0.0.1 (free now; nothing holds it)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def pick_ports(n):
    """n client ports and a peer-port offset such that every client port and every client port
    plus the offset are free. Both sets stay below the kernel's ephemeral range (32768-60999):
    client ports in 10000-19999 and an offset of 10000 + random, so peer ports fall in
    20000-32699 and never on a port that an outgoing connection left in TIME_WAIT (a 32-rank
    group leaves some 2,000 of those a run, which once made every try fail); both are checked by
    binding (and a start that still loses a race is retried by Group)."""
    for _ in range(500):
        offset = 10000 + _rng.randrange(2700)
        ports = _rng.sample(range(10000, 20000), n)
        if all(port_free(p) and port_free(p + offset) for p in ports):
            return ports, offset
    raise RuntimeError("no free loopback ports found")


# ---- one process ---------------------------------------------------------------------------------

class Proc:
    """One embps-server process (binary: server_binary() unless given; args: its flags) with its
    output in a log file; env adds to this process's environment. Nothing is waited for: see
    wait_ready, or Server and Group."""

    def __init__(self, args, env=None, binary=None, prefix="embps-group-"):
        self.args = args
        self.log = tempfile.NamedTemporaryFile(prefix=prefix, suffix=".log", delete=False)
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen([binary or server_binary(), *args], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=full_env)
        self.pid = self.proc.pid

    def text(self):
        """Everything it has written so far."""
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def alive(self):
        return self.proc.poll() is None

    def wait(self, timeout):
        """Its exit code, or None when it still runs after timeout seconds."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def wait_ready(self, timeout, port=None):
        """Waits until it has logged "listening on 127.0.0.1:PORT" (that port, or any when port is
        None) and "the group is ready". Returns the port, or None when it exited first or is
        not ready after timeout seconds."""
        pat = re.compile(r"listening on 127\.0\.0\.1:(%s)(?!\d)" % (port or r"\d+"))
        found = []

        def ready():
            text = self.text()
            m = pat.search(text)
            if m and READY_LINE in text:
                found.append(int(m.group(1)))
                return True
            return not self.alive()
        wait_for(ready, timeout)
        return found[0] if found and self.alive() else None

    def stop(self, timeout=STOP_TIMEOUT):
        """SIGTERM, bounded wait, SIGKILL if it did not exit. Returns the exit code (negative:
        killed by that signal), or HUNG when it had to be killed."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            if self.wait(timeout) is None:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait()
                return HUNG
        return self.proc.returncode

    def kill(self):
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait()

    def cleanup(self):
        """Kills it if it still runs and removes its log."""
        self.kill()
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


class StartError(RuntimeError):
    """A server or group that did not get ready; the message holds the logs."""


class Server(Proc):
    """One embps-server without --peers on a free loopback port (--listen 127.0.0.1:0, the port
    read from its "listening on" line), ready when constructed: port, address. flags, env and
    binary as for Proc. A start that fails kills it and raises StartError with its log.
    close() stops it and returns the exit code; after it, last_log holds the whole log."""

    def __init__(self, *flags, env=None, binary=None, ready_timeout=READY_TIMEOUT,
                 prefix="embps-server-"):
        super().__init__(["--listen", "127.0.0.1:0", *flags], env=env, binary=binary,
                         prefix=prefix)
        self.port = self.wait_ready(ready_timeout)
        self.code = None
        self.last_log = None
        if self.port is None:
            text = self.text()
            self.cleanup()
            raise StartError("embps-server did not start (listening, group ready):\n" + text)
        self.address = "127.0.0.1:%d" % self.port

    def log_text(self):
        return self.text() if self.last_log is None else self.last_log

    def close(self, timeout=STOP_TIMEOUT):
        """SIGTERM (see Proc.stop); returns the exit code, 0 when it exited cleanly. Removes the
        log (kept in last_log). Idempotent."""
        if self.last_log is None:
            self.code = self.stop(timeout)
            self.last_log = self.text()
            self.cleanup()
        return self.code

    def close_checked(self, testcase):
        """close(), failing testcase (with the log) unless the exit was clean."""
        code = self.close()
        testcase.assertEqual(code, 0, "embps-server exited with %s on SIGTERM:\n%s"
                             % (code, self.last_log))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- a group -------------------------------------------------------------------------------------

class GroupStartError(StartError):
    pass


class Group:
    """n ranks on loopback, every one ready when constructed. flags go to every rank;
    rank_flags[r] (optional) to rank r only; binary and env as for Proc. Retries with new
    ports when a start fails (a port lost to another process), killing the ranks of the failed
    try. addresses: every rank's "127.0.0.1:port"; servers: them joined with commas; procs: the
    ranks' Procs."""

    def __init__(self, n, *flags, rank_flags=None, attempts=3, ready_timeout=READY_TIMEOUT,
                 binary=None, env=None):
        self.n = n
        self.binary, self.env = binary, env
        self.procs = []
        last = ""
        for attempt in range(attempts):
            try:
                self._start(flags, rank_flags or {}, ready_timeout)
                return
            except GroupStartError as e:
                last = str(e)
                self._kill_all()
        raise GroupStartError("a %d-rank group did not start in %d attempts; last:\n%s" %
                              (n, attempts, last))

    def _start(self, flags, rank_flags, ready_timeout):
        self.ports, self.offset = pick_ports(self.n)
        self.addresses = ["127.0.0.1:%d" % p for p in self.ports]
        self.peers = ",".join(self.addresses)
        self.procs = []
        t0 = time.time()
        for r in range(self.n):
            args = ["--rank", str(r), "--peers", self.peers, "--peer-port-offset",
                    str(self.offset), *flags, *rank_flags.get(r, [])]
            self.procs.append(Proc(args, env=self.env, binary=self.binary))
        deadline = time.time() + ready_timeout
        # Every rank is watched at once: a rank that exits (a port lost to another process)
        # fails the try at once, instead of after the others have waited out the deadline for
        # it (they never get ready without it).
        pending = list(range(self.n))
        while pending:
            for r in list(pending):
                p = self.procs[r]
                if p.wait_ready(0, port=self.ports[r]) is not None:
                    pending.remove(r)
                elif not p.alive() or time.time() >= deadline:
                    raise GroupStartError("rank %d did not get ready (listening, group ready):\n%s"
                                          % (r, self.logs()))
            if pending:
                time.sleep(0.02)
        self.ready_seconds = time.time() - t0  # from starting the ranks to all ready

    def logs(self):
        return "\n".join("---- rank %d (pid %d) ----\n%s" % (r, p.pid, p.text()[-4000:])
                         for r, p in enumerate(self.procs))

    @property
    def servers(self):
        return self.peers

    def kill(self, rank):
        self.procs[rank].kill()

    def _kill_all(self):
        for p in self.procs:
            p.cleanup()
        self.procs = []

    def close(self):
        """Stops every rank still running with SIGTERM (in parallel); returns {rank: code} for
        them (HUNG for one that had to be killed). Removes the logs (kept in last_logs)."""
        codes = {}
        alive = [r for r, p in enumerate(self.procs) if p.alive()]
        for r in alive:
            os.kill(self.procs[r].pid, signal.SIGTERM)
        for r in alive:
            p = self.procs[r]
            if p.wait(STOP_TIMEOUT) is None:
                p.kill()
                codes[r] = HUNG
            else:
                codes[r] = p.proc.returncode
        self.last_logs = self.logs()
        self._kill_all()
        return codes

    def close_checked(self, testcase):
        """close(), failing testcase (with the logs) unless every rank exited 0."""
        codes = self.close()
        for r, c in codes.items():
            testcase.assertEqual(c, 0, "rank %d exited with %s on SIGTERM:\n%s" %
                                 (r, c, self.last_logs))
