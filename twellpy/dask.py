"""Scale-out with Dask: row-chunked sparse arrays and distributed FFN inference.

TwELL, ELL and Hybrid store each row (each token) on its own, so a Dask array
chunked along rows only maps onto them chunk by chunk: every row chunk becomes
one container, built and used on the worker that holds it. This module is
loaded on demand (``import twellpy.dask``); ``import twellpy`` never imports
Dask.

Main entry points
-----------------
:func:`from_dask`
    Row-chunked ``dask.array.Array`` (numpy or cupy chunks) -> :class:`SparseDaskArray`.
:class:`SparseDaskArray`
    A Dask collection whose chunks are twellpy containers: ``to_dense()``,
    ``to_scipy()``, ``A @ W``, ``compute()``, ``persist()``.
:func:`gated_forward`, :func:`relu_forward`
    :func:`twellpy.ffn.gated_forward` / :func:`twellpy.ffn.relu_forward` mapped
    over the row chunks of a dask array, with the weights placed on each worker
    once (:func:`share`).

How Dask sees the containers
----------------------------
The containers' ``__array_function__`` covers only a few NumPy functions
(``np.sum``, ``np.max``, ``np.transpose``, ... on a container) and leaves calls
that involve a dask array to Dask; this module never calls a NumPy function on
them. Instead it registers, for ``TwELL``, ``ELL`` and ``Hybrid``:

* ``dask.array.core.concatenate_lookup``: row-wise concatenation that keeps
  every stored bit (used when a container-chunked dask array is computed);
* ``dask.array.core.tensordot_lookup``: ``tensordot(A, W, axes=1)`` = ``A @ W``;
* ``dask.array.register_chunk_type``: so that dask arrays defer to them.

:class:`SparseDaskArray` is itself a Dask collection (``dask.compute``,
``dask.persist`` and ``client.compute`` accept it); ``compute()`` returns one
container holding all rows.

Weights are broadcast once per worker
-------------------------------------
With a ``distributed.Client`` active, :func:`share` scatters an array to every
worker (``client.scatter(..., broadcast=True, hash=False)``) and the chunk tasks
refer to that one future. Without a client the array becomes a single graph
key on which every chunk task depends. Either way no chunk task carries its
own copy of the weights. Share weights once with :func:`share` and pass the
returned :class:`SharedArray` to reuse them across calls at no cost.
"""
from __future__ import annotations

import collections
import threading
import weakref

import numpy as np

import dask
import dask.array as da
from dask.array.core import concatenate_lookup, tensordot_lookup
from dask.array.utils import meta_from_array
from dask.base import tokenize

from ._array import FLOAT_DTYPES, accum_dtype, as_array, check_float, is_cupy, xp_of

__all__ = [
    "SparseDaskArray",
    "SharedArray",
    "from_dask",
    "share",
    "gated_forward",
    "relu_forward",
    "concatenate",
    "clear_ffn_cache",
]

FORMATS = ("twell", "ell", "hybrid")


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------
def _container_class(fmt):
    """Container class for a format name (imported lazily: workers import it too)."""
    import twellpy

    classes = {"twell": twellpy.TwELL, "ell": twellpy.ELL, "hybrid": twellpy.Hybrid}
    try:
        return classes[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}") from None


def _container_classes():
    import twellpy

    return (twellpy.TwELL, twellpy.ELL, twellpy.Hybrid)


def _active_client():
    """The current ``distributed.Client``, or None (distributed may be absent)."""
    try:
        from distributed import default_client
    except ImportError:  # pragma: no cover - distributed is optional
        return None
    try:
        return default_client()
    except ValueError:
        return None


# ----------------------------------------------------------------------------
# bfloat16 cupy arrays through distributed's serializers
# ----------------------------------------------------------------------------
# distributed serializes a cupy array by its ``__cuda_array_interface__``
# typestr, which for ml_dtypes' bfloat16 is the anonymous ``<V2``: the array
# arrives as raw 2-byte voids. The wrappers below send bfloat16 as uint16 with
# a header flag and view it back on arrival. They are installed when this
# module is imported (client and workers: chunk tasks import it) and on every
# worker of a client through a worker plugin (:func:`share`), so data that
# reaches a worker before any task runs is covered too. Chunk functions also
# repair ``<V2`` inputs (:func:`_restore_dtype`) as a last line of defence.
_BF16_FLAG = "twellpy_bfloat16"
_SERIALIZERS_LOCK = threading.Lock()
_serializers_done = False


def _install_bf16_serializers():
    """Wrap distributed's cupy serializers once per process (cheap when done)."""
    global _serializers_done
    if _serializers_done:
        return
    with _SERIALIZERS_LOCK:
        if _serializers_done:
            return
        try:
            import cupy
            import distributed.protocol.cupy  # noqa: F401 - distributed's own first, then wrap them
            from distributed.protocol.cuda import cuda_deserialize, cuda_serialize
            from distributed.protocol.serialize import dask_deserialize, dask_serialize
        except Exception:  # noqa: BLE001 - no cupy/distributed (or a broken CUDA install):
            _serializers_done = True  # nothing to wrap; chunk tasks still repair dtypes
            return
        from ._array import bfloat16

        for ser, deser in ((cuda_serialize, cuda_deserialize), (dask_serialize, dask_deserialize)):
            base_ser, base_deser = ser.dispatch(cupy.ndarray), deser.dispatch(cupy.ndarray)
            if getattr(base_ser, "_twellpy", False):
                continue

            def bf16_ser(x, _base=base_ser):
                if x.dtype != bfloat16:
                    return _base(x)
                header, frames = _base(x.view(cupy.uint16))
                header = dict(header)
                header[_BF16_FLAG] = True
                return header, frames

            def bf16_deser(header, frames, _base=base_deser):
                arr = _base(header, frames)
                return arr.view(bfloat16) if header.get(_BF16_FLAG) else arr

            bf16_ser._twellpy = bf16_deser._twellpy = True
            ser.register(cupy.ndarray, bf16_ser)
            deser.register(cupy.ndarray, bf16_deser)
        # set last: another thread passing the unlocked check must see wrapped serializers
        _serializers_done = True


