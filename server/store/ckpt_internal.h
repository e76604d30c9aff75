/* What the checkpoint modules share, and nothing outside the store layer sees (its view lists
 * this header as private). checkpoint.h is the face; behind it:
 *   ckpt_codec.c     every byte layout: headers, blocks, trailers, manifests, their crc32s
 *   ckpt_file.c      durable files (temporary name, fsync, rename) and whole reads and writes
 *   ckpt_writer.c    a rank's slice of a table, written as blocks
 *   ckpt_reader.c    one slice file read back and verified, by several threads when full
 *   ckpt_manifest.c  the MANIFEST that makes a checkpoint exist
 *   ckpt_dir.c       the checkpoint directory: names, listing, pruning, its check and lock
 *   ckpt_restore.c   a table's columns through a chain of checkpoints, and which one to restore
 *   ckpt_stream.c    a table's whole rows in order through the chain, offline (ckpt_stream.h)
 * Arrows point up this list: a module uses only those above it. */
#ifndef EMBPS_STORE_CKPT_INTERNAL_H
#define EMBPS_STORE_CKPT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "server/store/checkpoint.h"
#include "server/store/store.h"

/* ---- the codec (ckpt_codec.c) --------------------------------------------------------------- */

#define EMBPS__CKPT_SLICE_MAGIC "EMBPSCKP"
#define EMBPS__CKPT_TRAILER_MAGIC "EMBPSEND"
#define EMBPS__CKPT_MANIFEST_MAGIC "EMBPSMAN"
/** The bytes that open a slice file or a manifest: magic, format version, a length. */
#define EMBPS__CKPT_PREAMBLE 16u
#define EMBPS__CKPT_BLOCK_HEADER 20u
#define EMBPS__CKPT_TRAILER_BYTES 32u
/** A slice header longer than this is not one. */
#define EMBPS__CKPT_HEADER_MAX 4096u
/** A block holds about this much payload: big enough that the per-block work vanishes, small
 * enough that a reader's buffer stays small. */
#define EMBPS__CKPT_BLOCK_TARGET (1u << 20)
/** A manifest larger than this is not one (a million files is far beyond any group). */
#define EMBPS__CKPT_MANIFEST_MAX (256u << 20)

/** The crc32 every checksum of the format is (zlib's; see ckpt_codec.c): c continued over n
 * bytes at p, starting from 0. */
uint32_t embps__ckpt_crc(uint32_t c, const void *p, size_t n);

/** blocks_crc, the trailer's checksum of the blocks' checksums, continued over one more. */
uint32_t embps__ckpt_blocks_crc_add(uint32_t blocks_crc, uint32_t block_crc);

/** The bytes of one row of a slice `shard_width` columns wide in each of its arrays (data,
 * state0, state1); 0 for an array the optimizer does not keep. */
void embps__ckpt_row_bytes(const embps_table_config_t *cfg, uint32_t shard_width, size_t out[3]);

/** The rows of a full slice's blocks (all but its last), for rows of per_row payload bytes. */
uint64_t embps__ckpt_rows_per_block(size_t per_row);

/** A slice file's header, past its preamble. */
typedef struct embps__ckpt_header {
  uint32_t rank, group_size, col_begin, shard_width;
  uint64_t round, step, base_round;
  uint64_t blocks, rows_written;
  embps_table_config_t config;
} embps__ckpt_header_t;

/** Encodes h as a slice file's whole header (preamble, fields, crc32) into *out, *len bytes,
 * which the caller frees with embps_free. Returns 0, or -1 out of memory (*out untouched). */
int embps__ckpt_header_encode(const embps__ckpt_header_t *h, uint8_t **out, size_t *len);

/** Decodes the fields of a whole header of hlen bytes at p (its preamble and crc32 already
 * checked) into *h, its table spec as the format version at p + 8 lays it out (version 1: the
 * hash-keyed settings 0). Returns 0, or -1 when the fields do not fill the header exactly. */
int embps__ckpt_header_decode(const uint8_t *p, size_t hlen, embps__ckpt_header_t *h);

/** Checks the magic and format version of the EMBPS__CKPT_PREAMBLE bytes at p, which open the
 * file at path: EMBPS_CKPT_FORMAT_VERSION_MIN to EMBPS_CKPT_FORMAT_VERSION are read. Returns
 * EMBPS_OK, EMBPS_DATA_LOSS (another magic) or EMBPS_FAILED_PRECONDITION (another version, named
 * with the versions this build reads). */
embps_status_t embps__ckpt_check_preamble(const uint8_t *p, const char *magic, const char *path,
                                          embps_error_t *err);

/** A block's header: its first row, rows, payload bytes and crc32 (of the header's 16 bytes
 * before it and of the payload). */
typedef struct embps__ckpt_block {
  uint64_t first;
  uint32_t rows, bytes, crc;
} embps__ckpt_block_t;

