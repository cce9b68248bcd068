"""The file tier of the KV stores: fixed-size byte pages in one file (NVMe on a Jetson), torch-free.

A stream whose cold pages outgrow DRAM spills them here (zeroedge.kv.ort_policy with `spill_dir`);
the torch decoder maps its whole cold store from one (zeroedge.kv.tiers.FileTensors). The file is
private to the process:

- its folder is checked before any page is written (zeroedge.kv.policy.check_cold_path: exists or
  can be made, writable, room for the first reservation);
- it is made by tempfile.mkstemp (a random name, O_EXCL | O_NOFOLLOW, mode 0600) and unlinked at
  once: only the process's own descriptor reaches it, nothing is left on the disk when the process
  ends however it ends, and a link planted in the folder is never followed;
- it grows by doubling, each growth reserved (posix_fallocate) before a page is written there; a
  growth the disk refuses is given back (the file cut to its old size) and retried for just the
  page needed, so a full disk fails the one write that needs the room (OSError) and never a page
  already stored, and never leaves the disk full;
- close() releases it; a closed file refuses reads and writes (OSError EBADF).

Pages are read and written with pread / pwrite at slot * page_bytes.
"""
from __future__ import annotations

import errno
import os
import weakref

import numpy as np

from zeroedge.errors import UserError


def _close(fd: int):
    try:
        os.close(fd)
    except OSError:
        pass


class PageFile:
    def __init__(self, folder, page_bytes: int, reserve_pages: int = 64):
        import tempfile

        from zeroedge.kv.policy import check_cold_path

        if page_bytes < 1 or reserve_pages < 1:
            raise UserError(f"page file: page_bytes and reserve_pages must be >= 1 (got {page_bytes}, {reserve_pages})")
        self.page_bytes = int(page_bytes)
        need = self.page_bytes * int(reserve_pages)
        self.folder = check_cold_path(str(folder) if folder is not None else None, need)
        try:
            fd, path = tempfile.mkstemp(prefix="zeroedge-kv-", suffix=".pages", dir=self.folder)
        except OSError as e:
            raise UserError(f"cold store {self.folder}: cannot create a page file ({e.strerror})") from None
        try:
            os.unlink(path)
        except OSError as e:
            os.close(fd)
            raise UserError(f"cold store {self.folder}: cannot unlink its page file ({e.strerror})") from None
        self.fd = fd
        self._finalizer = weakref.finalize(self, _close, self.fd)
        self.capacity = 0
        try:
            self._reserve(int(reserve_pages))
        except OSError as e:
            self.close()
            raise UserError(f"cold store {self.folder}: cannot reserve {need} bytes ({e.strerror})") from None
        self.reads = self.writes = 0
        self.read_bytes = self.written_bytes = 0

    def _check_open(self):
        if self.fd < 0:
            raise OSError(errno.EBADF, "the page file is closed")

    def _reserve(self, pages: int):
        """Make room for `pages` slots, or raise OSError (e.g. ENOSPC) with the file as it was."""
        if pages <= self.capacity:
            return
        size = pages * self.page_bytes
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self.fd, 0, size)
            else:                                         # no fallocate: the size at least
                os.ftruncate(self.fd, size)
        except OSError:
            os.ftruncate(self.fd, self.capacity * self.page_bytes)   # give back what it did allocate
            raise
        self.capacity = pages

    def write(self, slot: int, data) -> None:
        """Store one page (exactly page_bytes bytes) at `slot`; grows the file first if needed."""
        self._check_open()
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if raw.size != self.page_bytes:
            raise ValueError(f"a page is {self.page_bytes} bytes, got {raw.size}")
        if slot < 0:
            raise ValueError(f"slot {slot} < 0")
        if slot >= self.capacity:
            try:
                self._reserve(max(slot + 1, 2 * self.capacity))
            except OSError:
                self._reserve(slot + 1)                  # the doubling did not fit: this page may
        done = os.pwrite(self.fd, raw.data, slot * self.page_bytes)
        if done != self.page_bytes:
            raise OSError(errno.EIO, f"short write ({done} of {self.page_bytes} bytes)")
        self.writes += 1
        self.written_bytes += self.page_bytes

    def read(self, slot: int) -> np.ndarray:
        """The page at `slot` as a new uint8 array of page_bytes."""
        self._check_open()
        if not 0 <= slot < self.capacity:
            raise ValueError(f"slot {slot} outside the file's {self.capacity} pages")
        raw = os.pread(self.fd, self.page_bytes, slot * self.page_bytes)
        if len(raw) != self.page_bytes:
            raise OSError(errno.EIO, f"short read ({len(raw)} of {self.page_bytes} bytes)")
        self.reads += 1
        self.read_bytes += self.page_bytes
        return np.frombuffer(raw, np.uint8).copy()

    def mapped(self):
        """The reserved file as one writable shared mapping (mmap): the torch decoder's cold store
        lives in it (zeroedge.kv.tiers.FileTensors). Every byte is reserved, so a store through the
        mapping never meets a full disk (which would be a SIGBUS, not an error)."""
        import mmap

        self._check_open()
        return mmap.mmap(self.fd, self.nbytes)

    @property
    def nbytes(self) -> int:
        """Bytes the file holds on disk (reserved)."""
        return self.capacity * self.page_bytes

    def close(self):
        self._finalizer()
        self.fd, self.capacity = -1, 0
