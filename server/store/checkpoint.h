/* Checkpoint files (DESIGN.md, Durability): how one checkpoint lies on disk, and the directory
 * that holds many. Pure file I/O over host memory: no threads, no engine, no group. The group
 * layer decides when a checkpoint is taken and who writes what; this module writes and reads
 * the bytes, durably and with a checksum on everything.
 *
 * A checkpoint directory (--checkpoint-dir) holds
 *   LOCK                         the leader's lock (embps_ckpt_dir_lock)
 *   ckpt-<round, 20 digits>/     one checkpoint: the tables as they stood after round <round>
 *     r<rank>-<table>.embps      one rank's column slice of one table (embps_ckpt_write_slice)
 *     MANIFEST                   written last, by the leader (embps_ckpt_write_manifest)
 * A checkpoint whose MANIFEST is missing or does not verify does not exist: listing skips it,
 * restore never reads it, pruning removes it once a newer checkpoint is complete.
 *
 * Every file is written to a temporary name, fsynced and renamed; the caller fsyncs the
 * directory (embps_ckpt_sync_dir) before it reports the files durable. Every header and every
 * block carries a crc32 (zlib's, computed with ISA-L), so a torn or corrupt file is detected, never
 * restored.
 *
 * Slices are restored onto any group size: embps_ckpt_read_columns gathers any column range
 * from the N files that a group of N ranks wrote. Incremental checkpoints hold only the rows
 * written since the previous checkpoint (a bitmap of dirty rows), chained by base_round to the
 * previous one back to a full checkpoint; reading applies the chain.
 *
 * The byte layouts (all integers little-endian, floats as their IEEE-754 bits) are documented in
 * ckpt_codec.c; ckpt_internal.h lists the modules behind this header. */
#ifndef EMBPS_CHECKPOINT_H
#define EMBPS_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "server/store/store.h"

/** The format version this build writes. 2: a table spec carries the hash-keyed settings
 * (common/table_fields.h, EMBPS_TABLE_FIELDS_HASH) after beta2. */
#define EMBPS_CKPT_FORMAT_VERSION 2u
/** The oldest format version this build reads (a version 1 table spec lacks the hash-keyed
 * settings: read as 0, a dense table); files of other versions are refused. */
#define EMBPS_CKPT_FORMAT_VERSION_MIN 1u
/** The manifest's file name inside a checkpoint's directory. */
#define EMBPS_CKPT_MANIFEST "MANIFEST"
/** Longest path this module builds. */
#define EMBPS_CKPT_PATH_MAX 4096

/** One rank's slice of one table, as captured for a checkpoint (all borrowed). */
typedef struct embps_ckpt_slice {
  embps_table_config_t config; /* resolved */
  uint32_t rank, group_size;   /* the writer */
  uint32_t col_begin, shard_width;
  uint64_t round;      /* the checkpoint's round */
  uint64_t step;       /* optimizer steps applied to the table (adam's bias correction) */
  uint64_t base_round; /* incremental: the checkpoint this one applies on; 0 when full */
  /** Incremental: bit (r % 64) of dirty[r / 64] is set for each row r to write; NULL: full (every
   * row). */
  const uint64_t *dirty;
  const void *data;    /* config.rows x shard_width of config.dtype */
  const float *state0; /* adagrad's accumulators / adam's m: rows x shard_width; rowwise_adagrad:
                          rows (one per row, the same on every rank); sgd: NULL */
  const float *state1; /* adam's v: rows x shard_width; otherwise NULL */
} embps_ckpt_slice_t;

/** Writes the file name of rank's slice of table ("r<rank>-<table>.embps") to out. */
void embps_ckpt_slice_name(char *out, size_t cap, uint32_t rank, const char *table);

/** Writes the path of the checkpoint of `round` in dir ("<dir>/ckpt-<round, %020>") to out. */
void embps_ckpt_path(char *out, size_t cap, const char *dir, uint64_t round);

/**
 * The size of the file a full checkpoint writes for one rank's slice of a table of cfg
 * (resolved) on a group of group_size (embps_ckpt_write_slice's: its header, every block's
 * header and rows, data and optimizer state, and its trailer), the same on every rank. A
 * hash-keyed table's index file (INDEX-*) is not counted. 0 when cfg does not make a slice (no
 * rows, an unknown optimizer or dtype, or out of memory encoding the header). `embps plan` sizes
 * checkpoints and restores by it.
 */
