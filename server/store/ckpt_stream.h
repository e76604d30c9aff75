/* A table of a checkpoint read back whole and in order, offline: no group, no engine, any group
 * size that wrote it, a full checkpoint or an incremental one through its chain. What `embps
 * export` reads (client/cli/cmd_export.c): it streams the rows, so a table far larger than
 * memory is read with one block of each file in memory.
 *
 * Every byte taken is verified as embps_ckpt_read_columns verifies it: each file's size against
 * its manifest, its header against its manifest, each block's crc32 as the reader reaches it, and
 * each file's trailer once its last block is read. A failure names the file and, for a block,
 * its index and rows. */
#ifndef EMBPS_CKPT_STREAM_H
#define EMBPS_CKPT_STREAM_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "server/store/checkpoint.h"
#include "server/store/store.h"

typedef struct embps_ckpt_stream embps_ckpt_stream_t;

/**
 * Opens table `table` of the checkpoint m in dir (the directory that holds it and its chain) for
 * reading its rows in order, at its whole width: every rank's slice file of m and, for an
 * incremental checkpoint, of every checkpoint of its chain back to the full one (or to the first
 * that holds every row of a table created since), applied oldest first. Opens and checks every
 * file's size and header now; reads no block. *out (caller owns it; embps_ckpt_stream_close)
 * is untouched on failure. Returns EMBPS_OK; EMBPS_NOT_FOUND for a table m does not hold;
 * EMBPS_DATA_LOSS for a broken chain or a file that is missing, of another size than its
 * manifest lists (naming where a short file ends), or whose header is corrupt or disagrees with
 * its manifest; EMBPS_FAILED_PRECONDITION for a file of another format version;
 * EMBPS_RESOURCE_EXHAUSTED; EMBPS_INTERNAL for I/O errors.
 */
embps_status_t embps_ckpt_stream_open(const char *dir, const embps_ckpt_manifest_t *m,
                                      const char *table, embps_ckpt_stream_t **out,
                                      embps_error_t *err);

/** The table's spec, as m lists it (borrowed from the stream). */
const embps_table_config_t *embps_ckpt_stream_config(const embps_ckpt_stream_t *s);

/** The optimizer steps applied to the table at the checkpoint's round (Adam's bias correction). */
uint64_t embps_ckpt_stream_step(const embps_ckpt_stream_t *s);

/** The rows the stream gives in all: a dense table's rows, a hash-keyed table's capacity (its
 * slots, free ones included). */
uint64_t embps_ckpt_stream_rows(const embps_ckpt_stream_t *s);

/** The bytes of every file the stream reads (for a progress meter), and those read so far (their
 * headers at open; all of them once the last row is read). */
uint64_t embps_ckpt_stream_bytes(const embps_ckpt_stream_t *s);
uint64_t embps_ckpt_stream_bytes_read(const embps_ckpt_stream_t *s);

/** A number of rows to read at a time of about target_bytes of every array: a multiple of the
 * blocks' rows when one full slice file covers the whole table, so that each block is read
 * straight into the caller's arrays (at least 1). */
uint64_t embps_ckpt_stream_chunk_rows(const embps_ckpt_stream_t *s, size_t target_bytes);

/**
 * Reads the next n rows (no more than are left) into the caller's arrays, each NULL when not
 * wanted: data, n x emb_width elements of the table's dtype; state0, adagrad's accumulators or
 * Adam's m (n x emb_width floats) or rowwise_adagrad's per-row accumulator (n floats); state1,
 * Adam's v (n x emb_width floats). Arrays the optimizer does not keep are left alone. Each
 * block is verified before a row of it is taken; when the last row is read, every file's
 * trailer is verified too. Returns EMBPS_OK; EMBPS_INVALID_ARGUMENT when n exceeds the rows
 * left; EMBPS_DATA_LOSS naming the file and, for a block, its index, rows and checksums;
 * EMBPS_RESOURCE_EXHAUSTED; EMBPS_INTERNAL. After a failure the stream reads nothing more.
 */
embps_status_t embps_ckpt_stream_read(embps_ckpt_stream_t *s, uint64_t n, void *data, float *state0,
                                      float *state1, embps_error_t *err);

/** Closes the files and frees s; NULL is a no-op. */
void embps_ckpt_stream_close(embps_ckpt_stream_t *s);

#endif