/** Writes b as the EMBPS__CKPT_BLOCK_HEADER bytes at p; returns the crc32 of the 16 that the
 * block's checksum starts with (b->crc is written as it is: the caller continues the crc32 over
 * the payload and writes the header again with it). */
uint32_t embps__ckpt_block_put(uint8_t *p, const embps__ckpt_block_t *b);
void embps__ckpt_block_get(const uint8_t *p, embps__ckpt_block_t *b);

/** A slice file's trailer, as read. */
typedef struct embps__ckpt_trailer {
  int magic_ok;
  uint64_t blocks, rows;
  uint32_t blocks_crc;
  uint32_t crc, crc_actual; /* the trailer's own crc32: as written, and of its bytes */
} embps__ckpt_trailer_t;

/** Writes the EMBPS__CKPT_TRAILER_BYTES of a trailer at p. */
void embps__ckpt_trailer_put(uint8_t *p, uint64_t blocks, uint64_t rows, uint32_t blocks_crc);
void embps__ckpt_trailer_get(const uint8_t *p, embps__ckpt_trailer_t *t);

/** Encodes m as a whole MANIFEST file (format version EMBPS_CKPT_FORMAT_VERSION whatever m says)
 * into *out, *len bytes, which the caller frees with embps_free. Returns 0, -1 out of memory. */
int embps__ckpt_manifest_encode(const embps_ckpt_manifest_t *m, uint8_t **out, size_t *len);

/** Decodes and verifies the len bytes of the manifest at path into *m (free with
 * embps_ckpt_manifest_free; zeroed on failure). Returns EMBPS_OK; EMBPS_DATA_LOSS when it is
 * truncated, overlong, malformed or fails its crc32; EMBPS_FAILED_PRECONDITION for another
 * format version; EMBPS_RESOURCE_EXHAUSTED. */
embps_status_t embps__ckpt_manifest_decode(const char *path, const uint8_t *p, size_t len,
                                           embps_ckpt_manifest_t *m, embps_error_t *err);

/** Whether two table specs are the same as written, bit for bit. */
int embps__ckpt_same_config(const embps_table_config_t *a, const embps_table_config_t *b);

/* ---- files (ckpt_file.c) -------------------------------------------------------------------- */

/** The error for errno e while doing `what` to path: EMBPS_RESOURCE_EXHAUSTED for a full disk or
 * quota ("no space left on device writing PATH"), else EMBPS_INTERNAL with the system's reason. */
embps_status_t embps__ckpt_io_error(embps_error_t *err, int e, const char *what, const char *path);

/** Writes all n bytes; 0, or -1 (errno set). */
int embps__ckpt_write_all(int fd, const void *p, size_t n);

/** Reads exactly n bytes; 1, 0 at end of file before n bytes, -1 on error (errno set). */
int embps__ckpt_read_all(int fd, void *p, size_t n);

/** A file being written durably: to path.tmp, then finished by embps__ckpt_out_commit (fsync,
 * close, rename onto path) or dropped by embps__ckpt_out_abandon (close, unlink). Initialize fd
 * to -1, so that abandoning one that never opened is harmless. */
typedef struct embps__ckpt_out {
  int fd;
  const char *path; /* borrowed */
  char tmp[EMBPS_CKPT_PATH_MAX + 8];
  uint8_t *buf; /* owned: small writes gather here */
  size_t len;
  uint64_t written, kicked; /* bytes written; bytes whose writeback was started */
} embps__ckpt_out_t;

/** Creates path.tmp. Returns EMBPS_OK; EMBPS_INVALID_ARGUMENT (path too long),
 * EMBPS_RESOURCE_EXHAUSTED, EMBPS_INTERNAL (as embps__ckpt_io_error). */
embps_status_t embps__ckpt_out_open(embps__ckpt_out_t *f, const char *path, embps_error_t *err);
/** Appends n bytes. Errors as embps__ckpt_io_error, naming the file. */
embps_status_t embps__ckpt_out_write(embps__ckpt_out_t *f, const void *p, size_t n,
                                     embps_error_t *err);
/** Flushes, fsyncs, closes and renames onto the path. On failure the caller still abandons f. */
embps_status_t embps__ckpt_out_commit(embps__ckpt_out_t *f, embps_error_t *err);
/** Closes and removes the temporary file, and frees what f holds. */
void embps__ckpt_out_abandon(embps__ckpt_out_t *f);

/* ---- reading one slice file (ckpt_reader.c) ------------------------------------------------- */

/** One slice file open for reading, its header parsed and verified. */
typedef struct embps__ckpt_in {
  int fd;
  const char *path; /* borrowed */
  uint64_t size, off;
  embps__ckpt_header_t h;
} embps__ckpt_in_t;

