"""The Client's calls about tables and the servers rather than batches: create, drop and list
tables, statistics, health and checkpoints, and the client's memory of each table's dtype and
emb_width, which pushes use to convert gradients before sending them.

TableAdmin is mixed into embps.Client (client.py), whose public methods these are: it calls
the host's _unary (one admin call on a list of ranks, concurrently) and reads its _tables,
_addresses and group_size. Table calls go to rank 0, which carries them to the whole group;
stats and health ask every rank.
"""
import grpc

from ._names import DTYPE_NAMES, EVICTION_NAMES, F32, OPTIMIZER_NAMES, STATUS_NAMES, pb
from .errors import Error, emb_width_error
from .values import CheckpointInfo, Health, RankStats, TableSpec


class TableAdmin:
    """The admin and table methods of embps.Client."""

    # -- the tables this client knows --

    def _remember(self, specs):
        for s in specs:
            self._tables[s.name] = (s.dtype or F32, s.emb_width)
            self._keyed[s.name] = s.capacity > 0

    def _is_keyed(self, table):
        """True when table is hash-keyed (any int64 id is a key), as this client last saw it or
        as ListTables says now; False for a dense table or one the group lacks."""
        if table not in self._keyed:
            self._table_info(table)
        return self._keyed.get(table, False)

    def _table_info(self, table, timeout=None):
        """(dtype, emb_width) of table if known or listed now; None if the group lacks it.
        timeout: the ListTables call's, when one is made (None: the client's)."""
        info = self._tables.get(table)
        if info is None:
            self._remember(self._unary("ListTables", pb.ListTablesRequest(), [0],
                                       timeout)[0].tables)
            info = self._tables.get(table)
        return info

    # -- admin --

    def create_table(self, name, rows=None, emb_width=None, dtype="f32",
                     optimizer="rowwise_adagrad", *, capacity=None, admit_after=0, eviction=None,
                     half_life_steps=0, ttl_steps=0, sketch_width=0, lr=0.0, eps=0.0,
                     half_life=0.0, initial_accumulator=0.0, weight_decay=0.0, beta1=0.0,
                     beta2=0.0, seed=0, init_scale=0.0):
        """Creates a table on the group (asked of rank 0) and returns its TableSpec with the
        server's defaults filled in: a dense table of rows x emb_width (tokens in [0, rows)), or
        with capacity instead of rows a hash-keyed table of capacity slots, whose tokens are any
        int64 ids (0 stays padding; a key never seen reads its initial row; a full table evicts).

        dtype: "f32" or "bf16" storage (optimizer math is f32). optimizer: "sgd", "adagrad",
        "rowwise_adagrad" or "adam". Zero floats take the optimizer's defaults (lr 0.01, eps
        1e-8, beta1 0.9, beta2 0.999); half_life: accumulator half-life in steps (0: no
        decay); init_scale: rows start uniform in [-init_scale, init_scale) (0:
        1/sqrt(emb_width)), a function of (seed, row or key, column) only.

        Hash-keyed only (refused with a dense table): admit_after K, store a key at the K-th push
        step that carries it (0 or 1: at once; at most 255); eviction, "lru" (None: the default),
        "lfu" (with half_life_steps, the push steps over which a push's weight halves) or "ttl"
        (with ttl_steps, the push steps without a push before a key expires); sketch_width, the
        admission sketch's counters per row (0: the server's default; only with admit_after > 1).

        Raises ShapeError (emb_width does not split over the group), ValueError (bad name,
        dtype, optimizer or eviction; neither or both of rows and capacity; a hash-keyed option
        with rows), embps.Error (ALREADY_EXISTS, INVALID_ARGUMENT naming a setting out of the
        server's rules, RESOURCE_EXHAUSTED, ...)."""
        if not isinstance(name, str) or not name:
            raise ValueError("create table: no table name")
        if (rows is None) == (capacity is None):
            raise ValueError("create table: give rows (a dense table) or capacity (a hash-keyed "
                             "table), exactly one of them")
        if emb_width is None:
            raise ValueError("create table: emb_width is required")
        if dtype not in DTYPE_NAMES:
            raise ValueError("create table: dtype %r is neither f32 nor bf16" % (dtype,))
        if optimizer not in OPTIMIZER_NAMES:
            raise ValueError("create table: unknown optimizer %r (sgd, adagrad, rowwise_adagrad, "
                             "adam)" % (optimizer,))
        if eviction not in EVICTION_NAMES:
            raise ValueError("create table: unknown eviction %r (lru, lfu, ttl)" % (eviction,))
        if rows is not None:
            for field, value, unset in (("admit_after", admit_after, 0),
                                        ("eviction", eviction, None),
                                        ("half_life_steps", half_life_steps, 0),
                                        ("ttl_steps", ttl_steps, 0),
                                        ("sketch_width", sketch_width, 0)):
                if value != unset:
                    raise ValueError("create table: %s=%r is an option of hash-keyed tables, and "
                                     "rows=%r makes a dense one: give capacity instead of rows, "
                                     "or leave %s out" % (field, value, rows, field))
        if emb_width % self.group_size:
            raise emb_width_error(emb_width, self.group_size)
        opt = pb.OptimizerConfig(kind=OPTIMIZER_NAMES[optimizer], lr=lr, eps=eps,
                                 half_life=half_life, initial_accumulator=initial_accumulator,
                                 weight_decay=weight_decay, beta1=beta1, beta2=beta2)
        spec = pb.TableSpec(name=name, rows=rows or 0, emb_width=emb_width,
                            dtype=DTYPE_NAMES[dtype], seed=seed, optimizer=opt,
                            init_scale=init_scale, capacity=capacity or 0,
                            admit_after=admit_after, eviction=EVICTION_NAMES[eviction],
                            half_life_steps=half_life_steps, ttl_steps=ttl_steps,
                            sketch_width=sketch_width)
        reply = self._unary("CreateTable", pb.CreateTableRequest(spec=spec), [0])[0]
        self._remember([reply.spec])
        return TableSpec.from_pb(reply.spec)

    def drop_table(self, name):
        """Drops table `name` on the whole group (asked of rank 0): every rank frees its rows and
        optimizer state, the bytes go back to the servers' --max-memory-bytes budget, and the name
        may be created again. Batches of the table still in flight fail with NOT_FOUND. Returns
        the bytes the table held on each rank.

        Raises ValueError (no name), embps.Error (NOT_FOUND, INVALID_ARGUMENT, ...)."""
        if not isinstance(name, str) or not name:
            raise ValueError("drop table: no table name")
        reply = self._unary("DropTable", pb.DropTableRequest(name=name), [0])[0]
        self._tables.pop(name, None)
        self._keyed.pop(name, None)
        return reply.bytes

    def tables(self):
        """The group's tables (asked of rank 0), as TableSpecs."""
        specs = self._unary("ListTables", pb.ListTablesRequest(), [0])[0].tables
        self._remember(specs)
        return [TableSpec.from_pb(s) for s in specs]

    def table(self, name):
        """One table's TableSpec; embps.Error NOT_FOUND if the group has none of that name."""
        for t in self.tables():
            if t.name == name:
                return t
        raise Error(grpc.StatusCode.NOT_FOUND, "table '%s' not found" % name)

    def stats(self):
        """Every rank's statistics, in rank order (RankStats)."""
        n = self.group_size
        replies = self._unary("GetStats", pb.GetStatsRequest(), list(range(n)))
        return [RankStats.from_pb(m, self._addresses[r]) for r, m in enumerate(replies)]

    def health(self, service=""):
        """Every rank's grpc.health.v1 status for service ("": the whole server) as a Health,
        true when all serve. Raises embps.Error when a rank cannot be asked."""
        n = self.group_size
        replies = self._unary("Health", pb.HealthCheckRequest(service=service), list(range(n)))
        statuses = tuple(STATUS_NAMES.get(m.status, "UNKNOWN") for m in replies)
        message = ""
        for r, s in enumerate(statuses):
            if s != "SERVING":
                message = "rank %d (%s) is %s" % (r, self._addresses[r], s)
                break
        return Health(serving=not message, statuses=statuses, message=message)

    def checkpoint(self, table=None):
        """Takes a checkpoint of table (None: every table) into the servers' --checkpoint-dir
        now and returns once it is complete (CheckpointInfo: round, bytes, path). Raises
        embps.Error (FAILED_PRECONDITION without --checkpoint-dir, RESOURCE_EXHAUSTED when a disk
        filled up, NOT_FOUND)."""
        m = self._unary("Checkpoint", pb.CheckpointRequest(table=table or ""), [0])[0]
        return CheckpointInfo(round=m.round, bytes=m.bytes, path=m.path, scope=table or "")

    def checkpoints(self):
        """The complete checkpoints in the group's --checkpoint-dir, oldest first."""
        m = self._unary("ListCheckpoints", pb.ListCheckpointsRequest(), [0])[0]
        return [CheckpointInfo(round=c.round, bytes=c.bytes, path=c.path, scope=c.scope,
                               time_unix_ms=c.time_unix_ms, group_size=c.group_size,
                               base_round=c.base_round, tables=tuple(c.tables))
                for c in m.checkpoints]
