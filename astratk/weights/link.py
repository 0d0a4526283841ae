"""`SimulatedLink`: an fsspec filesystem that wraps another and behaves like a remote link (latency, bandwidth).

For tests and benchmarks of cross-region weight pulls (AstraFlow's remote pools sit behind 4 Gbit/s and 300 ms) on
one machine. Every request sleeps `latency_s`; then its bytes go through one shared pipe of `bandwidth_bps`:
transfers queue behind each other, so concurrent requests overlap their latencies but not their bytes. A batch of k
concurrent reads of B bytes in all therefore takes latency + 8·B / bandwidth, and k sequential reads take
k·latency + 8·B / bandwidth. Data calls (`cat_file`, `pipe_file`) carry their bytes; metadata calls (`ls`, `info`,
`mv`, `rm`, `makedirs`) cost one latency. Streams opened with `open` pay one latency and no bandwidth: the weight store
does not use them.

Example:
    >>> link = SimulatedLink("memory://", bandwidth_bps=8e6, latency_s=0.01)  # 1 MB/s, 10 ms
    >>> link.pipe_file("/doc-link/x", b"0" * 10_000)
    >>> len(link.cat_file("/doc-link/x")), link.stats["requests"], round(link.stats["modelled_s"], 3)
    (10000, 2, 0.04)

`astratk.weights.WeightStore(url, fs=SimulatedLink(url, ...))` puts a store behind it; `weights.link_bandwidth_bps`
and `weights.link_latency_s` in a run's config do the same for `WeightStore.from_spec`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import fsspec
from fsspec import AbstractFileSystem


class SimulatedLink(AbstractFileSystem):
    """`fs_or_url`: the filesystem behind the link, or any URL of it (only its filesystem is used; paths passed to
    the link's methods are that filesystem's paths)."""

    protocol = "simlink"
    cachable = False  # fsspec would otherwise hand back one shared instance (and its counters) per argument set

    def __init__(self, fs_or_url: AbstractFileSystem | str, bandwidth_bps: float, latency_s: float = 0.0,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not bandwidth_bps > 0:
            raise ValueError(f"bandwidth_bps must be > 0 bits per second (e.g. 4e9 for 4 Gbit/s), got {bandwidth_bps}")
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0 seconds, got {latency_s}")
        self.fs = fsspec.core.url_to_fs(fs_or_url)[0] if isinstance(fs_or_url, str) else fs_or_url
        self.bandwidth_bps, self.latency_s = float(bandwidth_bps), float(latency_s)
        self._lock = threading.Lock()
        self._pipe_free_at = 0.0  # time.monotonic() at which the shared pipe finishes its queued bytes
        self.stats = {"requests": 0, "bytes": 0, "modelled_s": 0.0}  # modelled_s: latency + own bytes, summed

    def _charge(self, nbytes: int) -> None:
        """Sleep like a request of `nbytes` over the link (module docstring)."""
        time.sleep(self.latency_s)
        transfer = nbytes * 8 / self.bandwidth_bps
        with self._lock:
            start = max(time.monotonic(), self._pipe_free_at)
            self._pipe_free_at = done = start + transfer
            self.stats["requests"] += 1
            self.stats["bytes"] += nbytes
            self.stats["modelled_s"] += self.latency_s + transfer
        time.sleep(max(0.0, done - time.monotonic()))

    def transfer_time(self, nbytes: int, requests: int = 1, concurrent: bool = True) -> float:
        """The model's seconds for `requests` reads of `nbytes` in all (concurrent: latencies overlap)."""
        return self.latency_s * (1 if concurrent else requests) + nbytes * 8 / self.bandwidth_bps

    # ------------------------------------------------------------------------------------------- data calls
    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        data = self.fs.cat_file(path, start=start, end=end, **kwargs)
        self._charge(len(data))
        return data

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        self._charge(len(value))
        self.fs.pipe_file(path, value, **kwargs)

    # --------------------------------------------------------------------------------------- metadata calls
    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list:
        self._charge(0)
        return self.fs.ls(path, detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> dict:
        self._charge(0)
        return self.fs.info(path, **kwargs)

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        self._charge(0)
        self.fs.mv(path1, path2, **kwargs)

    def rm(self, path: str, recursive: bool = False, maxdepth: int | None = None) -> None:
        self._charge(0)
        self.fs.rm(path, recursive=recursive, maxdepth=maxdepth)

    def rm_file(self, path: str) -> None:
        self.rm(path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._charge(0)
        self.fs.makedirs(path, exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._charge(0)
        self.fs.mkdir(path, create_parents=create_parents, **kwargs)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        self._charge(0)
        return self.fs.open(path, mode, **kwargs)

    def __repr__(self) -> str:
        return (f"SimulatedLink({type(self.fs).__name__}, {self.bandwidth_bps / 1e9:g} Gbit/s, "
                f"{self.latency_s * 1e3:g} ms)")