/** Where one file's columns land in the destination. */
typedef struct embps__ckpt_scatter {
  embps_ckpt_dest_t *dst;
  uint32_t from, width; /* the overlap, in the file's columns */
  uint32_t to;          /* the overlap's first column in dst */
  int per_row;          /* take the per-row state from this file */
} embps__ckpt_scatter_t;

/** Opens the slice file at path, which its manifest says has want_bytes, and reads and verifies
 * its header. Close it with embps__ckpt_in_close whatever this returns. Returns EMBPS_OK;
 * EMBPS_DATA_LOSS (missing, of another size, or a corrupt header), EMBPS_FAILED_PRECONDITION
 * (another format version), EMBPS_RESOURCE_EXHAUSTED, EMBPS_INTERNAL. */
embps_status_t embps__ckpt_in_open(embps__ckpt_in_t *f, const char *path, uint64_t want_bytes,
                                   embps_error_t *err);
void embps__ckpt_in_close(embps__ckpt_in_t *f);

/** Reads block b of f at off, whose first row must be at least min_row and whose payload holds
 * per_row bytes a row, into *payload (grown as needed: *cap bytes; the caller frees it), and
 * verifies its crc32. *blk gets its header. Returns EMBPS_OK, EMBPS_DATA_LOSS naming the file
 * and the block (its rows and checksums when its crc32 fails), EMBPS_RESOURCE_EXHAUSTED,
 * EMBPS_INTERNAL. */
embps_status_t embps__ckpt_read_block(const embps__ckpt_in_t *f, size_t per_row, uint64_t b,
                                      uint64_t off, uint64_t min_row, embps__ckpt_block_t *blk,
                                      uint8_t **payload, size_t *cap, embps_error_t *err);

/** Reads f's trailer at off (after its last block) and checks it against what the blocks read
 * gave: blocks_crc (the crc32 of their crc32s) and rows (their rows summed); the file must end
 * there. Returns EMBPS_OK, EMBPS_DATA_LOSS naming the file, EMBPS_INTERNAL. */
embps_status_t embps__ckpt_check_trailer(embps__ckpt_in_t *f, uint64_t off, uint32_t blocks_crc,
                                         uint64_t rows, embps_error_t *err);

/** Reads every block of f (verifying each) and its trailer, scattering the rows into sc's
 * destination; *covered counts the rows the file held. Returns EMBPS_OK, EMBPS_DATA_LOSS naming
 * the file (and a corrupt block's index, rows and checksums), EMBPS_RESOURCE_EXHAUSTED,
 * EMBPS_INTERNAL. */
embps_status_t embps__ckpt_apply_file(embps__ckpt_in_t *f, const embps__ckpt_scatter_t *sc,
                                      uint64_t *covered, embps_error_t *err);

/* ---- the chain (ckpt_restore.c) ------------------------------------------------------------- */

/** The spec of table t that m lists, or NULL. */
const embps_table_config_t *embps__ckpt_find_table(const embps_ckpt_manifest_t *m, const char *t);

/** The manifests of m's chain: its base, the base's base, ... back to its full checkpoint, into
 * *chain (*depth of them, nearest first; none for a full m; free with embps__ckpt_chain_free).
 * Returns EMBPS_OK; EMBPS_DATA_LOSS for a base round not below the round above it or a base
 * that is not a complete checkpoint; EMBPS_RESOURCE_EXHAUSTED. */
embps_status_t embps__ckpt_chain_read(const char *dir, const embps_ckpt_manifest_t *m,
                                      embps_ckpt_manifest_t **chain, size_t *depth,
                                      embps_error_t *err);
void embps__ckpt_chain_free(embps_ckpt_manifest_t *chain, size_t depth);

/** Checks that spec tc of a table, as checkpoint `round` of a chain lists it, is the same table as
 * cfg, the top checkpoint's (`top`): rows, capacity, width, dtype, optimizer. EMBPS_OK or
 * EMBPS_DATA_LOSS ("the checkpoint chain is broken"). */
embps_status_t embps__ckpt_chain_same_table(const embps_table_config_t *tc,
                                            const embps_table_config_t *cfg, uint64_t round,
                                            uint64_t top, embps_error_t *err);

/** Opens rank's slice file of table cfg (as checkpoint m lists it) in dir's checkpoint of
 * m->round, its path into path (cap bytes), and checks its header against the manifest (rank,
 * group size, columns, round, base round, table spec). Close f whatever this returns. Returns
 * EMBPS_OK; EMBPS_DATA_LOSS (not listed, missing, of another size, corrupt, or disagreeing with
 * its manifest), and embps__ckpt_in_open's errors. */
embps_status_t embps__ckpt_open_slice(const char *dir, const embps_ckpt_manifest_t *m,
                                      const embps_table_config_t *cfg, uint32_t rank,
                                      embps__ckpt_in_t *f, char *path, size_t cap,
                                      embps_error_t *err);

#endif
