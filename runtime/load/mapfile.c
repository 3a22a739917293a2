/*
 * mapfile.c — read-only mmap of a whole file (see mapfile.h).
 */
#include "runtime/load/mapfile.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

fl_status fl_mapfile_open(const char *path, fl_mapfile *m) {
    memset(m, 0, sizeof *m);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return FL_ERR(FL_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return FL_ERR(FL_ERR_IO, "cannot stat %s: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return FL_ERR(FL_ERR_IO, "%s is not a regular file", path);
    }
    void *p = NULL;
    if (st.st_size > 0) {
        p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            int e = errno;
            close(fd);
            return FL_ERR(FL_ERR_IO, "cannot mmap %s: %s", path, strerror(e));
        }
    }
    close(fd);
    m->path = strdup(path);
    if (!m->path) {
        if (p) munmap(p, (size_t)st.st_size);
        return FL_ERR(FL_ERR_OOM, "out of memory");
    }
    m->data = p;
    m->size = (size_t)st.st_size;
    return FL_OK;
}

void fl_mapfile_close(fl_mapfile *m) {
    if (!m) return;
    if (m->data) munmap((void *)m->data, m->size);
    free(m->path);
    memset(m, 0, sizeof *m);
}