def _dtype_named(name):
    """numpy dtype from its name; ``"bfloat16"`` is ml_dtypes' (dtype objects of
    ml_dtypes do not survive every transport, names do)."""
    if name == "bfloat16":
        from ._array import bfloat16
        return np.dtype(bfloat16)
    return np.dtype(name)


def _restore_dtype(arr, dtype):
    """``arr`` viewed as ``dtype`` when transport turned it into same-size raw voids."""
    if is_cupy(arr):  # this worker may send cupy results on: wrap its serializers
        _install_bf16_serializers()
    dtype = np.dtype(dtype)
    got = getattr(arr, "dtype", None)
    if got is None or got == dtype or got.itemsize != dtype.itemsize:
        return arr
    # raw voids (no wrapper on the sender) or the uint16 carrier (wrapper on the
    # sender only); the graph promised ``dtype``, so the bits are that dtype's
    # (only *anonymous* voids: ml_dtypes' bfloat16 is kind "V" too, and a real
    # bfloat16 where float16 was promised must stay a visible mismatch)
    raw_voids = got.type is np.void and got.fields is None
    if raw_voids or (dtype.name == "bfloat16" and got == np.uint16):
        return arr.view(dtype)
    return arr


def _serializer_plugin_class():
    # built on demand (distributed is imported only by users of cupy data)
    from distributed import WorkerPlugin

    class TwellpyBf16SerializerPlugin(WorkerPlugin):
        """Installs twellpy's bfloat16 cupy serializers on every worker."""

        name = "twellpy-bf16-serializers"

        def setup(self, worker):
            from twellpy.dask import _install_bf16_serializers

            _install_bf16_serializers()

    return TwellpyBf16SerializerPlugin


_PLUGIN_CLIENTS = weakref.WeakSet()  # not ids: a new client can reuse a closed one's id


def _ensure_worker_serializers(client):
    """Register the serializer plugin once per client (idempotent, cheap)."""
    if client in _PLUGIN_CLIENTS:
        return
    try:
        client.register_plugin(_serializer_plugin_class()(), name="twellpy-bf16-serializers")
    except Exception as exc:  # noqa: BLE001 - chunk tasks still repair dtypes
        import warnings
        warnings.warn(f"twellpy.dask: could not register the bfloat16 serializer plugin "
                      f"({type(exc).__name__}: {exc}); chunk tasks repair dtypes instead",
                      RuntimeWarning, stacklevel=3)
        return
    _PLUGIN_CLIENTS.add(client)


def _prepare_cupy_transport(client=None):
    """Entry points with cupy data: wrap the serializers here and on the workers."""
    _install_bf16_serializers()
    client = client if client not in (None, False) else _active_client()
    if client is not None:
        _ensure_worker_serializers(client)


def _check_row_chunked(x, name, rechunk):
    """Validate a 2-D dask array and give it a single column chunk."""
    if not isinstance(x, da.Array):
        raise TypeError(
            f"{name} must be a dask.array.Array, got {type(x).__module__}.{type(x).__name__}; "
            f"wrap an in-memory array with dask.array.from_array({name}, chunks=(rows_per_chunk, -1))")
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got {x.ndim}-D dask array of shape {x.shape}")
    if any(isinstance(c, float) and np.isnan(c) for c in x.chunks[0]) or np.isnan(x.shape[1]):
        raise ValueError(f"{name} has unknown chunk sizes {x.chunks}; call "
                         f"{name}.compute_chunk_sizes() first")
    if x.numblocks[1] != 1:
        if not rechunk:
            raise ValueError(
                f"{name} has {x.numblocks[1]} column chunks {x.chunks[1]}, expected 1 (a row holds "
                f"one token and must live in one chunk); rechunk with {name}.rechunk({{1: -1}}) "
                f"or pass rechunk=True")
        x = x.rechunk({1: -1})
    return x


def _array_meta(x, dtype):
    """Zero-size array of the same kind (numpy/cupy) as ``x``'s chunks."""
    return meta_from_array(x._meta, ndim=2, dtype=dtype)


# ----------------------------------------------------------------------------
# row-wise concatenation of containers (registered with dask)
# ----------------------------------------------------------------------------
def concatenate(parts, axis=0):
    """Concatenate twellpy containers along rows, keeping every stored entry.

    Dask's concatenation of container chunks: :func:`twellpy.vstack`, except
    that a single part is returned unchanged for any axis (Dask asks for that).

    Parameters
    ----------
    parts : sequence of TwELL, ELL or Hybrid
        Containers of one format, one dtype, one device and one column count
        (and, for TwELL, one tile size).
    axis : int
        Must be 0 (or -2): containers are row chunks.

    Returns
    -------
    TwELL, ELL or Hybrid
        The rows of all parts, in order (see :func:`twellpy.vstack`).
    """
    from ._stack import vstack

    parts = list(parts)
    if not parts:
        raise ValueError("parts is empty; need at least one container to concatenate")
    if len(parts) == 1:
        return parts[0]
    if axis not in (0, -2):
        raise ValueError(f"axis must be 0 (row chunks), got {axis!r}")
    return vstack(parts)


def _product_dtype(a, b):
    """Dtype of ``container @ dense`` (the containers' own promotion rule)."""
    from ._base import result_dtype

    return result_dtype(a, b)


