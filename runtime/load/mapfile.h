/*
 * mapfile.h — read-only memory mapping of a whole file.
 * Loaders keep the mapping for the model's lifetime so weights can be used
 * in place (zero copy) on the CPU backend.
 */
#ifndef FL_MAPFILE_H
#define FL_MAPFILE_H

#include <stddef.h>

#include "core/status.h"

typedef struct fl_mapfile {
    char *path;         /* malloc'd copy, for messages */
    const void *data;   /* NULL for an empty file */
    size_t size;
} fl_mapfile;

/* Maps `path` read-only. Errors (FL_ERR_IO) name the path and errno text. */
fl_status fl_mapfile_open(const char *path, fl_mapfile *m);
/* Unmaps and frees; a zeroed or NULL fl_mapfile is a no-op. */
void fl_mapfile_close(fl_mapfile *m);

#endif /* FL_MAPFILE_H */
