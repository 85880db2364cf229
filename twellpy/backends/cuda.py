"""CUDA backend: CuPy launchers for the container kernels in ``raw_kernels/``.

Every public function here has the same name, argument order and return
values as its twin in :mod:`twellpy.backends.cpu` (the contract is in
docs/internals.md). Inputs are cupy arrays (made C-contiguous here); outputs
are freshly allocated cupy arrays on the current device.

Kernels and where they live:

=====================  =================================================
``construct.cu``       dense -> TwELL / ELL (one pass, ballot prefix
                       counts), row non-zero counts, CSR -> TwELL / ELL
``convert.cu``         slot lists -> dense / CSR, dtype casts
``spmm.cu``            TwELL / slot-list / CSR times dense (gathers)
``spmm_resident.cu``   sparse rows times dense with B's column slices
                       resident in shared memory: TwELL @ B (after a
                       TwELL compaction), the split FFN and training steps
``transpose.cu``       deterministic counting-sort transpose
``check.cu``           NaN/Inf count in one pass (``check_finite``)
=====================  =================================================

Determinism: every slot position and every output position comes from a
prefix count, and every sum is taken in a fixed order, so the same input gives
the same bits on every run (``slots_spmm_t`` included: it transposes A by a
counting sort, then gathers rows of B in source-row order; no atomic float
adds anywhere).

All template instantiations are declared at import with
:func:`twellpy.backends._registry.declare`, so ``tools/check_kernels.py``
compiles every one of them for sm_90a and sm_80 without a GPU.
"""
from __future__ import annotations

import functools
import threading

import numpy as np

from .._array import FLOAT_DTYPES, cupy_module, float_bit_masks
from . import _registry as reg

_INT32_MAX = 2**31 - 1
#: warps per block of twellpy_transpose_scan (segments of the row-block axis)
TRANSPOSE_SCAN_SEGS = 8
_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)

# ---------------------------------------------------------------------------
# launch configuration (block sizes must not exceed the launch bounds in the
# .cu files; tests/test_registry.py checks that)
# ---------------------------------------------------------------------------
#: Warps per block of the construction kernels (<= CONSTRUCT_WARPS).
CONSTRUCT_WARPS = 8
#: TwELL tiles of one row handled by one warp in ``dense_to_twell``. Rows of
#: at most this many tiles (N <= 8192 at T = 256) take one warp each, which
#: needs no zero-filled row maximum and no atomics (benchmarks/kernels.py:
#: a whole W1 row per warp was the fastest split).
CONSTRUCT_TILES_PER_WARP = 32
#: Warps per block of the warp-per-row conversion kernels (<= CONVERT_WARPS).
CONVERT_WARPS = 8
#: Threads per block of element-wise kernels (<= CONVERT_BLOCK, TRANSPOSE_BLOCK).
ELEMENTWISE_BLOCK = 256
#: Warps per block of the SpMM kernels (<= SPMM_WARPS).
SPMM_WARPS = 4
#: Largest number of 32*VEC-column strips one SpMM warp owns (1, 2, 4 or 8).
#: More strips -> fewer index reads, more registers. Benchmarked in
#: benchmarks/kernels.py.
SPMM_MAX_ITERS = 8
#: Extra ``#define``s for construct.cu / spmm.cu (e.g. ``{"SPMM_LOADS": 8}``).
#: Empty = the declared defaults, compiled once per file; anything else
#: compiles the one kernel needed on first use (benchmarks/kernels.py sweeps them).
CONSTRUCT_DEFINES: dict = {}
SPMM_DEFINES: dict = {}
#: Variants of the construction loop (construct.cu), declared so that CI
#: compiles them, and tested on the GPU; a variant runs when
#: ``CONSTRUCT_DEFINES`` is set to it. The default streams 16-byte inputs
#: through a per-warp cp.async ring of 4 chunks with the two-ballot slot prefix
#: (W1, 2026-12-05: 62% of the copy bandwidth on an H200, 77% on an H100).
#: "registers": the earlier default, loads into registers (56% and 72%);
#: "prefetch": each lane's next loads go out before it packs the current
#: chunks; "async-ring": a ring of 8 chunks.
CONSTRUCT_VARIANTS = {
    "registers": {"CONSTRUCT_ASYNC_DEPTH": 0, "CONSTRUCT_FAST_PREFIX": 0},
    "prefetch": {"CONSTRUCT_ASYNC_DEPTH": 0, "CONSTRUCT_PREFETCH": 1, "CONSTRUCT_MIN_BLOCKS": 4},
    "async-ring": {"CONSTRUCT_ASYNC_DEPTH": 8},
}
#: Grid cap of the grid-stride kernels.
_MAX_GRID = 1 << 20
#: Budget of (row chunk, column) counters of the transpose (int32 entries).
_TRANSPOSE_COUNTER_BUDGET = 1 << 24

_SPMM_ITERS = (1, 2, 4, 8)

#: ``twell_spmm`` runs the row-block kernel ``twellpy_twell_spmm_rows``
#: (False: the warp-per-row ``twellpy_twell_spmm``; benchmarks compare both).
SPMM_ROW_BLOCK = True
#: Threads per block of the row-block SpMM. The kernel is always compiled with
#: it as -DSPMM_ROWS_THREADS (see _spmm_rows_defines; an SPMM_ROWS_THREADS in
#: SPMM_DEFINES takes precedence) and the launch takes its block size from the
#: same define set, so the kernel's block size and the launch always agree.
SPMM_ROWS_THREADS = 128
#: 16-byte B loads each thread of the row-block SpMM keeps in flight (KB * NV);
#: 4 with spmm.cu's 8 resident blocks per SM was the fastest measured pair.
SPMM_ROWS_INFLIGHT = 4
#: strips per thread of the row-block SpMM (NV): wider rows use more column blocks
_SPMM_ROWS_NV = (1, 2)


#: ``twell_spmm`` with B's column slices resident in shared memory
#: (``twellpy_spmm_resident``): every block keeps B[:, slice] on chip and
#: streams A's rows past it, so B is read once per slice instead of once per
#: entry. "auto": for calls of at least RESIDENT_MIN_ROWS rows when a slice
#: fits the device's shared memory; True: whenever it fits; False: never.
#: False: measured slower than the row-block gather kernel (W1 on an H200,
#: 2026-12-05: 0.52 ms against 0.26 ms), though it gives the same bits.
SPMM_RESIDENT = False
RESIDENT_MIN_ROWS = 4096
#: threads per block of the resident kernel (one block per SM) and entries of
#: A staged per warp; both are compiled in (-DRES_THREADS, -DRES_STAGE)
RESIDENT_THREADS = 512
RESIDENT_STAGE = 256
#: entries staged per warp and round for two operands (DUAL): shorter, so that two
#: slices of a 5632-row weight still fit an H100/H200's 227 KB (two values per entry)
RESIDENT_DUAL_STAGE = 128
#: warps per block of the TwELL compaction kernels (-DCOMPACT_WARPS)
COMPACT_WARPS = 8
#: 16-byte column vectors per row of a slice, widest first (the widest that fits is used)
_RESIDENT_LPR = (4, 2, 1)
#: fewest rows of a row chunk: more chunks would reload the slice for little work
_RESIDENT_MIN_CHUNK_ROWS = 128
#: largest temporary compaction of A (bytes); larger inputs use the gather kernel
_RESIDENT_COMPACT_BUDGET = 1 << 30


def _resident_defines(dual=False):
    stage = RESIDENT_DUAL_STAGE if dual else RESIDENT_STAGE
    return {"RES_THREADS": int(RESIDENT_THREADS), "RES_STAGE": int(stage), "COMPACT_WARPS": int(COMPACT_WARPS)}


def _spmm_rows_defines():
    """``#define``s the row-block SpMM is compiled with: SPMM_DEFINES plus
    SPMM_ROWS_THREADS (from the module constant unless SPMM_DEFINES sets it).
    Its SPMM_ROWS_THREADS is also the launch's block size (_spmm_rows_plan)."""
    return {"SPMM_ROWS_THREADS": int(SPMM_ROWS_THREADS), **SPMM_DEFINES}


def _vec_width(dtype) -> int:
    """Elements per 16-byte vector access."""
    return 16 // np.dtype(dtype).itemsize


def _ct(dtype) -> str:
    return reg.ctype(dtype)