def _tensordot(a, b, axes=2):
    """``tensordot_lookup`` entry: a container times a dense matrix over one axis."""
    if axes not in (1, ((1,), (0,)), [[1], [0]], ((1,), [0]), ([1], (0,))):
        raise ValueError(f"twellpy containers support tensordot(A, W, axes=1) (= A @ W) only, "
                         f"got axes={axes!r}")
    return a @ b


_registered = False
_clients_with_plugin = set()


def _register():
    """Teach this process's Dask about the container classes (idempotent)."""
    global _registered
    if not _registered:
        classes = _container_classes()
        concatenate_lookup.register(classes, concatenate)
        tensordot_lookup.register(classes, _tensordot)
        for cls in classes:
            da.register_chunk_type(cls)
        _registered = True


def _worker_plugin_class():
    from distributed import WorkerPlugin

    class TwellpyDaskPlugin(WorkerPlugin):
        """Imports twellpy.dask on every worker (also restarted ones).

        Dask's own tasks (e.g. the ``finalize`` of a container-chunked dask
        array) may run on a worker that unpickled containers but never
        imported this module, so its dispatch registrations would be missing.
        """

        name = "twellpy-dask"

        def setup(self, worker):
            import twellpy.dask  # noqa: F401  (registers at import)

    return TwellpyDaskPlugin


def _register_on_workers(client=None):
    """Register the import plugin with the active distributed client, once per client.

    Called from the public entry points, never at import: with in-process
    workers (``processes=False``) the plugin's import would wait for an import
    of this module still in progress.
    """
    client = client or _active_client()
    if client is None or client.id in _clients_with_plugin:
        return
    client.register_plugin(_worker_plugin_class()(), name="twellpy-dask")
    _clients_with_plugin.add(client.id)


# ----------------------------------------------------------------------------
# shared (broadcast) arrays
# ----------------------------------------------------------------------------
class SharedArray:
    """A dense array placed once for all chunk tasks (see :func:`share`).

    Attributes
    ----------
    ref : distributed.Future or dask.delayed.Delayed
        The handle that chunk tasks depend on.
    shape : tuple of int
    dtype : numpy.dtype
    array_type : str
        ``"numpy"`` or ``"cupy"``: where the array lives on the workers.
    """

    def __init__(self, ref, shape, dtype, array_type, token=None):
        self.ref = ref
        #: Content token used to name outputs deterministically (the scatter key
        #: itself is unique per share() call).
        self.token = token if token is not None else getattr(ref, "key", None)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.array_type = array_type

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def key(self):
        """The graph key (or future key) chunk tasks depend on."""
        return self.ref.key

    def __repr__(self):
        where = type(self.ref).__name__
        return (f"<SharedArray {self.array_type} shape={self.shape} dtype={self.dtype} "
                f"via {where} {self.key!r}>")


def share(array, name="array", *, client=None, broadcast=True):
    """Place a dense array once, for use by many chunk tasks.

    Parameters
    ----------
    array : array_like or SharedArray
        numpy or cupy array (or torch/jax/DLPack, converted by
        :func:`twellpy._array.as_array`). A :class:`SharedArray` is returned
        unchanged.
    name : str
        Argument name used in error messages.
    client : distributed.Client or False, optional
        Client to scatter to. Defaults to the active client, if any;
        ``False`` never scatters (one graph key, even under a client).
    broadcast : bool
        With a client: copy the array to every worker now (True), or to one
        worker, from which the others fetch it on first use (False). Either
        way each worker receives it at most once.

    Returns
    -------
    SharedArray
        Wraps a ``distributed.Future`` when a client is active (each call gets
        its own key: a content-hashed key would be shared with futures of
        earlier calls, and releasing those could delete the data under a
        running computation), else a
        ``dask.delayed`` object: one graph key that every chunk task depends on.
    """
    if isinstance(array, SharedArray):
        return array
    arr, _ = as_array(array, name)
    kind = "cupy" if is_cupy(arr) else "numpy"
    if client is None:
        client = _active_client()
    # numpy data are hashed by content (dask's tokenize); cupy data have no
    # content token in dask, so their outputs are named by the unique key.
    token = tokenize(arr) if kind == "numpy" else None
    if client is not False and client is not None:
        if kind == "cupy":
            _prepare_cupy_transport(client)
        ref = client.scatter(arr, broadcast=broadcast, hash=False)
    else:
        ref = dask.delayed(arr, pure=True, traverse=False)
    return SharedArray(ref, arr.shape, arr.dtype, kind, token=token)


class _Local:
    """Shape/dtype/kind of an array not yet shared (validation before scattering)."""

    def __init__(self, arr):
        self.arr = arr
        self.shape = tuple(arr.shape)
        self.ndim = arr.ndim
        self.dtype = arr.dtype
        self.array_type = "cupy" if is_cupy(arr) else "numpy"


def _describe(array, name):
    """SharedArray as is; anything else converted to numpy/cupy, not yet shared."""
    if isinstance(array, SharedArray):
        return array
    arr, _ = as_array(array, name)
    return _Local(arr)


def _share_described(desc, name, client, broadcast):
    if isinstance(desc, SharedArray):
        return desc
    return share(desc.arr, name, client=client, broadcast=broadcast)


def _token(x, shared, kind, kwargs):
    """Deterministic output token: input name, weight keys, operation, options.

    (Futures do not tokenize by key, so identical calls would otherwise get
    fresh names; numpy weights are named by a content hash, see :func:`share`.)
    """
    return tokenize(x.name, [w.token for w in shared], kind, sorted(kwargs.items()))


# ----------------------------------------------------------------------------
# chunk functions (module level so that workers import them by name)
# ----------------------------------------------------------------------------
def _build_chunk(block, fmt, params, in_dtype=None):
    if in_dtype is not None:
        block = _restore_dtype(block, _dtype_named(in_dtype))
    return _container_class(fmt).from_dense(block, **params)


