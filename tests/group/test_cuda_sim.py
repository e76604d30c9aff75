"""The CUDA backend's whole server path, through real gRPC, on the simulated CUDA runtime:
embps-server-sim (tests/unit/engine_sim) is server/main.c and the server core built as the CUDA
build builds them, with engine_cuda.c on the simulator's runtime, kernels and NCCL (a loopback
TCP stand-in). SIM_CUDA_DEVICES sets how many devices a process sees; SIM_CUDA_REPORT=1 makes
it report at exit what it allocated and what it left on its devices.

OneRankTest: a 1-rank --device cuda server beside a --device cpu embps-server: four tables
  (f32 width 128 and bf16 width 64, rowwise_adagrad and adam), lookups with duplicates and
  padding token 0, pushes (one gated by a NaN, one with a NaN on padding, one async), lookups
  again and a large lookup that the CUDA engine returns in chunks: rows and push replies
  bitwise the CPU server's. GetStats and `embps stats` say backend cuda; the log shows the
  backend, the device and the simulated communicator; the request buffers reached the engine
  pinned (the service's pool), and the server leaves nothing on the device when it exits 0 on
  SIGTERM.
BackendChoiceTest: main.c's --device choice: auto picks cuda with a device and cpu without;
  cuda:N picks device N; --device cuda without a device and a cuda:N that does not exist are
  refused (exit 2, naming the flag).
GroupTest: 2-, 3- and 4-rank --device cuda groups (each rank its own simulated device: the
  default rank-modulo choice, and cuda:N) against CPU groups of the same size: bitwise equal, and
  the f32 tables equal to the numpy reference at 1e-6. On 4 ranks the row statistics are
  combined by owner (round_cost.h: 3 partials a row), on 2 and 3 gathered whole.
RankDiesTest: a rank of a 3-rank CUDA group dies; the others fail with UNAVAILABLE naming it
  and still exit 0 with nothing left on their devices.
DeviceClaimTest: two ranks on one host claiming one device are refused with the leader's
  message, and every rank exits non-zero within a bound.
IncrementalCheckpointTest: --checkpoint-full-every 100 on a 2-rank CUDA group, whose dirty rows
  are marked on the device and taken at each capture, beside a CPU group running the same
  pushes: each checkpoint writes the CPU group's bytes (the same rows: those pushed since the
  previous one), and the chain restores onto a CPU server bitwise what the CUDA group held.
HashTablesTest: hash-keyed tables (the index on the host, rows on the device) on 1-, 2- and
  4-rank --device cuda groups fed test_group_hash.py's fixed sequence (lru with admission, lfu,
  ttl; evictions, dropped gradients, a NaN step): answers, final rows of every key and TableStats
  bitwise those of a 1-rank CPU server; nothing left on the devices at exit.
FeaturesTest: feature batches (test_group_features.py's tables and features: every pooling mode,
  dense f32 and bf16 and hash-keyed tables) on 1- and 2-rank --device cuda groups: lookups before
  and after two pushes, push steps and the final tables bitwise those of a CPU group of the
  same size; nothing left on the devices at exit.

Run some classes with `test_cuda_sim.py OneRankTest BackendChoiceTest` (as ctest does).
Needs EMBPS_SIM_SERVER_BIN (embps-server-sim), EMBPS_SERVER_BIN and EMBPS_CLI_BIN."""
import json
import os
import re
import shutil
import socket
import tempfile
import time
import unittest

import numpy as np

import grouplib as gl
from grouplib import pb

SIM = os.environ.get("EMBPS_SIM_SERVER_BIN",
                     os.path.join(gl.lib.ROOT, "build", "bin", "embps-server-sim"))
EXIT_BOUND = 30.0  # seconds within which a refused or stopped server must have exited
DTYPES = {"f32": pb.DTYPE_F32, "bf16": pb.DTYPE_BF16}
READY = re.compile(r"comm nccl rank (\d+)/(\d+) on device (\d+): ready \(simulated")
REPORT = re.compile(r"sim_cuda report: device (\d+): (\d+) device and (\d+) pinned allocations "
                    r"made; live at exit: (\d+) device allocations, (\d+) pinned allocations, "
                    r"(\d+) streams, (\d+) events, (\d+) queued operations")
QUERIES = re.compile(r"sim_cuda report: pointer queries: (\d+) pinned host, (\d+) device, "
                     r"(\d+) pageable host")


def sim_env(devices):
    return {"SIM_CUDA_DEVICES": str(devices), "SIM_CUDA_REPORT": "1"}


def bf16_bytes(a):
    """f32 values as bf16 (truncated: any bf16 pattern is a valid gradient), little endian."""
    return (np.asarray(a, dtype="<f4").view("<u4") >> 16).astype("<u2").tobytes()


def spec(name, rows, width, dtype, opt):
    kw = {"rowwise_adagrad": dict(lr=0.05, half_life=5.0, weight_decay=0.001,
                                  initial_accumulator=0.1),
          "adam": dict(lr=0.01, weight_decay=0.01),
          "sgd": dict(lr=0.05),
          "adagrad": dict(lr=0.05, half_life=10.0, initial_accumulator=0.1)}[opt]
    return pb.TableSpec(name=name, rows=rows, emb_width=width, dtype=DTYPES[dtype], seed=1234,
                        optimizer=pb.OptimizerConfig(kind=gl.OPT[opt], eps=1e-6, **kw))