uint64_t embps_ckpt_slice_bytes(const embps_table_config_t *cfg, uint32_t group_size);

/**
 * Writes slice s to `path` durably: to path + ".tmp", fsync, rename onto path. *bytes (may be
 * NULL) gets the file's size. The caller fsyncs the directory afterwards (embps_ckpt_sync_dir).
 * Returns EMBPS_OK; EMBPS_RESOURCE_EXHAUSTED when the disk or quota is full (ENOSPC, EDQUOT),
 * with a message naming the file ("no space left on device writing PATH"); EMBPS_INTERNAL for
 * another I/O error (naming the file and the system's reason); EMBPS_INVALID_ARGUMENT for a
 * slice that is not self-consistent. On failure the temporary file is removed and `path` is
 * untouched.
 */
embps_status_t embps_ckpt_write_slice(const char *path, const embps_ckpt_slice_t *s,
                                      uint64_t *bytes, embps_error_t *err);

/** The retry window's file in a checkpoint's directory (the leader writes it; its manifest lists
 * it as the file of rank 0 with the empty table name, EMBPS_CKPT_WINDOW_TABLE). */
#define EMBPS_CKPT_WINDOW "RETRY_WINDOW"
/** The table name under which a manifest lists the retry window's file (no table has it). */
#define EMBPS_CKPT_WINDOW_TABLE ""

/** A hash-keyed table's key index in a checkpoint, written by the leader to "INDEX-<table>" (no
 * slice file's name: those start with 'r'). A full checkpoint writes it whole
 * (embps_hindex_encode at the checkpoint's round), and the manifest lists it as the file of rank
 * EMBPS_CKPT_INDEX_RANK (no rank's) under the table's name; an incremental one writes the delta
 * since the checkpoint it applies on (embps_hindex_delta_encode), listed as the file of rank
 * EMBPS_CKPT_INDEX_DELTA_RANK. */
#define EMBPS_CKPT_INDEX_PREFIX "INDEX-"
#define EMBPS_CKPT_INDEX_RANK UINT32_MAX
#define EMBPS_CKPT_INDEX_DELTA_RANK (UINT32_MAX - 1u)

/** Writes the file name of table's key index ("INDEX-<table>") to out. */
void embps_ckpt_index_name(char *out, size_t cap, const char *table);

/** The crc32 of every checksum in the format (zlib's and gzip's): crc continued over n bytes at p
 * (start from 0). For the group's files (the retry window) to checksum as the store's do. */
uint32_t embps_ckpt_crc32(uint32_t crc, const void *p, size_t n);

/**
 * Checks the envelope the checkpoint's own side files share (RETRY_WINDOW, INDEX-<table>): at
 * least header_bytes + 4 bytes, the 8-byte magic, format version `version` (a u32 at byte 8)
 * and, in the last four bytes, the crc32 of every byte before them. `what` names the kind of
 * file in messages ("retry window file", "hash index") and `name` the file. Returns EMBPS_OK;
 * EMBPS_DATA_LOSS (truncated, another magic, a crc32 that differs) or EMBPS_FAILED_PRECONDITION
 * (another version), err naming the file and what is wrong.
 */
embps_status_t embps_ckpt_check_envelope(const uint8_t *p, size_t len, size_t header_bytes,
                                         const char *magic, uint32_t version, const char *what,
                                         const char *name, embps_error_t *err);

/**
 * Writes the len bytes at p to `path` durably (temporary name, fsync, rename), for a checkpoint
 * file whose bytes another layer encodes (the retry window). *bytes (may be NULL) gets the
 * file's size. The caller fsyncs the directory afterwards. Errors as embps_ckpt_write_slice.
 */
embps_status_t embps_ckpt_write_file(const char *path, const void *p, size_t len, uint64_t *bytes,
                                     embps_error_t *err);

/**
 * Reads the checkpoint file `path` whole into a new buffer *out (*len bytes; free with
 * embps_free). Its size must be `want_bytes`, as its manifest lists it. Returns EMBPS_OK;
 * EMBPS_DATA_LOSS when it is missing, truncated or of another size (naming the file and both
 * sizes); EMBPS_RESOURCE_EXHAUSTED; EMBPS_INTERNAL for another I/O error (naming the file).
 */
embps_status_t embps_ckpt_read_file(const char *path, uint64_t want_bytes, uint8_t **out,
                                    size_t *len, embps_error_t *err);