def _to_dense_chunk(chunk):
    return chunk.toarray()


def _to_scipy_chunk(chunk, fmt):
    return chunk.to_scipy(fmt)


def _reduce_chunk(chunk, op, axis):
    """``chunk.sum(axis)`` or ``chunk.count_nonzero(axis)``; per-column results
    get a leading axis of length 1 (one row per chunk, summed by dask)."""
    out = getattr(chunk, op)(axis=axis)
    return out[None, :] if axis == 0 else out


def _matmul_chunk(chunk, w, w_dtype=None):
    if w_dtype is not None:
        w = _restore_dtype(w, _dtype_named(w_dtype))
    return chunk @ w


# Prepared FFN objects (weights transposed, kernels and workspaces ready), one
# per (thread, weight set, options) on each worker. The weight arrays a worker
# holds for a shared key are the same Python objects for every task, so their
# ids identify the weight set; strong references are kept next to the ids so
# an id cannot be reused while its entry lives. Per thread, because a plan's
# workspaces are not meant to be used by two threads at once.
_FFN_CACHES = {}  # thread id -> OrderedDict (an LRU per thread: threads must not evict each other)
_FFN_CACHE_SIZE = 4
_FFN_CACHE_LOCK = threading.Lock()


def clear_ffn_cache():
    """Drop the prepared FFN objects (and the weights they keep) of this process.

    Run it on every worker with ``client.run(twellpy.dask.clear_ffn_cache)``.
    """
    with _FFN_CACHE_LOCK:
        _FFN_CACHES.clear()


def _prepared_ffn(kind, weights, ffn_kwargs, in_dtype=None, weight_keys=None):
    from . import ffn

    # Keyed by the weights' graph keys when the task names them: a key always
    # means the same data, and distributed's Active Memory Manager drops idle
    # replicas of broadcast weights, so a worker may receive a weight again as
    # a new object; its prepared FFN must still be found. Else keyed by the
    # objects as the worker holds them (a dtype repair, _restore_dtype, makes a
    # new view per call, which must not miss the cache either).
    ids = tuple(weight_keys) if weight_keys is not None else tuple(id(w) for w in weights)
    key = (kind, ids, tuple(sorted(ffn_kwargs.items())), in_dtype)
    with _FFN_CACHE_LOCK:
        cache = _FFN_CACHES.setdefault(threading.get_ident(), collections.OrderedDict())
        hit = cache.get(key)
        if hit is not None:
            cache.move_to_end(key)
            return hit[1]
    if in_dtype is not None:
        dt = _dtype_named(in_dtype)
        weights_ok = tuple(_restore_dtype(w, dt) for w in weights)
    else:
        weights_ok = weights
    cls = ffn.GatedFFN if kind == "gated" else ffn.ReluFFN
    prepared = cls(*weights_ok, **ffn_kwargs)
    with _FFN_CACHE_LOCK:
        cache = _FFN_CACHES.setdefault(threading.get_ident(), collections.OrderedDict())
        cache[key] = (weights, prepared)
        while len(cache) > _FFN_CACHE_SIZE:
            cache.popitem(last=False)
    return prepared


def _ffn_chunk(block, *weights, kind, ffn_kwargs, in_dtype=None, weight_keys=None):
    if in_dtype is not None:
        block = _restore_dtype(block, _dtype_named(in_dtype))
    ffn = _prepared_ffn(kind, weights, ffn_kwargs, in_dtype, weight_keys)
    # a task's NaN/Inf must fail that task: a deferred check would land in another task, or none
    return _settled(ffn(block, check_finite="sync" if ffn.check_finite else False))


def _settled(y):
    """``y`` safe to hand to Dask, which may read it from another thread.

    A GPU FFN call returns before its kernels finish. On CuPy's legacy default
    stream, which every thread shares, any later reader is ordered after them,
    so the task returns at once and the worker's bookkeeping overlaps the GPU
    work. On any other stream (per-thread default streams, a stream the caller
    made current) a reader on another thread is not ordered: wait for it here.
    """
    if is_cupy(y):
        import cupy

        stream = cupy.cuda.get_current_stream()
        if stream.ptr != 0:
            stream.synchronize()
    return y


def _finalize(results):
    """``__dask_postcompute__`` of SparseDaskArray: nested chunk list -> one container."""
    flat = [r[0] if isinstance(r, (list, tuple)) else r for r in results]
    return concatenate(flat, axis=0)