class Client:
    """Raw grpcio to every rank of a group (one address for a single server): splits a batch into
    contiguous shards, sends them concurrently, returns the replies' bytes."""

    def __init__(self, addresses):
        self.n = len(addresses)
        self.chans = [gl.lib.channel(a) for a in addresses]
        self.stubs = [gl.pbg.EmbeddingServiceStub(c) for c in self.chans]

    def close(self):
        for c in self.chans:
            c.close()

    def create(self, s):
        return self.stubs[0].CreateTable(pb.CreateTableRequest(spec=s), timeout=gl.CALL_TIMEOUT)

    def lookup(self, table, tokens):
        """The batch's rows, every shard's reply concatenated, as bytes."""
        tok = np.asarray(tokens, dtype="<i8")
        s, bid = len(tok) // self.n, gl.next_batch_id()
        futs = [self.stubs[r].Lookup.future(pb.LookupRequest(
            table=table, batch_id=bid, shard_index=r, shard_count=self.n,
            tokens_per_batch=len(tok), tokens=tok[r * s:(r + 1) * s].tobytes()),
            timeout=gl.CALL_TIMEOUT) for r in range(self.n)]
        return b"".join(f.result().rows for f in futs)

    def push(self, table, tokens, grads, dtype, mode=pb.UPDATE_MODE_SYNC):
        """Every rank's reply as (applied, skipped, grad_norm, num_unique, ordered)."""
        tok = np.asarray(tokens, dtype="<i8")
        g = np.asarray(grads, dtype="<f4")
        s, bid = len(tok) // self.n, gl.next_batch_id()
        shard = (lambda a: bf16_bytes(a)) if dtype == "bf16" else (lambda a: a.tobytes())
        futs = [self.stubs[r].PushGradients.future(pb.PushGradientsRequest(
            table=table, batch_id=bid, shard_index=r, shard_count=self.n,
            tokens_per_batch=len(tok), tokens=tok[r * s:(r + 1) * s].tobytes(),
            dtype=DTYPES[dtype], gradients=shard(g[r * s:(r + 1) * s]), mode=mode),
            timeout=gl.CALL_TIMEOUT) for r in range(self.n)]
        return [(f.result().applied, f.result().skipped, f.result().grad_norm,
                 f.result().num_unique, f.result().ordered) for f in futs]

    def stats(self, rank=0):
        return self.stubs[rank].GetStats(pb.GetStatsRequest(), timeout=gl.CALL_TIMEOUT)


ASYNC_STEP = 4  # the script's push that is async: answered once ordered, applied in order


