/*
 * fuzz_memfd.h — for fuzz targets whose parser takes a path: the input is
 * written to an anonymous memory file, opened as /proc/self/fd/N, so no
 * temporary file is left behind and runs do not touch the disk.
 */
#ifndef FL_FUZZ_MEMFD_H
#define FL_FUZZ_MEMFD_H

/* needs _GNU_SOURCE (memfd_create): include it first */
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

/* Returns the fd (close it after use) with path[64] naming it, or -1. */
static inline int fuzz_memfd(const uint8_t *data, size_t size, char path[64]) {
    int fd = memfd_create("fuzz_input", MFD_CLOEXEC);
    if (fd < 0) return -1;
    if (size && write(fd, data, size) != (ssize_t)size) {
        close(fd);
        return -1;
    }
    snprintf(path, 64, "/proc/self/fd/%d", fd);
    return fd;
}

#endif /* FL_FUZZ_MEMFD_H */