# ----------------------------------------------------------------------------
# the collection
# ----------------------------------------------------------------------------
class SparseDaskArray:
    """A Dask collection of row-chunked twellpy containers.

    Build it with :func:`from_dask`. Every chunk is a ``TwELL``, ``ELL`` or
    ``Hybrid`` container holding consecutive rows and all columns.

    Attributes
    ----------
    blocks : dask.array.Array
        The underlying dask array whose chunks are containers (chunks
        ``(row_chunks, (N,))``); its ``_meta`` is a zero-row container.
    format : str
        ``"twell"``, ``"ell"`` or ``"hybrid"``.
    params : dict
        Construction parameters passed to ``from_dense`` for every chunk.
    shape, dtype, chunks, numblocks, npartitions
        As for a dask array.
    """

    # ``ndarray @ A`` and ``dask_array @ A`` must reach __rmatmul__ (a clear
    # error) instead of building a graph that fails at compute time: numpy
    # and dask both defer to an operand whose __array_ufunc__ is None (NEP 13);
    # cupy looks at the priority.
    __array_ufunc__ = None
    __array_priority__ = 100.0

    def __init__(self, blocks, fmt, params, array_meta):
        _register()
        _register_on_workers()
        self.blocks = blocks
        self.format = fmt
        self.params = dict(params)
        # numpy or cupy zero-size array: the chunk kind of to_dense() and A @ W
        self._array_meta = array_meta
        self._meta = None
        try:
            # A zero-row container describes the chunks. Dask's meta_from_array
            # would turn it into a numpy array (it slices columns, which
            # containers refuse), so it is set on the dask array directly.
            empty = xp_of(array_meta).zeros((0, blocks.shape[1]), dtype=array_meta.dtype)
            self._meta = _container_class(fmt).from_dense(empty, **self.params)
            blocks._meta = self._meta
        except Exception:  # pragma: no cover - a backend without M = 0 support
            self._meta = None

    # ---- array-like attributes --------------------------------------------
    @property
    def shape(self):
        return self.blocks.shape

    @property
    def dtype(self):
        return np.dtype(self._array_meta.dtype)

    @property
    def ndim(self):
        return 2

    @property
    def chunks(self):
        return self.blocks.chunks

    @property
    def numblocks(self):
        return self.blocks.numblocks

    @property
    def npartitions(self):
        return self.blocks.numblocks[0]

    @property
    def name(self):
        return self.blocks.name

    def __repr__(self):
        kind = type(self._array_meta).__module__.split(".")[0]
        return (f"<SparseDaskArray format={self.format!r} shape={self.shape} dtype={self.dtype} "
                f"row_chunks={self.chunks[0]} chunk_type={kind}>")

    # ---- Dask collection protocol ------------------------------------------
    def __dask_graph__(self):
        return self.blocks.__dask_graph__()

    def __dask_keys__(self):
        return self.blocks.__dask_keys__()

    def __dask_layers__(self):
        return self.blocks.__dask_layers__()

    def __dask_tokenize__(self):
        return (type(self).__name__, self.blocks.name, self.format)

    __dask_optimize__ = staticmethod(da.Array.__dask_optimize__)
    __dask_scheduler__ = staticmethod(da.Array.__dask_scheduler__)

    def __dask_postcompute__(self):
        return _finalize, ()

    def __dask_postpersist__(self):
        rebuild, state = self.blocks.__dask_postpersist__()
        return self._rebuild, (rebuild, state)

    def _rebuild(self, dsk, rebuild, state, rename=None):
        blocks = rebuild(dsk, *state, rename=rename) if rename else rebuild(dsk, *state)
        return SparseDaskArray(blocks, self.format, self.params, self._array_meta)

    def compute(self, **kwargs):
        """Compute all chunks and return one container with every row.

        Keyword arguments go to :func:`dask.compute`.
        """
        (result,) = dask.compute(self, **kwargs)
        return result

    def persist(self, **kwargs):
        """Build the chunk containers now and keep them in (worker) memory."""
        (result,) = dask.persist(self, **kwargs)
        return result

    # ---- conversions -------------------------------------------------------
    def to_delayed(self):
        """List of ``dask.delayed`` objects, one container per row chunk."""
        return [row[0] for row in self.blocks.to_delayed().tolist()]

    def to_dense(self):
        """Dense dask array (numpy or cupy chunks, as the input had).

        Returns
        -------
        dask.array.Array
            Same shape, chunks and dtype; every chunk is ``chunk.toarray()``.
        """
        return self.blocks.map_blocks(_to_dense_chunk, dtype=self.dtype,
                                      meta=self._array_meta, token="twellpy-to-dense")

    def to_scipy(self, fmt="csr"):
        """One scipy.sparse matrix per row chunk, lazily.

        Parameters
        ----------
        fmt : str
            scipy.sparse format passed to each container's ``to_scipy``.

        Returns
        -------
        list of dask.delayed.Delayed
            ``dask.compute(*A.to_scipy())`` gives the scipy matrices, whose
            ``scipy.sparse.vstack`` is the whole matrix.
        """
        if not isinstance(fmt, str):
            raise TypeError(f"fmt must be a scipy.sparse format name, got {type(fmt).__name__}")
        to_scipy = dask.delayed(_to_scipy_chunk, pure=True)
        return [to_scipy(d, fmt) for d in self.to_delayed()]

    # ---- row slices --------------------------------------------------------
    def __getitem__(self, key):
        """Rows of the collection by a slice, lazily.

        Parameters
        ----------
        key : slice
            ``A[a:b]``, ``A[a:b:k]`` (negative steps too), or with every column
            ``A[a:b, :]``.

        Returns
        -------
        SparseDaskArray
            Same format and parameters; each chunk is the row selection of a
            container chunk (:meth:`twellpy.SparseArray.__getitem__`), so the
            entries keep their bits.

        Raises
        ------
        TypeError
            A key that is not a row slice (an int, an index array, a mask, a
            column selection): compute the collection, or the slice, and index
            the container.
        """
        from ._base import whole_rows_key

        key = whole_rows_key(key, self.shape[1], type(self).__name__)
        if not isinstance(key, slice):
            raise TypeError(f"SparseDaskArray rows are selected by a slice (A[a:b] or A[a:b:k]), got "
                            f"{type(key).__name__}; for index arrays or masks index a computed container")
        return SparseDaskArray(self.blocks[key, :], self.format, self.params, self._array_meta)

    # ---- reductions --------------------------------------------------------
    def _reduce(self, op, axis, dtype):
        from ._base import reduction_axis

        axis = reduction_axis(axis, type(self).__name__)
        xp = xp_of(self._array_meta)
        meta = xp.zeros(0, dtype=dtype)
        if axis == 1 or axis is None:
            rows = self.blocks.map_blocks(_reduce_chunk, op, 1, dtype=dtype, drop_axis=1, meta=meta,
                                          token=f"twellpy-{op}-rows")
            if axis == 1:
                return rows
            # one number: the row results summed in float64 (ints for counts), as a container does
            return rows.sum(dtype=np.float64 if dtype.kind == "f" else np.int64)
        per_chunk = self.blocks.map_blocks(_reduce_chunk, op, 0, dtype=dtype,
                                           chunks=((1,) * self.numblocks[0], (self.shape[1],)),
                                           meta=xp.zeros((0, 0), dtype=dtype), token=f"twellpy-{op}-cols")
        return per_chunk.sum(axis=0, dtype=dtype)

    def sum(self, axis=None):
        """Lazy sum of the values (:meth:`twellpy.SparseArray.sum` per chunk).

        Parameters
        ----------
        axis : None, 0 or 1
            ``1``: per row, a dask array (M,) chunked like the rows; ``0``: per
            column, (N,), the chunks' sums added; ``None``: a 0-d dask array.

        Returns
        -------
        dask.array.Array
            ``axis`` 0 or 1: float32 (float64 for float64 data). ``axis=None``:
            a 0-d float64 array, the row sums added in float64 (the container's
            ``sum()`` likewise returns a Python float). The chunks are combined
            in a fixed order, so the same bits every run.
        """
        return self._reduce("sum", axis, accum_dtype(self.dtype))

    def mean(self, axis=None):
        """Lazy mean: :meth:`sum` divided by the number of elements along ``axis``.

        Returns
        -------
        dask.array.Array
            ``axis`` 0 or 1: float32 (float64 for float64 data), like
            :meth:`twellpy.SparseArray.mean`; ``axis=None``: 0-d float64, as
            :meth:`sum`.
        """
        from ._base import reduction_axis

        axis = reduction_axis(axis, type(self).__name__)
        m, n = self.shape
        total = self.sum(axis=axis)
        count = m * n if axis is None else (m if axis == 0 else n)
        return total / (total.dtype.type(count) if axis is not None else count)

    def count_nonzero(self, axis=None):
        """Lazy non-zero counts (:meth:`twellpy.SparseArray.count_nonzero` per chunk).

        Parameters
        ----------
        axis : None, 0 or 1
            ``0``: how often each column (neuron) fires over every row (token)
            of the collection, (N,); ``1``: per row, (M,); ``None``: 0-d.

        Returns
        -------
        dask.array.Array
            int64.
        """
        return self._reduce("count_nonzero", axis, np.dtype(np.int64))

    # ---- products ----------------------------------------------------------
    def matmul(self, w, *, client=None, broadcast=True):
        """``A @ w`` for a dense ``w`` of shape (N, K), chunk by chunk.

        Parameters
        ----------
        w : array_like or SharedArray
            Dense (N, K) numpy or cupy array, of the same kind as the chunks.
            It is placed once (see :func:`share`), not copied into each task.
        client : distributed.Client, optional
            Client used to scatter ``w``; defaults to the active one.
        broadcast : bool
            Passed to :func:`share`.

        Returns
        -------
        dask.array.Array
            Shape (M, K), chunks ``(row_chunks, (K,))``.
        """
        _check_matmul_operand(w)
        w = _describe(w, "w")
        if w.ndim != 2:
            raise ValueError(f"w must be 2-D, got {w.ndim}-D array of shape {w.shape}")
        if w.shape[0] != self.shape[1]:
            raise ValueError(f"w has shape {w.shape}, expected ({self.shape[1]}, K) to match "
                             f"A of shape {self.shape}")
        check_float(w, "w", allowed=FLOAT_DTYPES)
        chunk_kind = "cupy" if is_cupy(self._array_meta) else "numpy"
        if w.array_type != chunk_kind:
            raise ValueError(f"w is a {w.array_type} array but A has {chunk_kind} chunks; "
                             f"put w where the chunks are")
        dtype = _product_dtype(self.dtype, w.dtype)
        w = _share_described(w, "w", client, broadcast)
        return self.blocks.map_blocks(
            _matmul_chunk, w.ref, np.dtype(w.dtype).name, dtype=dtype, chunks=(self.chunks[0], (w.shape[1],)),
            meta=meta_from_array(self._array_meta, ndim=2, dtype=dtype),
            name=f"twellpy-matmul-{_token(self.blocks, [w], 'matmul', {})}")

    def __matmul__(self, w):
        return self.matmul(w)

    def __rmatmul__(self, w):
        raise TypeError(f"{type(w).__module__.split('.')[0]}.{type(w).__name__} @ SparseDaskArray is not "
                        f"supported: twellpy.dask computes A @ w with the sparse A on the left and w a "
                        f"numpy/cupy array or a SharedArray; for W @ A compute A first (A.compute() is "
                        f"one container, which supports W @ A)")