/** fsyncs a directory (after files in it were created, renamed or removed). Returns EMBPS_OK or
 * EMBPS_INTERNAL naming it. */
embps_status_t embps_ckpt_sync_dir(const char *dir, embps_error_t *err);

/** One data file a manifest lists. */
typedef struct embps_ckpt_file {
  uint32_t rank;
  char table[EMBPS_TABLE_NAME_MAX];
  uint64_t bytes; /* the file's size; a file of another size fails the restore */
} embps_ckpt_file_t;

/** What a checkpoint holds, as its manifest says. */
typedef struct embps_ckpt_manifest {
  uint32_t format_version; /* as read: the file's (a version 1 file's tables are dense) */
  uint64_t round;          /* the tables as they stood after this round */
  uint64_t base_round;     /* incremental: the checkpoint it applies on; 0 when full */
  uint64_t time_ms;        /* wall-clock time (Unix ms) at which the manifest was written */
  uint32_t group_size;     /* ranks that wrote it */
  char scope[EMBPS_TABLE_NAME_MAX]; /* "": every table the group held; else the one table */
  size_t num_tables;
  embps_table_config_t *tables; /* owned; resolved configs */
  size_t num_files;
  embps_ckpt_file_t *files; /* owned; every rank's file of every table */
  uint64_t bytes;           /* the files' sizes summed */
} embps_ckpt_manifest_t;

/**
 * Writes m as ckpt_dir/MANIFEST durably: temporary name, fsync, rename, fsync of ckpt_dir. Only
 * then does the checkpoint exist. m->format_version is written as EMBPS_CKPT_FORMAT_VERSION.
 * Errors as embps_ckpt_write_slice.
 */
embps_status_t embps_ckpt_write_manifest(const char *ckpt_dir, const embps_ckpt_manifest_t *m,
                                         embps_error_t *err);

/**
 * Reads and verifies ckpt_dir/MANIFEST into *m (free with embps_ckpt_manifest_free). Returns
 * EMBPS_OK; EMBPS_NOT_FOUND when there is none; EMBPS_FAILED_PRECONDITION for another format
 * version (naming both); EMBPS_DATA_LOSS when it is truncated or its checksum fails (naming the
 * file, expected and actual checksums); EMBPS_INTERNAL for an I/O error.
 */
embps_status_t embps_ckpt_read_manifest(const char *ckpt_dir, embps_ckpt_manifest_t *m,
                                        embps_error_t *err);

/** Frees what a manifest owns and zeroes it. */
void embps_ckpt_manifest_free(embps_ckpt_manifest_t *m);

/**
 * The complete checkpoints in dir (those whose manifest verifies), by ascending round, into
 * *out (n entries; free with embps_ckpt_list_free). Directories without a valid manifest are
 * skipped. Returns EMBPS_OK (possibly with none), EMBPS_NOT_FOUND when dir does not exist,
 * EMBPS_INTERNAL.
 */
embps_status_t embps_ckpt_list(const char *dir, embps_ckpt_manifest_t **out, size_t *n,
                               embps_error_t *err);
void embps_ckpt_list_free(embps_ckpt_manifest_t *list, size_t n);

/**
 * As embps_ckpt_list, but only the newest `max` complete checkpoints (still by ascending round):
 * what an operator's listing shows. Free with embps_ckpt_list_free. Errors as embps_ckpt_list.
 */
embps_status_t embps_ckpt_list_newest(const char *dir, size_t max, embps_ckpt_manifest_t **out,
                                      size_t *n, embps_error_t *err);

/**
 * Removes what retention no longer needs, once a newer checkpoint is complete: complete
 * checkpoints beyond the newest `keep` of the same scope (never one that a kept incremental
 * checkpoint chains back to), and incomplete checkpoint directories older than the newest
 * complete one (a crash left them). keep 0 keeps everything. Returns EMBPS_OK or EMBPS_INTERNAL
 * (what could not be removed stays, and is tried again next time).
 */
embps_status_t embps_ckpt_prune(const char *dir, uint32_t keep, embps_error_t *err);

/** Removes one checkpoint directory and every file in it (an incomplete one, after a failure). */
embps_status_t embps_ckpt_remove(const char *ckpt_dir, embps_error_t *err);

/**
 * Checks that dir exists, is a directory and that this process may create files in it.
 * Returns EMBPS_OK, or EMBPS_FAILED_PRECONDITION with a message naming dir and the reason.
 */
embps_status_t embps_ckpt_dir_check(const char *dir, embps_error_t *err);

