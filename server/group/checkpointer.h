/* A rank's part in checkpoints (DESIGN.md, Durability), internal to the group layer: capture
 * at the round boundary, a background writer, and restore at startup. The protocol between the
 * ranks decides when (ckpt_leader.c: the leader orders a checkpoint like a round, every rank
 * captures when it applies it, the leader writes the manifest once every rank's files are
 * durable); this module does the work, with the bytes on disk left to server/store/checkpoint.h.
 *
 * Capture fixes each table's slice (rows and optimizer state) as it is after the checkpoint's
 * round into host snapshot buffers that live as long as the table, then hands them to the
 * writer thread; the group's thread goes on serving while the files are written. Where tables
 * are host memory (the CPU backend) the capture copies nothing at once: it opens a
 * copy-on-write snapshot (store.h), which the writer completes at memory speed and the engine
 * settles block by block before it writes a row, so no batch waits for a whole table's copy.
 * Where they are GPU memory, the capture is one device-to-host copy into buffers that the
 * writer touched beforehand (so the copy is not a storm of page faults). Only one checkpoint is
 * in flight at a time (the leader waits for one to complete before it orders the next), so the
 * writer is done with the buffers before the next capture reuses them. */
#ifndef EMBPS_GROUP_CHECKPOINTER_H
#define EMBPS_GROUP_CHECKPOINTER_H

#include <stdint.h>

#include "common/status.h"
#include "server/engine/engine.h"
#include "server/group/control.h"
#include "server/group/dedup.h"
#include "server/store/checkpoint.h"
#include "server/store/store.h"

typedef struct embps__ckpt embps__ckpt_t;

typedef struct embps__ckpt_config {
  const char *dir; /* the checkpoint directory (borrowed for the call; copied) */
  uint32_t rank, size;
  uint32_t keep;   /* complete checkpoints kept per scope (0: all) */
  int track_dirty; /* incremental checkpoints: tables track the rows they write */
  int host_tables; /* the engine's tables are host memory: captures are copy-on-write
                      (embps_table_snapshot_begin), and snapshot buffers need no prefault */
  int wake_fd;     /* an eventfd the writer makes readable when a job is finished */
} embps__ckpt_config_t;

/** What a finished job reports (embps__ckpt_take). */
typedef struct embps__ckpt_result {
  int manifest; /* 1: the leader's manifest job; 0: this rank's files */
  uint64_t round;
  embps_error_t error; /* status EMBPS_OK on success */
  uint64_t bytes;      /* this rank's files; for a manifest, the whole checkpoint's */
  char path[EMBPS__CKPT_PATH_MAX];
} embps__ckpt_result_t;

/** Starts the writer thread. Returns EMBPS_OK, EMBPS_RESOURCE_EXHAUSTED or EMBPS_INTERNAL. */
embps_status_t embps__ckpt_new(embps__ckpt_t **out, const embps__ckpt_config_t *cfg);

/** Finishes the job being written (queued ones are dropped), stops the thread, frees the
 * snapshot buffers. NULL is a no-op. */
void embps__ckpt_free(embps__ckpt_t *c);

/** Group thread: readies a new table for checkpoints (its snapshot buffers, its dirty-row
 * tracking with every row dirty). A failure is logged and tried again at the next capture. */
void embps__ckpt_prepare(embps__ckpt_t *c, embps_table_t *table);

/** Group thread: table was dropped (embps_store_drop); its snapshot buffers are freed now, or
 * once the writer has written the checkpoint in progress that holds the table. */
void embps__ckpt_forget(embps__ckpt_t *c, embps_table_t *table);

/**
 * Group thread, when it applies a checkpoint's round entry: copies every table of the order's
 * scope (in store order) through the engine into the snapshot buffers and queues their files
 * for the writer. On the leader (rank 0) it also encodes `window` (the retry window, as it is at
 * this round; NULL: none), keeping the entries of the order's scope, and the writer writes it as
 * the checkpoint's EMBPS_CKPT_WINDOW file with the leader's slices, which the manifest lists.
 * Returns EMBPS_OK, or the failure (err says why; nothing was queued, and the caller reports it as
 * this rank's result).
 */
embps_status_t embps__ckpt_capture(embps__ckpt_t *c, embps_engine_t *engine, embps_store_t *store,
                                   const embps_dedup_t *window, const embps__ckpt_order_t *order,
                                   embps_error_t *err);

/**
 * Leader: every rank has reported on checkpoint `order`. With ok set, queues the manifest (from
 * the leader's own capture of the same checkpoint: tables and the files every rank wrote) and
 * then the pruning of older checkpoints; otherwise queues the removal of what was written.
 * Either way a result with manifest = 1 follows, carrying the status to answer with (`why`
 * when not ok).
 */
void embps__ckpt_finish(embps__ckpt_t *c, const embps__ckpt_order_t *order, int ok,
                        const embps_error_t *why);

/** Group thread: takes the next finished job's result; returns 0 when there is none. */
int embps__ckpt_take(embps__ckpt_t *c, embps__ckpt_result_t *out);

/**
 * Restores the checkpoint of `round` in dir onto this rank (every rank calls it after the group
 * formed, in step: it runs collectives): each table's config is resolved for this group's size
 * (emb_width must split evenly over it, with DESIGN.md's message; a table alone beyond the
 * store's memory budget is refused before any is created), created through the engine
 * and filled from the columns this rank now owns. Tables are tracked for incremental
 * checkpoints (every row clean) when c is not NULL. When the manifest lists a retry window file,
 * every rank reads it into a new window of *window's size (EMBPS_DEDUP_MAX_CLIENTS clients) that
 * replaces *window: the window as it stood at the checkpoint's round, its entries those of the
 * checkpoint's tables; a checkpoint without one (written before windows were kept) leaves
 * *window as it is (window may be NULL: none is read). A corrupt one fails the restore like a
 * corrupt slice, naming the file. *manifest_out (may be NULL) receives the
 * manifest (the caller frees it). Returns EMBPS_OK, or the failure of this rank or another (err
 * says which); the caller then stops: a half-restored rank never serves.
 */
embps_status_t embps__ckpt_restore(embps__ckpt_t *c, embps_engine_t *engine, embps_store_t *store,
                                   const char *dir, uint64_t round, uint32_t rank, uint32_t size,
                                   embps_dedup_t **window, embps_ckpt_manifest_t *manifest_out,
                                   embps_error_t *err);

#endif