def _check_matmul_operand(w):
    """Reject right operands of ``A @ w`` that have no chunk-wise meaning, with a
    message naming what works (dask would otherwise fail inside the graph)."""
    if isinstance(w, SparseDaskArray):
        raise TypeError("SparseDaskArray @ SparseDaskArray is not supported; w must be a dense "
                        "numpy/cupy array or a SharedArray")
    if isinstance(w, da.Array):
        raise TypeError("w is a dask array; SparseDaskArray @ w needs w as one numpy/cupy array or "
                        "a SharedArray (twellpy.dask.share): compute it first (w.compute()), every "
                        "chunk task uses all of w")


def from_dask(x, format="twell", *, rechunk=True, **params):
    """Turn a row-chunked dask array into a :class:`SparseDaskArray`.

    Parameters
    ----------
    x : dask.array.Array
        2-D, float16/bfloat16/float32/float64, numpy or cupy chunks. Chunks
        must span all columns: with ``rechunk=True`` (default) columns are
        rechunked to one chunk (``x.rechunk({1: -1})``, which moves data),
        with ``rechunk=False`` several column chunks raise ``ValueError``.
        Row chunks may have any sizes (they need not divide M).
    format : {"twell", "ell", "hybrid"}
        Container format of every chunk.
    rechunk : bool
        See ``x``.
    **params
        Passed to ``from_dense`` of the format for every chunk (e.g.
        ``tile``, ``slots``, ``overflow``, ``width``, ``check_finite``).
        They are validated now, on a zero-row array, so a bad parameter
        raises here rather than inside a worker.

    Returns
    -------
    SparseDaskArray
        Lazy; chunks are built on the workers when computed or persisted.

    Notes
    -----
    Per-chunk choices that depend on the data (ELL/Hybrid width, TwELL
    backup rows) are made per chunk; :func:`concatenate` pads them so the
    computed whole holds exactly the same matrix.
    """
    _register()
    cls = _container_class(format)
    x = _check_row_chunked(x, "x", rechunk)
    check_float(x, "x")
    array_meta = _array_meta(x, x.dtype)
    if is_cupy(array_meta):
        _prepare_cupy_transport()
    # Validate parameters locally (TypeError for unknown names, ValueError for bad values).
    cls.from_dense(np.zeros((0, x.shape[1]), dtype=x.dtype), **params)
    blocks = x.map_blocks(_build_chunk, format, params, np.dtype(x.dtype).name, dtype=x.dtype, meta=array_meta,
                          token=f"twellpy-from-dask-{format}")
    return SparseDaskArray(blocks, format, params, array_meta)