def script(seed, rows, width, batches):
    """A deterministic sequence of ("lookup", tokens) and ("push", tokens, grads, mode):
    duplicates and padding token 0 in every batch; one push gated by a NaN on a real token, one
    with a NaN on a padding position (which does not count), one async (the lookup after it must
    see it)."""
    rng = np.random.default_rng(seed)
    ops = []
    for step, T in enumerate(batches):
        tokens = rng.integers(0, min(rows, 3 * T // 2 + 2), size=T)
        tokens[step % T] = 0
        tokens[(step + 3) % T] = tokens[(step + 4) % T]
        grads = rng.normal(size=(T, width)).astype(np.float32)
        if step == 2:
            tokens[T - 1] = 5
            grads[T - 1, width // 2] = np.nan
        if step == 3:
            tokens[1] = 0
            grads[1, 0] = np.nan
        ops.append(("lookup", tokens.copy()))
        ops.append(("push", tokens, grads,
                    pb.UPDATE_MODE_ASYNC if step == ASYNC_STEP else pb.UPDATE_MODE_SYNC))
    ops.append(("lookup", rng.integers(0, rows, size=batches[-1])))
    return ops


def run_script(client, tables, scripts):
    """Every table's script; returns {table: [result per op]} (lookups as bytes, pushes as
    reply tuples), and each table's final rows."""
    out = {}
    for name, dtype in tables:
        res = out[name] = []
        for op in scripts[name]:
            if op[0] == "lookup":
                res.append(client.lookup(name, op[1]))
            else:
                res.append(client.push(name, op[1], op[2], dtype, op[3]))
    return out


def check_report(test, text, devices, expect_pinned=True):
    """The sim_cuda report of a server that exited: every device in `devices` was used, nothing
    is left on it, and (expect_pinned) the engine was handed pinned request and reply buffers."""
    used = {}
    for m in REPORT.finditer(text):
        d, made, _, *live = (int(x) for x in m.groups())
        used[d] = made
        test.assertEqual(live, [0] * 5, "device %d: left at exit: %s\n%s" % (d, m.group(0),
                                                                               text[-3000:]))
    test.assertEqual(sorted(used), sorted(devices), text[-3000:])
    test.assertTrue(all(made > 0 for made in used.values()), text[-3000:])
    q = QUERIES.search(text)
    test.assertIsNotNone(q, text[-3000:])
    if expect_pinned:
        test.assertGreater(int(q.group(1)), 0,
                           "no request or reply reached the engine pinned: %s" % q.group(0))


def wait_exit(proc, bound=EXIT_BOUND):
    """The exit code of a grouplib.Proc, or None when it still runs after `bound` seconds."""
    return proc.wait(bound)


class Single:
    """A server without --peers on a free loopback port (--listen 127.0.0.1:0), ready when
    constructed: tests/lib/embps_servers.py's Server, as p."""

    def __init__(self, *flags, binary=None, env=None):
        self.p = gl.Server(*flags, env=env, binary=binary, prefix="embps-group-")
        self.address = self.p.address

    def stop(self):
        """SIGTERM; returns (exit code, whole log)."""
        code = self.p.close(EXIT_BOUND)
        return code, self.p.last_log


class OneRankTest(unittest.TestCase):
    TABLES = [("f32_rw", "f32", 128, "rowwise_adagrad"), ("f32_adam", "f32", 128, "adam"),
              ("bf16_rw", "bf16", 64, "rowwise_adagrad"), ("bf16_adam", "bf16", 64, "adam")]
    ROWS = 5000
    BATCHES = (7, 64, 33, 40, 1000, 4096)
    BIG = 40000  # f32 width 128: a 20 MB reply, which the CUDA engine sends back in chunks

    @classmethod
    def setUpClass(cls):
        cls.t0 = time.time()
        cls.cuda = Single("--device", "cuda", binary=SIM, env=sim_env(1))
        cls.cpu = Single("--device", "cpu")
        cls.results, cls.stats, cls.cli = {}, {}, {}
        scripts = {name: script(i + 1, cls.ROWS, width, cls.BATCHES)
                   for i, (name, _, width, _) in enumerate(cls.TABLES)}
        big = np.random.default_rng(99).integers(0, cls.ROWS, size=cls.BIG)
        big[::97] = 0
        for kind, server in (("cuda", cls.cuda), ("cpu", cls.cpu)):
            client = Client([server.address])
            try:
                for name, dtype, width, opt in cls.TABLES:
                    client.create(spec(name, cls.ROWS, width, dtype, opt))
                initial = {t[0]: client.lookup(t[0], np.arange(cls.ROWS)) for t in cls.TABLES}
                res = run_script(client, [(t[0], t[1]) for t in cls.TABLES], scripts)
                res["initial"] = initial
                res["big"] = client.lookup("f32_rw", big)
                res["final"] = {t[0]: client.lookup(t[0], np.arange(cls.ROWS))
                                for t in cls.TABLES}
                cls.results[kind] = res
                cls.stats[kind] = client.stats()
            except Exception as e:
                text = server.p.text()
                cls.cuda.p.cleanup()
                cls.cpu.p.cleanup()
                raise RuntimeError("%s server: %r\n%s" % (kind, e, text[-6000:])) from e
            finally:
                client.close()
            cls.cli[kind] = gl.run_cli(server.address, "stats")
            cls.cli[kind + "_json"] = gl.run_cli(server.address, "stats", "--json")
        cls.codes, cls.logs = {}, {}
        for kind, server in (("cuda", cls.cuda), ("cpu", cls.cpu)):
            cls.codes[kind], cls.logs[kind] = server.stop()
        print("OneRankTest: both servers ran the workload in %.1f s" % (time.time() - cls.t0))

    def test_rows_and_replies_are_the_cpu_servers(self):
        cuda, cpu = self.results["cuda"], self.results["cpu"]
        for name, dtype, width, _ in self.TABLES:
            self.assertEqual(cuda["initial"][name], cpu["initial"][name], name)
            self.assertEqual(len(cuda[name]), len(cpu[name]))
            for i, (a, b) in enumerate(zip(cuda[name], cpu[name])):
                self.assertEqual(a, b, "%s: op %d differs between the CUDA and the CPU server"
                                 % (name, i))
            self.assertEqual(cuda["final"][name], cpu["final"][name], name)
        self.assertEqual(len(cuda["big"]), self.BIG * 128 * 4)
        self.assertEqual(cuda["big"], cpu["big"])

    def test_pushes_moved_the_rows(self):
        """The comparison means something: every push but the gated one was applied, and it
        moved exactly the rows of the tokens pushed (padding row 0 stays zero)."""
        for name, dtype, width, _ in self.TABLES:
            res = self.results["cuda"]
            replies = [r for r in res[name] if isinstance(r, list)]
            self.assertEqual([(r[0][0], r[0][1], r[0][4]) for r in replies],
                             [(True, False, False), (True, False, False), (False, True, False),
                              (True, False, False), (False, False, True), (True, False, False)],
                             name)
            self.assertTrue(all(r[0][3] > 0 and np.isfinite(r[0][2])
                                for i, r in enumerate(replies) if i not in (2, ASYNC_STEP)),
                            name)
            size = 4 if dtype == "f32" else 2
            before = np.frombuffer(res["initial"][name], "<u%d" % size).reshape(self.ROWS, -1)
            after = np.frombuffer(res["final"][name], "<u%d" % size).reshape(self.ROWS, -1)
            pushed = set()
            for i, op in enumerate(script(1 + [t[0] for t in self.TABLES].index(name),
                                          self.ROWS, width, self.BATCHES)):
                if op[0] == "push" and i // 2 != 2:
                    pushed.update(int(t) for t in op[1] if t != 0)
            moved = {int(t) for t in np.nonzero(np.any(before != after, axis=1))[0]}
            self.assertEqual(moved, pushed, name)
            self.assertTrue(np.all(after[0] == 0), name)

    def test_stats_say_cuda(self):
        self.assertEqual(self.stats["cuda"].backend, "cuda")
        self.assertEqual(self.stats["cpu"].backend, "cpu")
        self.assertEqual((self.stats["cuda"].rank, self.stats["cuda"].group_size), (0, 1))
        self.assertTrue(self.stats["cuda"].ready)
        for kind in ("cuda", "cpu"):
            r = self.cli[kind]
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertRegex(r.stdout, r"(?m)^rank 0/1 \(127\.0\.0\.1:\d+\):.* backend %s, " % kind)
            j = self.cli[kind + "_json"]
            self.assertEqual(j.returncode, 0, j.stderr)
            self.assertEqual(json.loads(j.stdout)[0]["backend"], kind)
        t = {s.name: s for s in self.stats["cuda"].tables}
        c = {s.name: s for s in self.stats["cpu"].tables}
        for name, *_ in self.TABLES:
            self.assertEqual((t[name].steps_applied, t[name].steps_skipped, t[name].bytes),
                             (c[name].steps_applied, c[name].steps_skipped, c[name].bytes), name)

    def test_memory_budget_is_the_device_s_on_cuda(self):
        """--max-memory-bytes' default: 80% of the GPU's memory (the simulated device reports
        16 GiB) on cuda, 80% of physical memory on cpu; both count the same table bytes."""
        phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        self.assertEqual(self.stats["cuda"].max_memory_bytes, (16 << 30) // 10 * 8)
        self.assertEqual(self.stats["cpu"].max_memory_bytes, phys // 10 * 8)
        used = sum(s.bytes for s in self.stats["cpu"].tables)
        self.assertEqual(self.stats["cuda"].memory_bytes, used)
        self.assertEqual(self.stats["cpu"].memory_bytes, used)

    def test_log_shows_backend_device_and_simulated_communicator(self):
        log = self.logs["cuda"]
        self.assertRegex(log, r"embps-server \S+: rank 0 of a 1-rank group, mesh shard=1, "
                              r"backend cuda,")
        self.assertRegex(log, r"rank 0 uses CUDA device 0 \(PCI 0000:18:00\.0\) on ")
        self.assertEqual([m.groups() for m in READY.finditer(log)], [("0", "1", "0")], log)
        self.assertNotIn("cannot pin", log)
        self.assertIn("backend cpu,", self.logs["cpu"])
        self.assertNotIn("sim_cuda", self.logs["cpu"])

    def test_clean_exit_and_nothing_left_on_the_device(self):
        self.assertEqual(self.codes, {"cuda": 0, "cpu": 0}, self.logs["cuda"][-3000:])
        check_report(self, self.logs["cuda"], [0])


class BackendChoiceTest(unittest.TestCase):
    """main.c's backend and device choice in a build with the CUDA backend."""

    def check_cuda(self, flags, device):
        s = Single(*flags, binary=SIM, env=sim_env(2))
        client = Client([s.address])
        try:
            self.assertEqual(client.stats().backend, "cuda")
        finally:
            client.close()
        code, log = s.stop()
        self.assertEqual(code, 0, log)
        self.assertIn("backend cuda,", log)
        self.assertIn("rank 0 uses CUDA device %d (PCI 0000:%02X:00.0)" % (device, 0x18 + 0x10 * device),
                      log)
        self.assertEqual([m.groups() for m in READY.finditer(log)], [("0", "1", str(device))], log)

    def test_auto_picks_cuda_when_a_device_is_visible(self):
        self.check_cuda((), 0)  # rank 0 modulo 2 devices

    def test_cuda_n_picks_device_n(self):
        self.check_cuda(("--device", "cuda:1"), 1)

    def test_auto_picks_cpu_without_a_device(self):
        s = Single(binary=SIM, env=sim_env(0))
        code, log = s.stop()
        self.assertEqual(code, 0, log)
        self.assertIn("backend cpu,", log)
        self.assertIsNone(READY.search(log), log)

    def test_cuda_without_a_device_is_refused(self):
        p = gl.Proc(["--listen", "127.0.0.1:0", "--device", "cuda"], env=sim_env(0), binary=SIM)
        try:
            self.assertEqual(wait_exit(p), 2, p.text())
            self.assertIn("embps-server: --device cuda: no CUDA device is visible to this process",
                          p.text())
            self.assertNotIn("this build has no CUDA backend", p.text())
        finally:
            p.cleanup()

    def test_device_that_does_not_exist_is_refused(self):
        p = gl.Proc(["--listen", "127.0.0.1:0", "--device", "cuda:3"], env=sim_env(2), binary=SIM)
        try:
            self.assertEqual(wait_exit(p), 2, p.text())
            self.assertIn("embps-server: --device cuda:3: no such CUDA device; this process sees 2 "
                          "(cuda:0 to cuda:1)", p.text())
        finally:
            p.cleanup()


class GroupTest(unittest.TestCase):
    WIDTHS = {"f32": 48, "bf16": 24}  # divide by 2 and by 3
    TABLES = [("f32_rw", "f32", "rowwise_adagrad"), ("f32_adam", "f32", "adam"),
              ("f32_sgd", "f32", "sgd"), ("f32_adagrad", "f32", "adagrad"),
              ("bf16_rw", "bf16", "rowwise_adagrad"), ("bf16_adam", "bf16", "adam")]
    ROWS = 300
    BATCHES = (12, 36, 24, 48, 600, 1200)  # divide by 2 and by 3
    # rank -> device: the default (rank modulo 4) for 2 ranks, --device cuda:N for 3 and 4
    DEVICES = {2: {0: 0, 1: 1}, 3: {0: 3, 1: 0, 2: 2}, 4: {0: 1, 1: 2, 2: 3, 3: 0}}
    SIZES = (2, 3, 4)

    @classmethod
    def run_group(cls, n, backend):
        if backend == "cuda":
            rank_flags = {} if n == 2 else {r: ["--device", "cuda:%d" % d]
                                            for r, d in cls.DEVICES[n].items()}
            group = gl.Group(n, *(["--device", "cuda"] if n == 2 else []), rank_flags=rank_flags,
                             binary=SIM, env=sim_env(4))
        else:
            group = gl.Group(n, "--device", "cpu")
        client = Client(group.addresses)
        scripts = {name: script(10 * n + i, cls.ROWS, cls.WIDTHS[dtype], cls.BATCHES)
                   for i, (name, dtype, _) in enumerate(cls.TABLES)}
        out = {}
        try:
            for name, dtype, opt in cls.TABLES:
                client.create(spec(name, cls.ROWS, cls.WIDTHS[dtype], dtype, opt))
            out["initial"] = {t[0]: client.lookup(t[0], np.arange(cls.ROWS)) for t in cls.TABLES}
            out["ops"] = run_script(client, [(t[0], t[1]) for t in cls.TABLES], scripts)
            out["final"] = {t[0]: client.lookup(t[0], np.arange(cls.ROWS)) for t in cls.TABLES}
            out["stats"] = [client.stats(r) for r in range(n)]
            out["texts"] = [p.text() for p in group.procs]
        except Exception as e:
            raise RuntimeError("%d-rank %s group: %r\n%s" % (n, backend, e, group.logs())) from e
        finally:
            client.close()
            out["codes"] = group.close()
        out["logs"] = group.last_logs
        out["scripts"] = scripts
        return out

    @classmethod
    def setUpClass(cls):
        cls.res, cls.secs = {}, {}
        for n in cls.SIZES:
            for backend in ("cuda", "cpu"):
                t0 = time.time()
                cls.res[n, backend] = cls.run_group(n, backend)
                cls.secs[n, backend] = time.time() - t0
        print("GroupTest: seconds per group: %s" %
              ", ".join("%d-rank %s %.1f" % (k[0], k[1], v) for k, v in cls.secs.items()))

    def test_cuda_groups_equal_cpu_groups_bitwise(self):
        for n in self.SIZES:
            cuda, cpu = self.res[n, "cuda"], self.res[n, "cpu"]
            for name, *_ in self.TABLES:
                self.assertEqual(cuda["initial"][name], cpu["initial"][name], (n, name))
                for i, (a, b) in enumerate(zip(cuda["ops"][name], cpu["ops"][name])):
                    self.assertEqual(a, b, "%d ranks, %s: op %d differs" % (n, name, i))
                self.assertEqual(cuda["final"][name], cpu["final"][name], (n, name))

    def test_f32_tables_match_the_numpy_reference(self):
        kw = {"rowwise_adagrad": dict(lr=0.05, half_life=5.0, wd=0.001, init_acc=0.1),
              "adam": dict(lr=0.01, wd=0.01), "sgd": dict(lr=0.05),
              "adagrad": dict(lr=0.05, half_life=10.0, init_acc=0.1)}
        for n in self.SIZES:
            res = self.res[n, "cuda"]
            for name, dtype, opt in self.TABLES:
                if dtype != "f32":
                    continue
                w = self.WIDTHS[dtype]
                initial = np.frombuffer(res["initial"][name], "<f4").reshape(-1, w)
                ref = gl.Reference(initial, opt, eps=1e-6, **kw[opt])
                for op, got in zip(res["scripts"][name], res["ops"][name]):
                    if op[0] == "lookup":
                        np.testing.assert_allclose(np.frombuffer(got, "<f4").reshape(-1, w),
                                                   ref.rows(op[1]), rtol=1e-6, atol=1e-7,
                                                   err_msg="%d ranks, %s" % (n, name))
                    elif not np.all(np.isfinite(op[2][op[1] != 0])):
                        self.assertEqual([r[:2] for r in got], [(False, True)] * n)
                    elif op[3] == pb.UPDATE_MODE_ASYNC:
                        self.assertEqual([(r[0], r[4]) for r in got], [(False, True)] * n)
                        ref.push(op[1], op[2])
                    else:
                        norm, unique = ref.push(op[1], op[2])
                        for r in got:
                            self.assertEqual(r[:2], (True, False))
                            self.assertEqual(r[3], unique)
                            self.assertAlmostEqual(r[2], norm, delta=1e-5 * norm)
                np.testing.assert_allclose(np.frombuffer(res["final"][name], "<f4").reshape(-1, w),
                                           ref.rows(np.arange(self.ROWS)), rtol=1e-6, atol=1e-7)

    def test_every_rank_on_its_own_device_through_the_simulated_nccl(self):
        for n in self.SIZES:
            res = self.res[n, "cuda"]
            for r, text in enumerate(res["texts"]):
                d = self.DEVICES[n][r]
                self.assertIn("rank %d of a %d-rank group, mesh shard=%d, backend cuda," %
                              (r, n, n), text)
                self.assertRegex(text, r"rank %d uses CUDA device %d \(PCI 0000:%02X:00\.0\)" %
                                 (r, d, 0x18 + 0x10 * d))
                self.assertEqual([m.groups() for m in READY.finditer(text)],
                                 [(str(r), str(n), str(d))], text)
                st = res["stats"][r]
                self.assertEqual((st.backend, st.rank, st.group_size), ("cuda", r, n))
                self.assertGreater(st.collective_calls, 0)
                self.assertGreater(st.peer_bytes_sent, 0)
                # the CPU group moved the same collective payload over its TCP communicator
                cpu = self.res[n, "cpu"]["stats"][r]
                self.assertEqual((st.peer_bytes_sent, st.peer_bytes_received),
                                 (cpu.peer_bytes_sent, cpu.peer_bytes_received))

    def test_clean_exits_and_nothing_left_on_the_devices(self):
        for n in self.SIZES:
            res = self.res[n, "cuda"]
            self.assertEqual(res["codes"], {r: 0 for r in range(n)}, res["logs"])
            self.assertEqual(self.res[n, "cpu"]["codes"], {r: 0 for r in range(n)})
            for r, chunk in enumerate(res["logs"].split("---- rank ")[1:]):
                check_report(self, chunk, [self.DEVICES[n][r]])


class RankDiesTest(unittest.TestCase):
    """A rank of a CUDA group dies: the others fail the next batch with UNAVAILABLE naming it,
    report NOT_SERVING, and still exit 0 on SIGTERM with nothing left on their devices."""

    def test_rank_dies(self):
        group = gl.Group(3, "--device", "cuda", "--peer-timeout-ms", "3000", binary=SIM,
                         env=sim_env(4))
        client = Client(group.addresses)
        try:
            client.create(spec("d", 60, 12, "f32", "sgd"))
            before = client.lookup("d", np.arange(12))
            self.assertEqual(len(before), 12 * 12 * 4)
            group.kill(2)
            t0 = time.time()
            e = gl.rpc_error(lambda: client.lookup("d", np.arange(12)))
            self.assertIsNotNone(e)
            self.assertEqual(e.code(), gl.SC.UNAVAILABLE, e.details())
            self.assertIn("rank 2", e.details())
            self.assertLess(time.time() - t0, 10.0)
            self.assertTrue(gl.wait_for(lambda: all(gl.health(a) == gl.NOT_SERVING
                                                    for a in group.addresses[:2]), 10.0))
        finally:
            client.close()
            codes = group.close()
        self.assertEqual(codes, {0: 0, 1: 0}, group.last_logs)
        for r, chunk in enumerate(group.last_logs.split("---- rank ")[1:3]):
            check_report(self, chunk, [r], expect_pinned=False)


class DeviceClaimTest(unittest.TestCase):
    """Ranks on one host that claim one device: the leader refuses the group with its message
    (server/group/formation.c, claim_devices) and every rank exits non-zero within EXIT_BOUND."""

    def start_refused(self, n, devices, rank_flags):
        """Starts the group; returns (codes, texts, seconds) once every rank has exited."""
        for attempt in range(3):
            ports, offset = gl.pick_ports(n)
            peers = ",".join("127.0.0.1:%d" % p for p in ports)
            t0 = time.time()
            procs = [gl.Proc(["--rank", str(r), "--peers", peers, "--peer-port-offset",
                              str(offset), *rank_flags.get(r, ["--device", "cuda"])],
                             env=sim_env(devices), binary=SIM) for r in range(n)]
            try:
                codes = [wait_exit(p) for p in procs]
                secs = time.time() - t0
                texts = [p.text() for p in procs]
            finally:
                for p in procs:
                    p.cleanup()
            if not any("address already in use" in t.lower() for t in texts):
                return codes, texts, secs
        self.fail("no free ports in 3 attempts")

    def check(self, n, devices, rank_flags, a, b, device):
        codes, texts, secs = self.start_refused(n, devices, rank_flags)
        host = socket.gethostname()[:64]
        want = ("ranks %d and %d both claim CUDA device %d (PCI 0000:%02X:00.0) on host %s: give "
                "each rank its own device with --device or EMBPS_DEVICE" %
                (a, b, device, 0x18 + 0x10 * device, host))
        logs = "\n".join("---- rank %d (exit %s) ----\n%s" % (r, c, t)
                         for r, (c, t) in enumerate(zip(codes, texts)))
        self.assertTrue(all(c is not None and c != 0 for c in codes), logs)
        self.assertLess(secs, EXIT_BOUND, logs)
        for r, t in enumerate(texts):
            self.assertIn("embps-server: FAILED_PRECONDITION: rank %d could not join the group: %s"
                          % (r, want), t)
            self.assertIsNone(READY.search(t), t)
        print("DeviceClaimTest: %d ranks refused, all exited (codes %s) in %.1f s" %
              (n, codes, secs))

    def test_two_ranks_on_the_only_device(self):
        self.check(2, 1, {}, 0, 1, 0)  # rank modulo 1 device: both on device 0

    def test_two_of_three_ranks_on_one_device(self):
        self.check(3, 4, {0: ["--device", "cuda:0"], 1: ["--device", "cuda:2"],
                          2: ["--device", "cuda:2"]},
                   1, 2, 2)


class HashTablesTest(unittest.TestCase):
    SIZES = (1, 2, 4)

    def test_cuda_groups_equal_a_cpu_server_bitwise(self):
        import test_group_hash as th
        keys, ops = th.script()
        res = {}
        for n in (0,) + self.SIZES:  # 0: the CPU server
            if n == 0:
                group = gl.Group(1, "--device", "cpu")
            else:
                group = gl.Group(n, "--device", "cuda", binary=SIM, env=sim_env(n))
            client = th.Client(group.addresses)
            try:
                res[n] = th.everything(client, keys, ops)
            except Exception as e:
                raise RuntimeError("%d-rank group: %r\n%s" % (n, e, group.logs())) from e
            finally:
                client.close()
                codes = group.close()
            self.assertEqual(codes, {r: 0 for r in range(max(n, 1))}, group.last_logs)
            for r, chunk in enumerate(group.last_logs.split("---- rank ")[1:] if n else []):
                self.assertIn("backend cuda", chunk)
                check_report(self, chunk, [r])
        for name in th.TABLES:
            answers, rows, st = res[0][name]
            stat = dict(zip(th.STAT_FIELDS, st))
            self.assertGreater(stat["keys_evicted"] + stat["keys_expired"], 0, (name, stat))
            self.assertEqual(stat["steps_skipped"], 1, (name, stat))
            for n in self.SIZES:
                with self.subTest(table=name, ranks=n):
                    got = res[n][name]
                    self.assertEqual(got[2], st, "TableStats differ")
                    for i, (a, b) in enumerate(zip(got[0], answers)):
                        self.assertEqual(a, b, "answer %d differs" % i)
                    self.assertEqual(got[1], rows, "final rows differ")


class FeaturesTest(unittest.TestCase):
    def test_cuda_groups_equal_a_cpu_server_bitwise(self):
        import test_group_features as tf
        res = {}
        # (n, "cpu") and (n, "cuda"): the same size, since a bf16 table of width 32 split over 2
        # ranks sums its row figures by other blocks than one rank does
        for n, kind in ((1, "cpu"), (1, "cuda"), (2, "cpu"), (2, "cuda")):
            if kind == "cpu":
                group = gl.Group(n, "--device", "cpu")
            else:
                group = gl.Group(n, "--device", "cuda", binary=SIM, env=sim_env(n))
            client = gl.RawClient(group.addresses)
            try:
                tf.create_tables(client)
                out = [tf.lookup_answers(tf.call(client, tf.make_batch(3)))]
                for seed in (5, 6):
                    reps = tf.call(client, tf.make_batch(seed, True), push=True)
                    out.append([(s.table, s.applied, s.skipped, s.grad_norm, s.num_unique)
                                for s in reps[0].steps])
                out.append(tf.lookup_answers(tf.call(client, tf.make_batch(3))))
                out.append(tf.all_rows(client))
                res[n, kind] = out
            except Exception as e:
                raise RuntimeError("%d-rank group: %r\n%s" % (n, e, group.logs())) from e
            finally:
                client.close()
                codes = group.close()
            self.assertEqual(codes, {r: 0 for r in range(n)}, group.last_logs)
            for r, chunk in enumerate(group.last_logs.split("---- rank ")[1:]
                                      if kind == "cuda" else []):
                self.assertIn("backend cuda", chunk)
                check_report(self, chunk, [r])
        self.assertTrue(all(s[1] for s in res[1, "cpu"][1]), res[1, "cpu"][1])
        for n in (1, 2):
            for i, (a, b) in enumerate(zip(res[n, "cuda"], res[n, "cpu"])):
                self.assertTrue(a == b, "%d ranks: part %d differs%s" % (
                    n, i, (": %r against %r" % (a, b)) if isinstance(a, list) else ""))


class AssignTest(unittest.TestCase):
    """Assign on the cuda backend (the rows' exchange, the last-wins choice, the assign kernel,
    a hash-keyed table's inserts, evictions and refusals, the state reset seen by the next
    Adagrad and Adam steps) answers and leaves the tables bitwise as a CPU group of the same
    size."""
    W = 24

    def run_group(self, n, kind):
        if kind == "cpu":
            group = gl.Group(n, "--device", "cpu")
        else:
            group = gl.Group(n, "--device", "cuda", binary=SIM, env=sim_env(n))
        client = gl.RawClient(group.addresses)
        rng = np.random.default_rng(7)
        W, out = self.W, []

        def rows(k):
            return rng.standard_normal((k, W)).astype(np.float32)

        def bf(k):  # bf16 rows (any bits: truncated f32) for the bf16 table
            return (rows(k).view(np.uint32) >> 16).astype(np.uint16)

        def answer(reps):
            return [(m.num_assigned, m.num_refused, m.replayed) for m in reps]
        try:
            client.create("d", 66, W, "adagrad", init_acc=0.1, dtype=pb.DTYPE_BF16)
            spec = gl.table_spec("h", 0, W, "adam", b1=0.9, b2=0.99)
            spec.capacity = 8
            client.stubs[0].CreateTable(pb.CreateTableRequest(spec=spec), timeout=gl.CALL_TIMEOUT)
            client.push("d", np.arange(1, 13), bf(12))
            out.append(answer(client.assign("d", [3, 5, 3, 0, 40, 7], bf(6), True)))
            out.append(answer(client.assign("d", [1, 2, 9, 10, 11, 12], bf(6), False)))
            client.push("d", np.arange(1, 13), bf(12))
            out.append(client.lookup_bytes("d", np.arange(66)))
            keys = (np.arange(1, 13, dtype=np.int64) * 0x9E3779B97F4A7C1) ^ (1 << 62)
            out.append(answer(client.assign("h", keys, rows(12))))  # 8 stored, 4 refused
            client.push("h", keys[:6], rows(6))
            out.append(answer(client.assign("h", np.array([5, 6, 7, 8, 9, 10]), rows(6),
                                            False)))  # evictions
            client.push("h", np.array([5, 6, 7, 8, 9, 10]), rows(6))
            out.append(client.lookup_bytes("h", np.concatenate([keys, np.arange(5, 11)])))
        except Exception as e:
            raise RuntimeError("%d-rank %s group: %r\n%s" % (n, kind, e, group.logs())) from e
        finally:
            client.close()
            codes = group.close()
        self.assertEqual(codes, {r: 0 for r in range(n)}, group.last_logs)
        return out

    def test_cuda_groups_equal_cpu_groups_bitwise(self):
        for n in (1, 2, 3):
            cpu, cuda = self.run_group(n, "cpu"), self.run_group(n, "cuda")
            self.assertEqual(cpu[0], [(4, 0, False)] * n)
            self.assertEqual(cpu[2 + 1], [(8, 4, False)] * n)
            for i, (a, b) in enumerate(zip(cuda, cpu)):
                self.assertTrue(a == b, "%d ranks: part %d differs" % (n, i))


class IncrementalCheckpointTest(unittest.TestCase):
    ROWS, WIDTH = 200, 128  # four words of dirty bits; 64 columns per rank
    FLAGS = ("--checkpoint-full-every", "100")
    # after the full checkpoint: 6 distinct rows (padding 0 is never written), then 16 others
    PUSHES = ([[0, 5, 5, 63, 64, 130, 199, 7]],
              [list(range(100, 108)), list(range(108, 116)) + list(range(100, 108))])
    TABLES = (("t_sgd", "sgd", None), ("t_rowwise", "rowwise_adagrad", pb.DTYPE_BF16))

    def run_group(self, backend, d):
        if backend == "cuda":
            group = gl.Group(2, "--device", "cuda", "--checkpoint-dir", d, *self.FLAGS,
                             binary=SIM, env=sim_env(2))
        else:
            group = gl.Group(2, "--device", "cpu", "--checkpoint-dir", d, *self.FLAGS)
        client = gl.RawClient(group.addresses)
        ckpts, rng = [], np.random.default_rng(5)
        try:
            for name, opt, dtype in self.TABLES:
                client.create(name, self.ROWS, self.WIDTH, opt, dtype=dtype)
            for k in range(len(self.PUSHES) + 1):
                if k > 0:
                    for tokens in self.PUSHES[k - 1]:
                        for name, _, dtype in self.TABLES:
                            g = rng.normal(size=(len(tokens), self.WIDTH)).astype(np.float32)
                            if dtype:  # bf16 gradients as their bit patterns (truncated)
                                g = (g.view("<u4") >> 16).astype(np.uint16)
                            for r in client.push(name, tokens, g):
                                self.assertTrue(r.applied)
                resp = client.stubs[0].Checkpoint(pb.CheckpointRequest(),
                                                  timeout=gl.CALL_TIMEOUT)
                rows = {t[0]: client.lookup_bytes(t[0], np.arange(self.ROWS)) for t in self.TABLES}
                ckpts.append((resp.path, resp.bytes, rows))
        finally:
            client.close()
            group.close_checked(self)
        return ckpts

    def test_checkpoints_hold_the_rows_pushed_since_the_last(self):
        dirs = [tempfile.mkdtemp(prefix="embps-sim-ckpt-") for _ in range(2)]
        try:
            cuda, cpu = self.run_group("cuda", dirs[0]), self.run_group("cpu", dirs[1])
            for k, (a, b) in enumerate(zip(cuda, cpu)):
                self.assertEqual(a[2], b[2], "checkpoint %d: the tables differ" % k)
                self.assertEqual(a[1], b[1], "checkpoint %d: %d bytes on cuda, %d on cpu" %
                                 (k, a[1], b[1]))
            full, six, sixteen = (c[1] for c in cuda)
            self.assertLess(six, sixteen)
            self.assertLess(sixteen, full)
            # Through the chain (full, then both incrementals) onto a CPU server.
            g = gl.Group(1, "--restore", cuda[-1][0])
            c = gl.RawClient(g.addresses)
            try:
                for name, *_ in self.TABLES:
                    self.assertEqual(c.lookup_bytes(name, np.arange(self.ROWS)), cuda[-1][2][name],
                                     name)
            finally:
                c.close()
                g.close_checked(self)
        finally:
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