# ---------------------------------------------------------------------------
# kernel names (one function builds both the declaration and the lookup name)
# ---------------------------------------------------------------------------
def _name_dense(kernel, dtype, vec):
    return f"twellpy_{kernel}<{_ct(dtype)}, {vec}>"


def _name_t(kernel, dtype):
    return f"twellpy_{kernel}<{_ct(dtype)}>"


def _name_spmm(kernel, dtype, vec, iters):
    return f"twellpy_{kernel}<{_ct(dtype)}, {vec}, {iters}>"


def _name_spmm_rows(dtype, vec, nv, kb):
    return f"twellpy_twell_spmm_rows<{_ct(dtype)}, {vec}, {nv}, {kb}>"


def _name_resident(dtype, lpr, value_dtype=None, lists=False, dual=False, prod=False):
    """``twellpy_spmm_resident<T, V, LPR, LISTS[, DUAL[, PROD]]>``: V (the entries'
    value type) defaults to T."""
    tail = ", false, true>" if prod else (", true>" if dual else ">")
    return f"twellpy_spmm_resident<{_ct(dtype)}, {_ct(value_dtype or dtype)}, {lpr}, {reg.cbool(lists)}" + tail


def _name_cast(src, dst):
    return f"twellpy_cast<{_ct(src)}, {_ct(dst)}>"