# ----------------------------------------------------------------------------
# distributed FFN inference
# ----------------------------------------------------------------------------
# keyword arguments of GatedFFN/ReluFFN (applied once per worker) and of their call
_FFN_INIT_KWARGS = ("tile", "slots", "mode", "check_finite")


def _chunk_futures(x):
    """``{key: Future}`` for every chunk of ``x`` when ``x`` is persisted (its
    graph holds futures for all of its keys), else None."""
    try:
        from distributed import futures_of
    except ImportError:  # pragma: no cover - distributed is optional
        return None
    futs = {f.key: f for f in futures_of(x)}
    keys = [k for row in x.__dask_keys__() for k in row]
    if not keys or any(k not in futs for k in keys):
        return None
    return {k: futs[k] for k in keys}


def _weight_keys(shared):
    """Graph keys of the shared weights, as strings (names the prepared FFN)."""
    return tuple(str(w.key) for w in shared)


def _submit_chunks(kind, x, shared, client, name, ffn_kwargs, dtype, out_cols):
    """The FFN of every row chunk of ``x``, submitted now as one task each.

    ``x`` is persisted first when it is not already. ``client.submit`` per
    chunk skips the collection machinery of ``persist`` (graph expression,
    optimisation, materialisation), which costs milliseconds per call: the
    latency that dominates a stream of batches of a few milliseconds each.
    """
    if client is None:
        client = _active_client()
    if client is None or client is False:
        raise ValueError("persist=True needs a distributed.Client (pass client= or create one); "
                         "got none")
    futs = _chunk_futures(x)
    if futs is None:
        x = client.persist(x)
        futs = _chunk_futures(x)
    refs = [w.ref for w in shared]
    try:
        from distributed import Future
    except ImportError:  # pragma: no cover - checked by _active_client already
        Future = ()
    if not all(isinstance(r, Future) for r in refs):
        raise ValueError("persist=True needs weights shared through a client (twellpy.dask.share with "
                         "a client); got a weight built with client=False")
    out = {}
    for i, key in enumerate(futs):
        out_key = (name, i, 0)
        out[out_key] = client.submit(_ffn_chunk, futs[key], *refs, kind=kind, ffn_kwargs=dict(ffn_kwargs),
                                     in_dtype=dtype.name, weight_keys=_weight_keys(shared), key=out_key,
                                     pure=False)
    return da.Array(out, name, chunks=(x.chunks[0], (out_cols,)), dtype=dtype, meta=_array_meta(x, dtype))