/**
 * Takes the directory's lock (an exclusive flock on dir/LOCK, which records who holds it) so
 * that no second group writes into the same directory. *fd is the lock; it is released when
 * the process exits or closes it. Returns EMBPS_OK, EMBPS_FAILED_PRECONDITION when another
 * process holds it (naming the directory and the holder the file records), EMBPS_INTERNAL.
 * holder is a short text recorded in the file (e.g. "pid 12 on host a, group of 4").
 */
embps_status_t embps_ckpt_dir_lock(const char *dir, const char *holder, int *fd,
                                   embps_error_t *err);

/** Where embps_ckpt_read_columns puts a slice: host arrays shaped as embps_ckpt_slice_t's for
 * rows x shard_width (state arrays NULL where the optimizer has none). */
typedef struct embps_ckpt_dest {
  uint32_t col_begin, shard_width;
  void *data;
  float *state0;
  float *state1;
  uint64_t step; /* out */
} embps_ckpt_dest_t;

/**
 * Reads columns [dst->col_begin, dst->col_begin + dst->shard_width) of `table` as the
 * checkpoint `m` in `dir` holds them, whatever group size wrote it: from every file whose
 * column range overlaps, and, for an incremental checkpoint, through its chain (the full
 * checkpoint it goes back to, then each incremental one in order). Per-row state is taken from
 * any one file (every rank holds the same). Every header, size and block checksum is verified.
 * Returns EMBPS_OK; EMBPS_NOT_FOUND for a table the checkpoint does not hold; EMBPS_DATA_LOSS for
 * a missing, truncated or corrupt file or a broken chain (naming the file, and for a corrupt
 * block its index, rows and expected and actual checksums); EMBPS_FAILED_PRECONDITION for a file
 * of another format version; EMBPS_INVALID_ARGUMENT for a column range outside the table;
 * EMBPS_INTERNAL for I/O errors. dst's arrays are then partly written: the caller discards them.
 */
embps_status_t embps_ckpt_read_columns(const char *dir, const embps_ckpt_manifest_t *m,
                                       const char *table, embps_ckpt_dest_t *dst,
                                       embps_error_t *err);

/**
 * Reads hash-keyed table `table`'s key index as the checkpoint m in dir holds it into a new index
 * *out (caller owns it; embps_hindex_free), for the index configuration c: the index file m lists
 * whole, or, for a delta, back through m's chain (base_round) to the checkpoint whose file is
 * whole, decoded, then every delta applied oldest first. Every rank reads the same files, so
 * every rank gets the same index. Returns EMBPS_OK; EMBPS_DATA_LOSS when a manifest of the chain
 * lists no index file for the table, or a file is missing, of another size than listed, corrupt
 * or malformed, or the chain is broken (naming the file); EMBPS_FAILED_PRECONDITION for a file of
 * another format version or configuration; EMBPS_RESOURCE_EXHAUSTED; EMBPS_INTERNAL for I/O
 * errors. *out is untouched on failure.
 */
embps_status_t embps_ckpt_read_index(const char *dir, const embps_ckpt_manifest_t *m,
                                     const char *table, const embps_hindex_config_t *c,
                                     embps_hindex_t **out, embps_error_t *err);

/**
 * Which checkpoint a starting rank restores, as the --restore setting `restore` says, with
 * `ckpt_dir` the checkpoint directory ("" when checkpoints are off):
 *   "none"  none;
 *   "auto"  the newest complete checkpoint of every table (scope "") in ckpt_dir; none when it
 *           holds none (the group starts empty) or checkpoints are off;
 *   a path  that checkpoint's directory (trailing slashes ignored), whose manifest must verify.
 * *round gets the checkpoint's round (0: none), and restore_dir (cap bytes) the directory that
 * holds it and its chain, as embps_ckpt_read_columns takes it ("" when none is looked for; for
 * "auto", ckpt_dir even when it holds none). Every rank decides alike from the same directory;
 * the caller makes sure they agree (the round joins the group's identity). Returns EMBPS_OK; for
 * "auto" the errors of embps_ckpt_list, for a path those of embps_ckpt_read_manifest (NOT_FOUND
 * when it is no complete checkpoint), err saying why.
 */
embps_status_t embps_ckpt_restore_choose(const char *restore, const char *ckpt_dir,
                                         char *restore_dir, size_t cap, uint64_t *round,
                                         embps_error_t *err);

#endif