def _declare_all():
    construct, convert, spmm, spmm_rows, transpose = [], [], [], [], []
    for dt in FLOAT_DTYPES:
        for vec in sorted({1, _vec_width(dt)}):
            construct += [_name_dense(k, dt, vec) for k in ("dense_to_twell", "dense_row_nnz", "dense_to_ell")]
            for iters in _SPMM_ITERS:
                spmm += [_name_spmm(k, dt, vec, iters) for k in ("twell_spmm", "slots_spmm", "csr_spmm")]
            spmm_rows += [_name_spmm_rows(dt, vec, nv, max(1, SPMM_ROWS_INFLIGHT // nv)) for nv in _SPMM_ROWS_NV]
        construct += [_name_t("csr_to_twell", dt), _name_t("csr_to_ell", dt)]
        convert += [_name_t("slots_to_dense", dt), _name_t("slots_to_csr", dt)]
        convert += [_name_cast(dt, d2) for d2 in FLOAT_DTYPES if d2 != dt]
        transpose.append(_name_t("transpose_fill", dt))
    transpose += ["twellpy_transpose_count", f"twellpy_transpose_scan<{TRANSPOSE_SCAN_SEGS}>"]
    reg.declare("construct.cu", construct)
    for variant in CONSTRUCT_VARIANTS.values():
        reg.declare("construct.cu", [_name_dense("dense_to_twell", dt, vec) for dt in FLOAT_DTYPES
                                     for vec in sorted({1, _vec_width(dt)})], variant)
    reg.declare("convert.cu", convert)
    reg.declare("spmm.cu", spmm)
    # with the defines twell_spmm looks them up with, so a warm-up compile is the one run time uses
    reg.declare("spmm.cu", spmm_rows, _spmm_rows_defines())
    reg.declare("transpose.cu", transpose)
    resident = (["twellpy_twell_row_totals"]
                + [_name_t("twell_compact", dt) for dt in FLOAT_DTYPES]
                + [_name_resident(dt, lpr) for dt in FLOAT_DTYPES for lpr in _RESIDENT_LPR]
                # the fused FFN's split mode: its row lists, h in the accumulator type
                + [_name_resident(dt, lpr, np.float64 if dt.itemsize == 8 else np.float32, lists=True)
                   for dt in FLOAT_DTYPES for lpr in _RESIDENT_LPR]
                # the split training backward (ReLU) and forward (ReLU: h = g): ELL rows, data-type values
                + [_name_resident(dt, lpr, lists=True) for dt in FLOAT_DTYPES for lpr in _RESIDENT_LPR]
                # the split gated training forward: h = g * u rounded, from the ELL rows of g and u
                + [_name_resident(dt, lpr, lists=True, prod=True) for dt in FLOAT_DTYPES for lpr in _RESIDENT_LPR])
    reg.declare("spmm_resident.cu", list(dict.fromkeys(resident)), _resident_defines())  # fp32/fp64 repeat
    # the split training backward, gated: du and dg with slices of w_up and w_gate (DUAL)
    reg.declare("spmm_resident.cu", [_name_resident(dt, lpr, lists=True, dual=True)
                                     for dt in FLOAT_DTYPES for lpr in _RESIDENT_LPR], _resident_defines(dual=True))
    reg.declare("check.cu", [f"twellpy_count_nonfinite<{c}>" for c in _NONFINITE_WORD.values()]
                + ["twellpy_nonfinite_ledger"])


# element width -> C type of the unsigned words twellpy_count_nonfinite reads
_NONFINITE_WORD = {2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}
_CHECK_BLOCK = 256
_CHECK_MAX_BLOCKS = 4096  # grid-stride: enough blocks to fill an H200 several times over


def launch_count_nonfinite(arr, count, stream):
    """Queue the NaN/Inf count of ``arr`` (contiguous cupy float) onto ``stream``.

    Adds the number of non-finite elements to ``count`` (a zeroed (1,) uint64
    cupy array, e.g. a slice of a larger counter block) without reading it
    back: the caller reads it at a synchronisation it makes anyway, so the
    check does not stall the queue (the fused FFN does this).
    """
    n = int(arr.size)
    if n == 0:
        return
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        raise ValueError("count_nonfinite needs a contiguous array")
    name, exp_mask, per_block = _nonfinite_params(arr.dtype)
    with arr.device, stream:  # launch where the data lives (a raw kernel does not check the device)
        k = reg.get_kernel("check.cu", name)
        # the kernel reads the elements as unsigned words through the same pointer
        k((min(_blocks(n, per_block), _CHECK_MAX_BLOCKS),), (_CHECK_BLOCK,),
          (arr, _i64(n), exp_mask, _i32(arr.data.ptr % 16 == 0), count))


@functools.lru_cache(maxsize=None)
def _nonfinite_params(dtype):
    """Kernel name, exponent mask and elements per block of the NaN/Inf count of ``dtype``."""
    dt = np.dtype(dtype)
    exp_mask, _ = float_bit_masks(dt)
    return (f"twellpy_count_nonfinite<{_NONFINITE_WORD[dt.itemsize]}>", np.uint64(exp_mask),
            _CHECK_BLOCK * (16 // dt.itemsize))


class RepeatedNonfiniteCheck:
    """The NaN/Inf count of one array per call, for a caller that checks arrays of one
    dtype on one device call after call (the fused FFN's ``x``).

    What does not depend on the array is prepared once: the kernel, its mask, the
    device count word (``count``, a (1,) uint64 cupy array the caller zeroes before
    each :meth:`queue`), and a ring of pinned host words with one event each. A
    decode-sized checked call is host-bound, and the general path
    (:func:`launch_count_nonfinite` and :class:`PendingCount`: views, device and
    stream contexts, lookups) cost about 40 us of host time a call
    (``benchmarks/decode_probe.py``, 2026-12-05).

    Each :meth:`queue` copies its count into the next word of the ring, so up to
    ``len(events)`` counts can be in flight: a caller that does not wait for every
    count (the FFN's decode calls) collects them later with :meth:`collect`. The
    caller keeps queues in order (one stream, or streams ordered by events), so
    copies land in the order they were queued. Construct it on the device the
    arrays live on.
    """

    __slots__ = ("_kernel", "_exp_mask", "_per_block", "_count", "_host", "_events", "_tags", "_next")

    def __init__(self, dtype, count, host, events):
        name, self._exp_mask, self._per_block = _nonfinite_params(dtype)
        self._kernel = reg.get_kernel("check.cu", name)
        self._count, self._host, self._events = count, host, list(events)
        if len(self._host) != len(self._events) or not self._events:
            raise ValueError("RepeatedNonfiniteCheck needs one pinned host word per event")
        self._tags = [None] * len(self._events)  # the tag of the count in flight in each word
        self._next = 0  # the word the next queue copies into; the oldest in flight when the ring is full

    def rebind(self, count):
        """Count into another device word from now on (the caller's workspace grew);
        copies in flight are unaffected."""
        self._count = count

    @property
    def full(self):
        """True when the next :meth:`queue` would overwrite a count not yet collected."""
        return self._tags[self._next] is not None

    @property
    def in_flight(self):
        """Number of queued counts not yet collected."""
        return sum(t is not None for t in self._tags)

    def launch(self, arr, stream, count=None):
        """Queue the count of ``arr`` (C-contiguous, this dtype and device) into ``count``
        (a (1,) uint64 cupy array; default the bound word) on ``stream``, without the copy
        to the host: a CUDA graph holds this launch, and its caller queues the copy of
        the word (``queue(None, ...)``) after each replay."""
        n = int(arr.size)
        if not n:
            return
        grid = min(_blocks(n, self._per_block), _CHECK_MAX_BLOCKS)
        args = (arr, _i64(n), self._exp_mask, _i32(arr.data.ptr % 16 == 0),
                self._count if count is None else count)
        if stream.ptr == _cp().cuda.get_current_stream().ptr:
            self._kernel((grid,), (_CHECK_BLOCK,), args)
        else:
            with stream:  # a raw kernel launches on the current stream
                self._kernel((grid,), (_CHECK_BLOCK,), args)

    def queue(self, arr, stream, tag):
        """Queue the count of ``arr`` (C-contiguous, this dtype and device) and its copy to
        the host on ``stream``; ``tag`` (not None) comes back with the count from :meth:`collect`.
        ``arr`` None queues the copy only: a kernel of the caller's has written the count
        into the device word already. The ring must not be :attr:`full` (collect with
        ``wait="oldest"`` first)."""
        if tag is None:
            raise ValueError("tag must not be None")
        if self.full:
            raise RuntimeError("the ring of NaN/Inf counts is full: collect before queueing")
        cp = _cp()
        if arr is not None:
            self.launch(arr, stream)
        rt = cp.cuda.runtime
        slot = self._next
        rt.memcpyAsync(self._host.ctypes.data + 8 * slot, self._count.data.ptr, 8, rt.memcpyDeviceToHost,
                       stream.ptr)
        self._events[slot].record(stream)
        self._tags[slot] = tag
        self._next = (slot + 1) % len(self._events)

    def collect(self, wait=None):
        """``[(tag, count), ...]`` of the counts that have landed, oldest first, each
        returned once. ``wait``: None waits for nothing (an event query per count),
        ``"oldest"`` for the oldest count in flight, ``"all"`` for every one."""
        out = []
        ring = len(self._events)
        for k in range(ring):
            slot = (self._next + k) % ring  # oldest first
            tag = self._tags[slot]
            if tag is None:
                continue
            event = self._events[slot]
            if wait == "all" or (wait == "oldest" and not out):
                event.synchronize()
            elif not event.done:
                break  # later copies were queued after this one: none of them has landed either
            out.append((tag, int(self._host[slot])))
            self._tags[slot] = None
        return out

    def __del__(self):
        # copies in flight must land before their pinned words can be freed or reused
        for event, tag in zip(getattr(self, "_events", ()), getattr(self, "_tags", ())):
            if tag is not None:
                try:
                    event.synchronize()
                except Exception:  # noqa: BLE001 - interpreter shutdown or a lost device
                    pass


class NonfiniteLedger:
    """NaN/Inf counts that CUDA graph replays publish to the host themselves.

    A checked call replayed as a graph used to queue a device-to-host copy of its
    count and record an event after each replay, and later calls queried those
    events: about 12 us a call back to back, enough to make the checked M = 128
    call slower than torch's dense FFN (0.91x, thirtieth session). Here the
    graph holds one more launch (:meth:`launch`, the one-thread
    ``twellpy_nonfinite_ledger``), which stores the call's count into a ring of
    pinned host words through their device view, stamped with the call's
    sequence number; the host then reads a word with no CUDA call at all.

    The caller calls :meth:`queue` once after every launch of a graph that holds
    :meth:`launch`, in the order the launches run on the device (one stream, or
    streams ordered by events), so the sequence numbers agree. Construct it on
    the device the counts live on.
    """

    RING = 64  # counts in flight at most; a host further ahead waits (see full)
    _SEQ_BITS, _COUNT_BITS = 24, 40
    _UNSET = np.uint64(2**64 - 1)  # a stamp no call has before 2**24 calls

    __slots__ = ("_kernel", "_host", "_ring_ptr", "_seq", "_tags", "_queued")

    def __init__(self):
        import collections

        import cupyx

        cp = _cp()
        self._kernel = reg.get_kernel("check.cu", "twellpy_nonfinite_ledger")
        self._host = cupyx.empty_pinned((self.RING,), np.uint64)
        self._host[:] = self._UNSET
        # the device's address of the pinned words (the host's one under unified addressing)
        self._ring_ptr = _i64(cp.cuda.runtime.pointerGetAttributes(self._host.ctypes.data).devicePointer)
        self._seq = cp.zeros((1,), np.uint64)
        self._tags = collections.deque()  # (sequence number, tag), oldest first
        self._queued = 0  # sequence number of the next queue

    def launch(self, count, stream):
        """Queue the publication of ``count`` (a (1,) uint64 cupy array) on ``stream``
        (the current stream; a graph capture holds it)."""
        with stream:
            self._kernel((1,), (32,), (count, self._seq, self._ring_ptr, _i32(self.RING)))

    def queue(self, tag):
        """Note that the next publication (one launch of a graph holding :meth:`launch`)
        belongs to ``tag``; the ring must not be :attr:`full`."""
        if tag is None:
            raise ValueError("tag must not be None")
        if self.full:
            raise RuntimeError("the NaN/Inf ledger is full: collect before queueing")
        self._tags.append((self._queued, tag))
        self._queued += 1

    @property
    def full(self):
        """True when the next :meth:`queue` could overwrite a count not yet collected."""
        return len(self._tags) >= self.RING

    @property
    def in_flight(self):
        """Number of queued counts not yet collected."""
        return len(self._tags)

    def _landed(self, seq):
        word = int(self._host[seq % self.RING])
        if word >> self._COUNT_BITS != seq % (1 << self._SEQ_BITS):
            return None
        return word & ((1 << self._COUNT_BITS) - 1)

    def collect(self, done=None):
        """``[(tag, count), ...]`` of the counts that have landed, oldest first, each
        returned once; no CUDA call. ``done``: an event recorded after every queued
        launch, waited for first, so that every count comes back."""
        if done is not None and self._tags:
            done.synchronize()
        out = []
        while self._tags:
            seq, tag = self._tags[0]
            n = self._landed(seq)
            if n is None:
                if done is not None:  # the launches ended, so their stores reached the host
                    raise RuntimeError(f"twellpy: NaN/Inf count {seq} did not reach the host after its "
                                       "graph ended")
                break  # later ones ran after this one: none of them has landed either
            out.append((tag, n))
            self._tags.popleft()
        return out

    def __del__(self):
        # the pinned ring may go back to the pool only when no launch still writes it
        if getattr(self, "_tags", None):
            try:
                _cp().cuda.Device(self._seq.device.id).synchronize()
            except Exception:  # noqa: BLE001 - interpreter shutdown or a lost device
                pass


class PendingHost:
    """A contiguous cupy array on its way to pinned host memory, read without
    draining the stream.

    The constructor queues a copy of ``arr`` to pinned host memory on ``stream``
    and records an event after it; :meth:`read` waits for that event only, so
    work queued on the stream after the copy (the caller's own kernels) keeps
    running. Pass ``host`` (a pinned numpy array of ``arr``'s shape and dtype)
    and ``event`` to reuse them (no allocation); they must not be shared with
    another copy still in flight. ``arr`` is held until the copy has landed.
    """

    __slots__ = ("_src", "_host", "_event", "_landed")

    def __init__(self, arr, stream, host=None, event=None):
        self._landed = True  # until the copy is queued: nothing for __del__ to wait for
        if not arr.nbytes:  # nothing to copy (an empty batch): no pinned memory, no event
            self._src, self._host, self._event = None, np.empty(arr.shape, arr.dtype), None
            return
        cp = _cp()
        if host is None:
            import cupyx

            host = cupyx.empty_pinned(arr.shape, arr.dtype)
        if event is None:
            event = cp.cuda.Event(block=False, disable_timing=True)
        cp.cuda.runtime.memcpyAsync(host.ctypes.data, arr.data.ptr, arr.nbytes, cp.cuda.runtime.memcpyDeviceToHost,
                                    stream.ptr)
        event.record(stream)
        self._src, self._host, self._event, self._landed = arr, host, event, False

    def arrived(self):
        """True once the copy has landed (a query, no wait)."""
        return self._landed or self._event.done

    def read(self):
        """The host copy (a pinned numpy array); waits for the copy, not for later work."""
        if not self._landed:
            self._event.synchronize()
            self._landed, self._src = True, None
        return self._host

    def __del__(self):
        # a pending copy must land before its pinned buffer can be reused
        # (getattr: a constructor that failed never set the slots)
        if getattr(self, "_landed", True) is False:
            try:
                self._event.synchronize()
            except Exception:  # noqa: BLE001 - interpreter shutdown or a lost device
                pass


class PendingCount(PendingHost):
    """A (1,) uint64 device counter on its way to the host (a :class:`PendingHost`
    whose :meth:`read` gives the count as an int). Pass ``host`` (a (1,) uint64
    pinned numpy array) and ``event`` to reuse them. The count is kept at the
    first read: a later copy may reuse the same pinned word."""

    __slots__ = ("_value",)

    def __init__(self, count, stream, host=None, event=None):
        self._value = None
        super().__init__(count, stream, host, event)

    def read(self):
        """The count (waits for the copy, not for work queued after it)."""
        if self._value is None:
            self._value = int(super().read()[0])
        return self._value


# one (device counter, pinned host word, event, last PendingCount) per (thread, device),
# reused by every queue_count_nonfinite: a training step allocates nothing for its check
_QUEUED_COUNTS = threading.local()


def queue_count_nonfinite(arr):
    """NaN/Inf count of a contiguous cupy float array, queued on the current stream.

    Returns a :class:`PendingCount`: its ``read()`` waits only for the count
    and what was queued before it, so a caller can queue its own kernels on
    ``arr`` first and still raise before it returns (the training backward
    checks ``dy`` this way). The thread's previous count on this device is
    read first if still unread (its buffers are reused).
    """
    cp = _cp()
    with arr.device:
        slots = getattr(_QUEUED_COUNTS, "by_device", None)
        if slots is None:
            slots = _QUEUED_COUNTS.by_device = {}
        slot = slots.get(arr.device.id)
        if slot is None:
            import cupyx

            slot = slots[arr.device.id] = [cp.empty((1,), np.uint64), cupyx.empty_pinned((1,), np.uint64),
                                           cp.cuda.Event(block=False, disable_timing=True), None]
        count, host, event, previous = slot
        if previous is not None:
            previous.read()  # its copy must land before the counter and the host word are reused
        stream = cp.cuda.get_current_stream()
        cp.cuda.runtime.memsetAsync(count.data.ptr, 0, count.nbytes, stream.ptr)
        launch_count_nonfinite(arr, count, stream)
        slot[3] = PendingCount(count, stream, host=host, event=event)
        return slot[3]


def count_nonfinite(arr):
    """Number of NaN and Inf elements of a contiguous cupy float array.

    One pass over the bits (``raw_kernels/check.cu``) instead of CuPy's
    mask, compare and reduce passes with their temporaries. Reads the count
    back, so it synchronises with the current stream like ``bool(a.any())``.
    """
    if int(arr.size) == 0:
        return 0
    return queue_count_nonfinite(arr).read()  # launch_count_nonfinite rejects a non-contiguous array


_declare_all()


# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------
def _cp():
    cp = cupy_module()
    if cp is None:  # pragma: no cover - depends on the machine
        raise RuntimeError("the CUDA backend needs CuPy: pip install 'twellpy[cuda]'")
    return cp


def _alloc(shape, dtype):
    """Output allocation (uninitialised). Tests replace it to poison outputs."""
    return _cp().empty(shape, dtype=dtype)


def _zero_fill(a):
    """Set every byte of ``a`` to 0 (+0.0 for every float dtype, 0 for ints)."""
    if a.nbytes:
        a.data.memset_async(0, a.nbytes)
    return a


def _copy(a):
    """Byte copy of a C-contiguous cupy array."""
    out = _alloc(a.shape, a.dtype)
    if a.nbytes:
        out.data.copy_from_device_async(a.data, a.nbytes)
    return out


def _i32(v):
    return np.int32(v)


def _i64(v):
    return np.int64(v)


def _blocks(n, per_block):
    return max(1, -(-int(n) // int(per_block)))


def _gridstride(n):
    return min(_blocks(n, ELEMENTWISE_BLOCK), _MAX_GRID)


def _check_int32(n, what):
    if n > _INT32_MAX:
        raise ValueError(f"{what} is {n}, which does not fit the int32 index type (max {_INT32_MAX})")


# The kernels walk a row in int column counters that may step a chunk (up to
# 2**16) past the row's end, or a whole tile past it in the last tile, before the
# bounds check; rows of at most 2**30 columns keep every such counter below 2**31.
GPU_MAX_COLUMNS = 2**30


def _check_columns(n, what="the number of columns"):
    if n > GPU_MAX_COLUMNS:
        raise ValueError(f"{what} is {n}; the GPU kernels take rows of at most 2**30 = "
                         f"{GPU_MAX_COLUMNS} columns: split the matrix into column blocks, or use "
                         f"the CPU backend (int32 columns)")


def _gpu_array(a, name, ndim=None):
    """``a`` as a C-contiguous cupy array (TypeError for host arrays)."""
    cp = _cp()
    if not isinstance(a, cp.ndarray):
        raise TypeError(f"{name} must be a cupy array for the CUDA backend, got "
                        f"{type(a).__module__}.{type(a).__name__}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {a.ndim}-D array of shape {tuple(a.shape)}")
    if a.flags.c_contiguous:
        return a
    # Copy through an unsigned view of the same width: a pure byte move that
    # works for bfloat16 whatever CuPy's bfloat16 support is.
    bits = np.dtype(f"u{a.dtype.itemsize}")
    return cp.ascontiguousarray(a.view(bits)).view(a.dtype)


def _values_array(a, name, ndim=None):
    a = _gpu_array(a, name, ndim)
    if a.dtype not in FLOAT_DTYPES:
        names = ", ".join(str(d) for d in FLOAT_DTYPES)
        raise TypeError(f"{name} has dtype {a.dtype}, expected one of {names}")
    return a


def _index_array(a, name, ndim=None, dtype=_I32):
    a = _gpu_array(a, name, ndim)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} has dtype {a.dtype}, expected an integer dtype")
    if a.dtype != dtype:
        a = a.astype(dtype)
    return a


def _positive(v, name, minimum=1):
    v = int(v)
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def _aligned(*arrays):
    return all(a.data.ptr % 16 == 0 for a in arrays)


def _accum_dtype(*dtypes):
    return np.dtype(np.float64) if any(np.dtype(d) == np.float64 for d in dtypes) else np.dtype(np.float32)


def _result_dtype(a, b):
    """Result dtype of a product: equal dtypes stay, float64 wins, else float32 (as the CPU backend)."""
    a, b = np.dtype(a), np.dtype(b)
    return a if a == b else _accum_dtype(a, b)


def _raise_if_bad(bad, message):
    n = int(bad[0])
    if n:
        raise ValueError(message.format(n=n))


# ---------------------------------------------------------------------------
# dtype conversion
# ---------------------------------------------------------------------------
def astype(x, dtype):
    """Cast a cupy array to another value dtype with one rounding step.

    Parameters
    ----------
    x : cupy.ndarray
        Any shape, dtype float16, bfloat16, float32 or float64.
    dtype : dtype-like
        Target value dtype (same set).

    Returns
    -------
    cupy.ndarray
        New array of the same shape (a copy even when the dtype is unchanged).
        Rounding is to nearest-even; float64 -> 16-bit rounds directly (no
        double rounding through float32). CuPy's own ``astype`` is not used for
        16-bit types so that bfloat16 works on every CuPy version.
    """
    x = _values_array(x, "x")
    dtype = np.dtype(dtype)
    if dtype not in FLOAT_DTYPES:
        names = ", ".join(str(d) for d in FLOAT_DTYPES)
        raise TypeError(f"dtype is {dtype}, expected one of {names}")
    if dtype == x.dtype:
        return _copy(x)
    out = _alloc(x.shape, dtype)
    n = x.size
    if n:
        k = reg.get_kernel("convert.cu", _name_cast(x.dtype, dtype))
        k((_gridstride(n),), (ELEMENTWISE_BLOCK,), (x, out, _i64(n)))
    return out


def _as_dtype(a, dtype):
    return a if a.dtype == dtype else astype(a, dtype)


# ---------------------------------------------------------------------------
# construction from dense
# ---------------------------------------------------------------------------
def _dense_vec(x, *multiples):
    """16-byte vectors when every given extent is a multiple of the vector and x is aligned."""
    vec = _vec_width(x.dtype)
    if all(int(m) % vec == 0 for m in multiples) and _aligned(x):
        return vec
    return 1


def _dense_to_twell(x, tile, slots):
    cp = _cp()
    x = _values_array(x, "x", ndim=2)
    tile = _positive(tile, "tile")
    slots = _positive(slots, "slots")
    m, n = x.shape
    _check_columns(n)
    _check_int32(m, "the number of rows")
    n_tiles = -(-n // tile) if n else 0
    values = _alloc((m, n_tiles, slots), x.dtype)
    indices = _alloc((m, n_tiles, slots), _I32)
    counts = _alloc((m, n_tiles), _I32)
    nonfinite = cp.zeros(1, _I32)
    tpw = max(1, int(CONSTRUCT_TILES_PER_WARP))
    n_groups = -(-n_tiles // tpw)
    if m == 0 or n_tiles == 0:
        return values, indices, counts, cp.zeros(m, _I32), nonfinite
    row_max = cp.zeros(m, _I32) if n_groups > 1 else _alloc(m, _I32)
    tile = min(tile, n)  # a tile wider than the row is the row (one tile; fits the int32 argument)
    vec = _dense_vec(x, n, tile)
    k = reg.get_kernel("construct.cu", _name_dense("dense_to_twell", x.dtype, vec), **CONSTRUCT_DEFINES)
    k((_blocks(m * n_groups, CONSTRUCT_WARPS),), (32 * CONSTRUCT_WARPS,),
      (x, values, indices, counts, row_max, nonfinite, _i32(m), _i32(n), _i32(tile), _i32(slots),
       _i32(n_tiles), _i32(tpw), _i32(n_groups)))
    return values, indices, counts, row_max, nonfinite


def dense_to_twell(x, tile, slots):
    """Pack a dense (M, N) cupy array into TwELL slots in one pass.

    Each warp owns a (row, group of tiles) span; slot positions are warp
    ballot/popc prefix counts (no atomics), so the result is deterministic and
    each (row, tile) is sorted by column. Padding is always written.

    Parameters
    ----------
    x : cupy.ndarray
        (M, N), any supported float dtype.
    tile, slots : int
        Tile width T and slots per (row, tile) S.

    Returns
    -------
    values : (M, ceil(N/T), S) cupy.ndarray, dtype of ``x``
    indices : (M, ceil(N/T), S) int32, global column, -1 in padding
    counts : (M, ceil(N/T)) int32, entries stored (at most S)
    row_max_count : (M,) int32, largest true tile count of each row (may be
        larger than S; such a row holds only its first S entries per tile).
    """
    return _dense_to_twell(x, tile, slots)[:4]


def dense_to_twell_finite(x, tile, slots):
    """:func:`dense_to_twell` plus a fifth result: True when ``x`` has no NaN/Inf.

    The finiteness test is fused into the same pass over ``x`` (reading the
    flag synchronises with the device).
    """
    *res, nonfinite = _dense_to_twell(x, tile, slots)
    return (*res, _not_flagged(nonfinite))


def _dense_row_nnz(x):
    cp = _cp()
    x = _values_array(x, "x", ndim=2)
    m, n = x.shape
    _check_columns(n)
    out = _alloc(m, _I32)
    nonfinite = cp.zeros(1, _I32)
    if m == 0:
        return out, nonfinite
    if n == 0:
        return _zero_fill(out), nonfinite
    vec = _dense_vec(x, n)
    k = reg.get_kernel("construct.cu", _name_dense("dense_row_nnz", x.dtype, vec))
    k((_blocks(m, CONSTRUCT_WARPS),), (32 * CONSTRUCT_WARPS,), (x, out, nonfinite, _i32(m), _i32(n)))
    return out, nonfinite


def dense_row_nnz(x):
    """Non-zeros (NaN included, -0.0 excluded) of each row of a dense (M, N) array: (M,) int32."""
    return _dense_row_nnz(x)[0]


def dense_row_nnz_finite(x):
    """:func:`dense_row_nnz` plus True when ``x`` has no NaN/Inf (same pass; synchronises)."""
    out, nonfinite = _dense_row_nnz(x)
    return out, _not_flagged(nonfinite)


def all_finite(x):
    """True when the float cupy array ``x`` holds no NaN/Inf (one pass, no temporaries)."""
    x = _values_array(x, "x")
    if x.size == 0:
        return True
    if x.ndim >= 2:
        return _not_flagged(_dense_row_nnz(x.reshape(-1, x.shape[-1]))[1])
    # 1-D: rows of 8192 (one warp each) plus the tail, so long vectors use the whole GPU
    flat, width = x.reshape(-1), 8192
    rows = flat.size // width
    parts = [flat[rows * width:].reshape(1, -1)] if flat.size % width else []
    if rows:
        parts.append(flat[:rows * width].reshape(rows, width))
    return all(_not_flagged(_dense_row_nnz(p)[1]) for p in parts)


def _not_flagged(flag):
    return not bool(int(flag[0]))


def dense_to_ell(x, width, row_nnz):
    """Pack a dense (M, N) array into ELL slots of width ``width``.

    Rows with ``row_nnz > width`` are left as padding (the caller stores them
    elsewhere). Returns ``values`` (M, width) and ``indices`` (M, width) int32.
    """
    x = _values_array(x, "x", ndim=2)
    row_nnz = _index_array(row_nnz, "row_nnz", ndim=1)
    m, n = x.shape
    width = _positive(width, "width", minimum=0)
    if row_nnz.shape[0] != m:
        raise ValueError(f"row_nnz has shape {tuple(row_nnz.shape)}, expected ({m},)")
    values = _alloc((m, width), x.dtype)
    indices = _alloc((m, width), _I32)
    if m == 0 or width == 0:
        return values, indices
    vec = _dense_vec(x, n)
    k = reg.get_kernel("construct.cu", _name_dense("dense_to_ell", x.dtype, vec))
    k((_blocks(m, CONSTRUCT_WARPS),), (32 * CONSTRUCT_WARPS,),
      (x, row_nnz, values, indices, _i32(m), _i32(n), _i32(width)))
    return values, indices


# ---------------------------------------------------------------------------
# construction from CSR (sorted, unique column indices per row)
# ---------------------------------------------------------------------------
_BAD_CSR = ("{n} CSR entries have a column index outside [0, n_cols) or not strictly "
            "increasing within their row; canonicalise the matrix first (sum_duplicates())")


def _csr_inputs(indptr, indices, data):
    indptr = _index_array(indptr, "indptr", ndim=1, dtype=_I64)
    indices = _index_array(indices, "indices", ndim=1)
    data = _values_array(data, "data", ndim=1)
    if indptr.shape[0] < 1:
        raise ValueError("indptr must have at least one element (M + 1)")
    if indices.shape[0] != data.shape[0]:
        raise ValueError(f"indices has shape {tuple(indices.shape)}, expected {tuple(data.shape)} (as data)")
    return indptr, indices, data


def csr_to_twell(indptr, indices, data, n_cols, tile, slots):
    """TwELL slots from a CSR matrix with sorted, unique column indices.

    Every entry is kept (explicit zeros included: the container drops them
    first). Returns ``values, indices, counts, row_max_count`` as
    :func:`dense_to_twell`. Raises ValueError when a column index is out of
    range or the columns of a row are not strictly increasing.
    """
    cp = _cp()
    indptr, cols, data = _csr_inputs(indptr, indices, data)
    n_cols = _positive(n_cols, "n_cols", minimum=0)
    tile = _positive(tile, "tile")
    slots = _positive(slots, "slots")
    _check_columns(n_cols)
    m = indptr.shape[0] - 1
    n_tiles = -(-n_cols // tile) if n_cols else 0
    values = _alloc((m, n_tiles, slots), data.dtype)
    out_idx = _alloc((m, n_tiles, slots), _I32)
    counts = _alloc((m, n_tiles), _I32)
    row_max = _alloc(m, _I32)
    if m == 0:
        return values, out_idx, counts, row_max
    bad = cp.zeros(1, _I32)
    k = reg.get_kernel("construct.cu", _name_t("csr_to_twell", data.dtype))
    k((_blocks(m, CONSTRUCT_WARPS),), (32 * CONSTRUCT_WARPS,),
      (indptr, cols, data, values, out_idx, counts, row_max, bad,
       _i32(m), _i32(n_cols), _i32(max(1, min(tile, n_cols))), _i32(slots), _i32(n_tiles)))
    _raise_if_bad(bad, _BAD_CSR)
    return values, out_idx, counts, row_max


def csr_to_ell(indptr, indices, data, width):
    """ELL slots of width ``width`` from a CSR matrix with sorted, unique columns.

    Rows wider than ``width`` are left as padding; ``row_nnz`` is the true
    count of every row. Returns ``values, indices, row_nnz``.
    """
    cp = _cp()
    indptr, cols, data = _csr_inputs(indptr, indices, data)
    width = _positive(width, "width", minimum=0)
    m = indptr.shape[0] - 1
    values = _alloc((m, width), data.dtype)
    out_idx = _alloc((m, width), _I32)
    row_nnz = _alloc(m, _I32)
    if m == 0:
        return values, out_idx, row_nnz
    bad = cp.zeros(1, _I32)
    k = reg.get_kernel("construct.cu", _name_t("csr_to_ell", data.dtype))
    k((_blocks(m, CONSTRUCT_WARPS),), (32 * CONSTRUCT_WARPS,),
      (indptr, cols, data, values, out_idx, row_nnz, bad, _i32(m), _i32(_INT32_MAX), _i32(width)))
    _raise_if_bad(bad, _BAD_CSR)
    return values, out_idx, row_nnz


# ---------------------------------------------------------------------------
# slot lists back to dense / CSR
# ---------------------------------------------------------------------------
def _slot_inputs(values, indices):
    values = _values_array(values, "values", ndim=2)
    indices = _index_array(indices, "indices", ndim=2)
    if indices.shape != values.shape:
        raise ValueError(f"indices has shape {tuple(indices.shape)}, expected {tuple(values.shape)} (as values)")
    return values, indices


def slots_to_dense(values, indices, n_cols):
    """Dense (M, n_cols) array from flattened slot lists (index -1 = skip)."""
    values, indices = _slot_inputs(values, indices)
    n_cols = _positive(n_cols, "n_cols", minimum=0)
    m, k_slots = values.shape
    out = _zero_fill(_alloc((m, n_cols), values.dtype))
    total = m * k_slots
    if total and n_cols:
        k = reg.get_kernel("convert.cu", _name_t("slots_to_dense", values.dtype))
        k((_gridstride(total),), (ELEMENTWISE_BLOCK,),
          (values, indices, out, _i64(m), _i32(k_slots), _i32(n_cols)))
    return out


def slots_to_csr(values, indices, row_counts):
    """CSR arrays from flattened slot lists.

    Parameters
    ----------
    values, indices : (M, K) cupy arrays, entries sorted by column in slot order.
    row_counts : (M,) int32, stored entries per row.

    Returns
    -------
    indptr : (M+1,) int32
    col : (nnz,) int32
    data : (nnz,) dtype of ``values``
    """
    cp = _cp()
    values, indices = _slot_inputs(values, indices)
    row_counts = _index_array(row_counts, "row_counts", ndim=1)
    m, k_slots = values.shape
    if row_counts.shape[0] != m:
        raise ValueError(f"row_counts has shape {tuple(row_counts.shape)}, expected ({m},)")
    indptr64 = cp.zeros(m + 1, _I64)
    if m:
        indptr64[1:] = cp.cumsum(row_counts, dtype=_I64)
    nnz = int(indptr64[-1])
    _check_int32(nnz, "the number of stored entries")
    col = _alloc(nnz, _I32)
    data = _alloc(nnz, values.dtype)
    if m:
        bad = cp.zeros(1, _I32)
        k = reg.get_kernel("convert.cu", _name_t("slots_to_csr", values.dtype))
        k((_blocks(m, CONVERT_WARPS),), (32 * CONVERT_WARPS,),
          (values, indices, indptr64, col, data, bad, _i32(m), _i32(k_slots)))
        _raise_if_bad(bad, "{n} rows hold a number of valid slots (index >= 0) that differs "
                           "from row_counts")
    return indptr64.astype(_I32), col, data


# ---------------------------------------------------------------------------
# transpose (deterministic counting sort)
# ---------------------------------------------------------------------------
def _transpose_chunks(m, n_cols):
    """(n_chunks, chunk_rows): enough row chunks to fill the GPU, within the counter budget."""
    budget = max(1, _TRANSPOSE_COUNTER_BUDGET // max(1, n_cols))
    n_chunks = max(1, min(-(-m // 16), 1024, budget))
    chunk_rows = -(-m // n_chunks)
    n_chunks = -(-m // chunk_rows)
    return n_chunks, chunk_rows


def transpose_cursor(counts, indptr):
    """Start offsets of a counting sort: ``cursor[b, c] = indptr[c] + counts[:b, c].sum()``.

    ``counts`` (blocks, N) int32 C-contiguous, ``indptr`` (N+1,) int32; one
    kernel (``twellpy_transpose_scan``) instead of an axis-0 cumsum and two
    passes over ``counts``. Used by both counting-sort transposes.
    """
    cp = _cp()
    nb, n_cols = counts.shape
    cursor = cp.empty_like(counts)
    if nb and n_cols:
        k = reg.get_kernel("transpose.cu", f"twellpy_transpose_scan<{TRANSPOSE_SCAN_SEGS}>")
        k(((n_cols + 31) // 32,), (32 * TRANSPOSE_SCAN_SEGS,), (counts, indptr, _i32(nb), _i32(n_cols), cursor))
    return cursor


def transpose_slots(values, indices, n_cols):
    """CSR arrays ``(indptr, col, data)`` of the transpose (n_cols, M).

    Deterministic counting sort: per row-chunk column histograms, a prefix sum
    over (column, chunk), then each chunk places its rows in order. Within each
    output row the entries are sorted by source row.
    """
    cp = _cp()
    values, indices = _slot_inputs(values, indices)
    n_cols = _positive(n_cols, "n_cols", minimum=0)
    m, k_slots = values.shape
    _check_int32(m, "the number of rows")
    _check_columns(n_cols)
    if m == 0 or n_cols == 0 or k_slots == 0:
        return cp.zeros(n_cols + 1, _I32), _alloc(0, _I32), _alloc(0, values.dtype)
    n_chunks, chunk_rows = _transpose_chunks(m, n_cols)
    chunk_counts = cp.zeros((n_chunks, n_cols), _I32)
    kc = reg.get_kernel("transpose.cu", "twellpy_transpose_count")
    kc((_gridstride(m * k_slots),), (ELEMENTWISE_BLOCK,),
       (indices, chunk_counts, _i64(m), _i32(k_slots), _i32(n_cols), _i32(chunk_rows)))
    indptr64 = cp.zeros(n_cols + 1, _I64)
    indptr64[1:] = cp.cumsum(chunk_counts.sum(axis=0, dtype=_I64))
    nnz = int(indptr64[-1])
    _check_int32(nnz, "the number of stored entries")
    indptr = indptr64.astype(_I32)
    cursor = transpose_cursor(chunk_counts, indptr)
    del chunk_counts
    col = _alloc(nnz, _I32)
    data = _alloc(nnz, values.dtype)
    if nnz:
        kf = reg.get_kernel("transpose.cu", _name_t("transpose_fill", values.dtype))
        kf((n_chunks,), (ELEMENTWISE_BLOCK,),
           (values, indices, cursor, col, data, _i32(m), _i32(k_slots), _i32(n_cols), _i32(chunk_rows)))
    return indptr, col, data


# ---------------------------------------------------------------------------
# sparse @ dense
# ---------------------------------------------------------------------------
def _spmm_plan(k_cols, dtype, *arrays):
    """(vec, iters, n_column_blocks) for an output with ``k_cols`` columns."""
    vec = _vec_width(dtype)
    if k_cols % vec or not _aligned(*arrays):
        vec = 1
    max_iters = max(i for i in _SPMM_ITERS if i <= max(1, int(SPMM_MAX_ITERS)))
    need = -(-k_cols // (32 * vec))
    iters = next((i for i in _SPMM_ITERS if i >= need and i <= max_iters), max_iters)
    n_cb = -(-k_cols // (32 * vec * iters))
    return vec, iters, n_cb


def _spmm_rows_plan(k_cols, dtype, *arrays):
    """(vec, nv, kb, threads, n_column_blocks) of the row-block SpMM, or None
    when the warp-per-row kernel suits the output better: fewer 16-byte
    vectors per row than the block has threads (a warp per row wastes less),
    or more column blocks than a grid dimension holds."""
    vec = _vec_width(dtype)
    if k_cols % vec or not _aligned(*arrays):
        vec = 1
    n_vec = -(-k_cols // vec)
    threads = int(_spmm_rows_defines()["SPMM_ROWS_THREADS"])  # what the kernel is compiled with
    if n_vec < threads:
        return None
    nv = 1 if n_vec <= threads else 2
    kb = max(1, int(SPMM_ROWS_INFLIGHT) // nv)
    n_cb = -(-n_vec // (threads * nv))
    if n_cb > 65535:
        return None
    return vec, nv, kb, threads, n_cb


@functools.lru_cache(maxsize=None)
def _device_limits(device_id):
    """(multiprocessors, opt-in shared memory per block in bytes) of a device."""
    rt = _cp().cuda.runtime
    return (int(rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, device_id)),
            int(rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id)))


_SMEM_OPTIN_LOCK = threading.Lock()
_SMEM_OPTIN = {}  # id(kernel) -> dynamic shared memory it is allowed (the registry keeps kernels alive)


def allow_dynamic_smem(kernel, nbytes):
    """Let ``kernel`` (a registry RawKernel of the current device, shared by every plan
    and thread) launch with ``nbytes`` of dynamic shared memory: past 48 KB a launch
    needs the kernel's attribute raised first. Only ever raised, so a plan that needs
    less never takes it from one that needs more; set once per kernel and size."""
    key = id(kernel)
    if _SMEM_OPTIN.get(key, 0) >= nbytes:
        return
    with _SMEM_OPTIN_LOCK:
        if _SMEM_OPTIN.get(key, 0) < nbytes:
            kernel.max_dynamic_shared_size_bytes = int(nbytes)
            _SMEM_OPTIN[key] = int(nbytes)


def _resident_plan(m, n_rows_b, k_cols, n_slots_per_row, dtype, *arrays, mode=None, dual=False):
    """Launch plan of ``twellpy_spmm_resident`` for an (m, n_rows_b) @ (n_rows_b, k_cols)
    product on the current device, or None when the gather kernel should run
    instead (see :func:`resident_layout` for the plan's fields). ``mode``
    ("auto", True or False) overrides ``SPMM_RESIDENT``; ``dual`` plans for two
    operands (``out = A @ B + A2 @ B2``)."""
    mode = SPMM_RESIDENT if mode is None else mode
    if mode is False or (mode == "auto" and m < RESIDENT_MIN_ROWS):
        return None
    dt = np.dtype(dtype)
    if m == 0 or n_rows_b == 0 or k_cols == 0 or k_cols % _vec_width(dt) or not _aligned(*arrays):
        return None
    if m * n_slots_per_row * (4 + dt.itemsize) > _RESIDENT_COMPACT_BUDGET:
        return None
    n_sm, limit = _device_limits(_cp().cuda.Device().id)
    stage = RESIDENT_DUAL_STAGE if dual else RESIDENT_STAGE
    return resident_layout(m, n_rows_b, k_cols, dt.itemsize, n_sm, limit,
                           int(RESIDENT_THREADS), int(stage), _RESIDENT_MIN_CHUNK_ROWS, dual=dual)


def resident_layout(m, n_rows_b, k_cols, itemsize, n_sm, smem_limit, threads, stage, min_chunk_rows, dual=False):
    """Grid and shared memory of ``twellpy_spmm_resident`` (no device needed).

    Returns ``(lpr, smem_bytes, n_slices, n_chunks, rows_per_chunk)``, or None
    when no slice fits ``smem_limit`` (or ``k_cols`` is 0). A slice is ``lpr`` 16-byte vectors
    (``lpr * 16 / itemsize`` columns) of every row of B: the widest of
    ``_RESIDENT_LPR`` whose slice plus the warps' staging areas fit, without
    being wider than needed for ``k_cols``. Row chunks give every one of the
    ``n_sm`` multiprocessors a block, as long as a chunk keeps at least
    ``min_chunk_rows`` rows (each chunk reloads its slice). ``dual``: two
    operands' slices and two values per staged entry.
    """
    if k_cols <= 0:
        return None  # no columns, no slices
    vec = 16 // itemsize
    warps = threads // 32
    nb = 2 if dual else 1
    # per warp: each row's first entry and length, then the padded stage (see the kernel)
    stage_bytes = warps * 32 * 12 + warps * (stage + 32) * (4 + nb * (8 if itemsize == 8 else 4))
    for lpr in _RESIDENT_LPR:
        if lpr > 1 and (lpr // 2) * vec >= k_cols:
            continue  # half this width already covers every column
        smem = nb * n_rows_b * lpr * 16 + stage_bytes
        if smem <= smem_limit:
            break
    else:
        return None
    n_slices = -(-k_cols // (lpr * vec))
    # a block for every SM (reloading a slice costs little), unless the chunks get
    # shorter than min_chunk_rows rows
    n_chunks = max(1, min(-(-n_sm // n_slices), m // max(1, min_chunk_rows), 65535))
    rows_per_chunk = -(-m // n_chunks)
    n_chunks = -(-m // rows_per_chunk)
    return lpr, smem, n_slices, n_chunks, rows_per_chunk


_NULL_PTR = np.uint64(0)


def _twell_compact(values, indices, counts, n_tiles, slots, n_cols_a):
    """TwELL -> compacted rows (int64 indptr, int32 cols, values) without a host
    synchronisation: the entry arrays are sized for every slot (an upper bound)."""
    cp = _cp()
    m = counts.shape[0]
    _check_int32(n_tiles * slots, "the slots of one row")
    defines = _resident_defines()
    block = 32 * int(COMPACT_WARPS)
    totals = _alloc(m + 1, _I64)
    k = reg.get_kernel("spmm_resident.cu", "twellpy_twell_row_totals", **defines)
    k((_blocks(m, int(COMPACT_WARPS)),), (block,), (counts, totals, _i32(m), _i32(n_tiles), _i32(slots)))
    indptr = cp.cumsum(totals)
    cap = max(1, m * n_tiles * slots)
    cols = _alloc(cap, _I32)
    vals = _alloc(cap, values.dtype)
    k = reg.get_kernel("spmm_resident.cu", _name_t("twell_compact", values.dtype), **defines)
    k((_blocks(m, int(COMPACT_WARPS)),), (block,),
      (values, indices, counts, indptr, cols, vals, _i32(m), _i32(n_tiles), _i32(slots), _i32(n_cols_a)))
    return indptr, cols, vals


def _resident_spmm(cols, vals, B, out, plan, indptr=None, row_count=None, stride=0, row_cap=0, vals2=None,
                   B2=None, prod=False):
    """Launch ``twellpy_spmm_resident`` (see :func:`_resident_plan`) on the current
    stream: ``out`` (C-contiguous, B's dtype) gets A @ B. A's rows are either
    compacted (``indptr`` int64) or per-row lists (``row_count`` int32: row r's
    entries start at ``r * stride``; rows whose count is outside [0, ``row_cap``]
    are left untouched). ``cols`` int32, ``vals`` of B's dtype or the
    accumulator dtype. With ``vals2`` and ``B2`` (DUAL): ``out = A @ B + A2 @ B2``,
    A2 the same pattern with ``vals2``; the plan must be made with ``dual=True``.
    With ``vals2`` and ``prod=True`` (PROD): an entry's value is ``vals * vals2``
    rounded to B's dtype (the gated training forward's h)."""
    lpr, smem, n_slices, n_chunks, rows_per_chunk = plan
    m = out.shape[0]
    n_rows_b, k_cols = B.shape
    lists = row_count is not None
    dual = vals2 is not None and not prod
    vdt = None if vals.dtype == out.dtype else vals.dtype
    name = _name_resident(out.dtype, lpr, vdt, lists=lists, dual=dual, prod=prod)
    defines = _resident_defines(dual)
    k = reg.get_kernel("spmm_resident.cu", name, **defines)
    allow_dynamic_smem(k, smem)
    k((n_slices, n_chunks), (int(RESIDENT_THREADS),),
      (_NULL_PTR if lists else indptr, row_count if lists else _NULL_PTR, _i32(stride), _i32(row_cap), cols, vals,
       B, out, _i32(m), _i32(n_rows_b), _i32(k_cols), _i32(rows_per_chunk),
       vals2 if vals2 is not None else _NULL_PTR, B2 if dual else _NULL_PTR),
      shared_mem=smem)
    return out


def _dense_operand(B, name):
    B = _values_array(B, name, ndim=2)
    _check_int32(B.shape[0], f"the number of rows of {name}")
    _check_columns(B.shape[1], f"the number of columns of {name}")
    return B


def _spmm_common(values, B):
    res = _result_dtype(values.dtype, B.dtype)
    # Kernels take one value type; mixed inputs go through the result dtype
    # (fp32 or fp64), which is exact for every supported input type.
    return res, _as_dtype(values, res), _as_dtype(B, res)


def twell_spmm(values, indices, counts, B):
    """``A @ B`` for TwELL A, reading only the stored slots (``counts``).

    Parameters
    ----------
    values, indices : (M, n_tiles, S) cupy arrays (or (M, n_tiles*S)).
    counts : (M, n_tiles) int32, stored entries per (row, tile).
    B : (N, K) cupy array, dense.

    Returns
    -------
    out : (M, K) cupy array in the promoted dtype (float32 accumulation,
        float64 for float64); the sum order is the slot order, so the result
        is deterministic.

    Notes
    -----
    With ``SPMM_RESIDENT`` on ("auto": calls of at least ``RESIDENT_MIN_ROWS``
    rows) and a B slice that fits the device's shared memory, A is compacted
    (``twellpy_twell_compact``) and ``twellpy_spmm_resident`` runs: B is read once
    per column slice instead of once per entry. Otherwise, outputs at least
    ``SPMM_ROWS_THREADS`` 16-byte vectors wide (K >= 1024 in bf16) run
    ``twellpy_twell_spmm_rows``: a block per (row, column
    block), the row's entries listed once in shared memory, each thread
    gathering its columns of the B rows with ``SPMM_ROWS_INFLIGHT`` 16-byte
    loads in flight. Narrower outputs (and ``SPMM_ROW_BLOCK = False``) run
    the warp-per-row ``twellpy_twell_spmm``. All three sum in the same order
    with the same operations and give the same bits.
    """
    values = _values_array(values, "values")
    indices = _index_array(indices, "indices")
    counts = _index_array(counts, "counts", ndim=2)
    B = _dense_operand(B, "B")
    m, n_tiles = counts.shape
    if values.ndim not in (2, 3) or values.shape[0] != m:
        raise ValueError(f"values has shape {tuple(values.shape)}, expected ({m}, {n_tiles}, S)")
    if indices.shape != values.shape:
        raise ValueError(f"indices has shape {tuple(indices.shape)}, expected {tuple(values.shape)} (as values)")
    width = values.shape[1] if values.ndim == 2 else values.shape[1] * values.shape[2]
    if n_tiles == 0:
        slots = 0
    else:
        if width % n_tiles:
            raise ValueError(f"values has {width} slots per row, not a multiple of n_tiles={n_tiles}")
        slots = width // n_tiles
    res, values, B = _spmm_common(values, B)
    n_rows_b, k_cols = B.shape
    out = _alloc((m, k_cols), res)
    if m == 0 or k_cols == 0:
        return out
    resident = _resident_plan(m, n_rows_b, k_cols, n_tiles * slots, res, B, out)
    if resident is not None:
        indptr, cols, vals = _twell_compact(values, indices, counts, n_tiles, slots, n_rows_b)
        return _resident_spmm(cols, vals, B, out, resident, indptr=indptr)
    if SPMM_ROW_BLOCK:
        plan = _spmm_rows_plan(k_cols, res, B, out)
        if plan is not None:
            vec, nv, kb, threads, n_cb = plan
            k = reg.get_kernel("spmm.cu", _name_spmm_rows(res, vec, nv, kb), **_spmm_rows_defines())
            k((min(m, _MAX_GRID), n_cb), (threads,),
              (values, indices, counts, B, out, _i32(m), _i32(n_tiles), _i32(slots), _i32(n_rows_b),
               _i32(k_cols)))
            return out
    vec, iters, n_cb = _spmm_plan(k_cols, res, B, out)
    k = reg.get_kernel("spmm.cu", _name_spmm("twell_spmm", res, vec, iters), **SPMM_DEFINES)
    k((_blocks(m * n_cb, SPMM_WARPS),), (32 * SPMM_WARPS,),
      (values, indices, counts, B, out, _i32(m), _i32(n_tiles), _i32(slots), _i32(n_rows_b),
       _i32(k_cols), _i32(n_cb)))
    return out


def slots_spmm(values, indices, B):
    """``A @ B`` for A given by flattened slot lists (M, K) and dense B (N, P).

    Accumulates in float32 (float64 when either side is float64); the result
    has the promoted dtype of ``values`` and ``B``. Deterministic.
    """
    values, indices = _slot_inputs(values, indices)
    B = _dense_operand(B, "B")
    res, values, B = _spmm_common(values, B)
    m, n_slots = values.shape
    n_rows_b, k_cols = B.shape
    out = _alloc((m, k_cols), res)
    if m == 0 or k_cols == 0:
        return out
    if n_slots == 0:
        return _zero_fill(out)
    vec, iters, n_cb = _spmm_plan(k_cols, res, B, out)
    k = reg.get_kernel("spmm.cu", _name_spmm("slots_spmm", res, vec, iters), **SPMM_DEFINES)
    k((_blocks(m * n_cb, SPMM_WARPS),), (32 * SPMM_WARPS,),
      (values, indices, B, out, _i32(m), _i32(n_slots), _i32(n_rows_b), _i32(k_cols), _i32(n_cb)))
    return out


def csr_spmm(indptr, indices, data, B):
    """``A @ B`` for CSR A (int32 ``indptr``/``indices``) and dense B (N, P).

    Entries are summed in CSR order (deterministic); the result has the
    promoted dtype of ``data`` and ``B``.
    """
    indptr = _index_array(indptr, "indptr", ndim=1)
    cols = _index_array(indices, "indices", ndim=1)
    data = _values_array(data, "data", ndim=1)
    B = _dense_operand(B, "B")
    res, data, B = _spmm_common(data, B)
    r = indptr.shape[0] - 1
    n_rows_b, k_cols = B.shape
    out = _alloc((max(r, 0), k_cols), res)
    if r <= 0 or k_cols == 0:
        return out
    vec, iters, n_cb = _spmm_plan(k_cols, res, B, out)
    k = reg.get_kernel("spmm.cu", _name_spmm("csr_spmm", res, vec, iters), **SPMM_DEFINES)
    k((_blocks(r * n_cb, SPMM_WARPS),), (32 * SPMM_WARPS,),
      (indptr, cols, data, B, out, _i32(r), _i32(n_rows_b), _i32(k_cols), _i32(n_cb)))
    return out


def slots_spmm_t(values, indices, B, n_cols):
    """``A.T @ B`` for A (M, n_cols) given by slot lists and dense B (M, P).

    Deterministic: A is transposed by a counting sort (:func:`transpose_slots`)
    and each output row gathers the rows of B in source-row order (no atomic
    float adds). Returns (n_cols, P) in the promoted dtype.
    """
    values, indices = _slot_inputs(values, indices)
    B = _dense_operand(B, "B")
    if B.shape[0] != values.shape[0]:
        raise ValueError(f"B has shape {tuple(B.shape)}, expected ({values.shape[0]}, P)")
    res = _result_dtype(values.dtype, B.dtype)
    indptr, col, data = transpose_slots(_as_dtype(values, res), indices, n_cols)
    return csr_spmm(indptr, col, data, _as_dtype(B, res))