def _ffn(kind, x, weights, client, broadcast, rechunk, out_name, ffn_kwargs, persist=False):
    if not isinstance(persist, bool):
        raise TypeError(f"persist must be a bool, got {persist!r}")
    if "return_activations" in ffn_kwargs:
        raise ValueError("return_activations is not supported by twellpy.dask; the result is "
                         "the dense FFN output only")
    unknown = sorted(set(ffn_kwargs) - set(_FFN_INIT_KWARGS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                        f"expected {', '.join(_FFN_INIT_KWARGS)}")
    _check_ffn_kwargs(ffn_kwargs)
    x = _check_row_chunked(x, "x", rechunk)
    check_float(x, "x")
    named = [(arg, _describe(w, arg)) for arg, w in weights]
    for arg, w in named:
        if w.ndim != 2:
            raise ValueError(f"{arg} must be 2-D, got {w.ndim}-D array of shape {w.shape}")
        check_float(w, arg)
    d_model = x.shape[1]
    if kind == "gated":
        (_, w_gate), (_, w_up), (_, w_down) = named
        hidden = w_up.shape[0]
        want = {"w_gate": (hidden, d_model), "w_up": (hidden, d_model)}
    else:
        (_, w_up), (_, w_down) = named
        hidden = w_up.shape[0]
        want = {"w_up": (hidden, d_model)}
    for arg, w in named:
        if arg in want and w.shape != want[arg]:
            raise ValueError(f"{arg} has shape {w.shape}, expected {want[arg]} "
                             f"(x has {d_model} columns, w_up has {hidden} rows)")
    if w_down.shape != (d_model, hidden):
        raise ValueError(f"w_down has shape {w_down.shape}, expected {(d_model, hidden)} "
                         f"(nn.Linear layout: (D, H))")
    chunk_kind = "cupy" if is_cupy(x._meta) else "numpy"
    if chunk_kind == "cupy":
        _prepare_cupy_transport(client)
    for arg, w in named:
        if w.array_type != chunk_kind:
            raise ValueError(f"{arg} is a {w.array_type} array but x has {chunk_kind} chunks; "
                             f"put the weights where the chunks are")
    for arg, w in named:
        if w.dtype != x.dtype:
            raise TypeError(f"{arg} has dtype {w.dtype} but x has dtype {x.dtype}; "
                            f"the FFN needs one dtype (cast with .astype)")
    dtype = np.dtype(x.dtype)
    out_cols = w_down.shape[0]
    shared = [_share_described(w, arg, client, broadcast) for arg, w in named]
    if persist:
        name = out_name or f"twellpy-{kind}-forward-{_token(x, shared, kind, ffn_kwargs)}"
        return _submit_chunks(kind, x, shared, client, name, ffn_kwargs, dtype, out_cols)
    return x.map_blocks(
        _ffn_chunk, *[w.ref for w in shared], kind=kind, ffn_kwargs=dict(ffn_kwargs), in_dtype=dtype.name,
        weight_keys=_weight_keys(shared),
        dtype=dtype, chunks=(x.chunks[0], (out_cols,)), meta=_array_meta(x, dtype),
        name=out_name or f"twellpy-{kind}-forward-{_token(x, shared, kind, ffn_kwargs)}")


def _check_ffn_kwargs(ffn_kwargs):
    """Check FFN keyword values now, with the validators (and messages) of
    :class:`twellpy.ffn.GatedFFN`: in a chunk task they would only fail at
    ``compute()``, in a worker's log."""
    from ._ffn_infer import _check_finite_mode, _check_layout, _check_mode

    _check_layout(ffn_kwargs.get("tile", 256), ffn_kwargs.get("slots", 32))
    if "mode" in ffn_kwargs:
        _check_mode(ffn_kwargs["mode"])
    if "check_finite" in ffn_kwargs:
        _check_finite_mode(ffn_kwargs["check_finite"])


def gated_forward(x, w_gate, w_up, w_down, *, client=None, broadcast=True, rechunk=True,
                  name=None, persist=False, **ffn_kwargs):
    """Gated sparse FFN inference over the row chunks of a dask array.

    Each row chunk runs a :class:`twellpy.ffn.GatedFFN` on the worker that
    holds it (CPU for numpy chunks, GPU for cupy chunks). The FFN object
    (weights checked and laid out, kernels and workspaces ready) is built
    once per worker thread and weight set and reused by every later chunk
    (see :func:`clear_ffn_cache`).

    Parameters
    ----------
    x : dask.array.Array
        (M, D) activations, chunked along rows (columns are rechunked to one
        chunk when ``rechunk=True``, else several column chunks raise
        ``ValueError``).
    w_gate, w_up : array_like or SharedArray
        (H, D) weights (``nn.Linear`` layout), of the same kind (numpy/cupy)
        and dtype as the chunks of ``x``.
    w_down : array_like or SharedArray
        (D, H) weight.
    client : distributed.Client, optional
        Client that scatters the weights; defaults to the active one. Without
        a client each weight is one graph key shared by all chunk tasks.
    broadcast : bool
        Scatter the weights to every worker up front (see :func:`share`).
    rechunk : bool
        See ``x``.
    name : str, optional
        Key name of the output. By default it is a hash of the inputs, so
        identical calls share keys (and results already in memory); give a
        fresh name to force a new computation (e.g. when timing).
    persist : bool
        False (default): return a lazy dask array. True: start the work now
        and return a dask array backed by one future per chunk, the result
        of ``.persist()`` but with one ``client.submit`` per chunk, which
        skips the collection machinery (milliseconds per call). Use it to
        stream many small batches. Needs a client; ``x`` is persisted first
        when it is not already.
    **ffn_kwargs
        ``tile``, ``slots``, ``mode``, ``check_finite``: passed to
        :class:`twellpy.ffn.GatedFFN` (``return_activations`` is not
        supported). Their values are checked in this call, with the
        messages of ``GatedFFN``. Errors that depend on the data of a chunk
        (e.g. NaN in ``x`` with ``check_finite=True``) raise from ``compute()``.

    Returns
    -------
    dask.array.Array
        (M, D), chunks ``(x.chunks[0], (D,))``, dtype and chunk kind of ``x``.

    Raises
    ------
    TypeError
        ``x`` is not a dask array, dtypes differ or are not floating, an
        unknown keyword is given, or ``check_finite`` is not a bool or
        ``"sync"``.
    ValueError
        Shapes do not match, ``x`` has several column chunks and
        ``rechunk=False``, weights and chunks live on different kinds of
        device, or ``tile``, ``slots``, ``mode`` or ``check_finite`` has a
        bad value.
    """
    weights = [("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)]
    return _ffn("gated", x, weights, client, broadcast, rechunk, name, ffn_kwargs, persist)


def relu_forward(x, w_up, w_down, *, client=None, broadcast=True, rechunk=True, name=None,
                 persist=False, **ffn_kwargs):
    """ReLU sparse FFN inference over the row chunks of a dask array.

    Same as :func:`gated_forward` without the gate: every chunk runs a
    :class:`twellpy.ffn.ReluFFN` with ``w_up`` (H, D) and ``w_down`` (D, H),
    both placed once per worker. ``persist=True`` submits the chunks now
    (see :func:`gated_forward`).

    Returns
    -------
    dask.array.Array
        (M, D), chunks ``(x.chunks[0], (D,))``.
    """
    weights = [("w_up", w_up), ("w_down", w_down)]
    return _ffn("relu", x, weights, client, broadcast, rechunk, name, ffn_kwargs, persist)


# Workers import this module to unpickle chunk functions; registering at import
# makes their dask dispatch know the containers too.
_register()
