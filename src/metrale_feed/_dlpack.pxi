# DLPack in both directions (see docs/interop.md): the buffers export themselves (1-D uint8, or
# typed and shaped through view()), and every device-memory argument takes a foreign tensor.
# The structs follow dlpack.h (v1.0); Cython lays them out as C does.

from cpython.pycapsule cimport (PyCapsule_GetName, PyCapsule_GetPointer, PyCapsule_IsValid,
                                PyCapsule_SetName)
from libc.stdint cimport int32_t, uint8_t

cdef extern from *:
    """
    typedef struct { int32_t device_type; int32_t device_id; } mf_DLDevice;
    typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } mf_DLDataType;
    typedef struct {
        void *data; mf_DLDevice device; int32_t ndim; mf_DLDataType dtype;
        int64_t *shape; int64_t *strides; uint64_t byte_offset;
    } mf_DLTensor;
    typedef struct mf_DLManagedTensor {
        mf_DLTensor dl_tensor; void *manager_ctx; void (*deleter)(struct mf_DLManagedTensor *);
    } mf_DLManagedTensor;
    typedef struct { uint32_t major; uint32_t minor; } mf_DLPackVersion;
    typedef struct mf_DLManagedTensorVersioned {
        mf_DLPackVersion version; void *manager_ctx;
        void (*deleter)(struct mf_DLManagedTensorVersioned *); uint64_t flags; mf_DLTensor dl_tensor;
    } mf_DLManagedTensorVersioned;
    """
    ctypedef struct DLDevice "mf_DLDevice":
        int32_t device_type
        int32_t device_id
    ctypedef struct DLDataType "mf_DLDataType":
        uint8_t code
        uint8_t bits
        uint16_t lanes
    ctypedef struct DLTensor "mf_DLTensor":
        void *data
        DLDevice device
        int32_t ndim
        DLDataType dtype
        int64_t *shape
        int64_t *strides
        uint64_t byte_offset
    ctypedef struct DLManagedTensor "mf_DLManagedTensor":
        DLTensor dl_tensor
        void *manager_ctx
        void (*deleter)(DLManagedTensor *) noexcept
    ctypedef struct DLPackVersion "mf_DLPackVersion":
        uint32_t major
        uint32_t minor
    ctypedef struct DLManagedTensorVersioned "mf_DLManagedTensorVersioned":
        DLPackVersion version
        void *manager_ctx
        void (*deleter)(DLManagedTensorVersioned *) noexcept
        uint64_t flags
        DLTensor dl_tensor

cdef extern from *:
    """
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    #define MF_DL_LITTLE_ENDIAN 0
    #else
    #define MF_DL_LITTLE_ENDIAN 1
    #endif
    """
    const bint DL_LITTLE_ENDIAN "MF_DL_LITTLE_ENDIAN"

cdef enum:
    kDLCPU = 1
    kDLCUDA = 2
    kDLCUDAHost = 3
    kDLCUDAManaged = 13
    DL_INT = 0
    DL_UINT = 1
    DL_FLAG_READ_ONLY = 1
    MAX_DIMS = 8

import metrale_feed.dtypes as _dtypes_mod
from metrale_feed.dtypes import dtype as _dtype_lookup
from metrale_feed.dtypes import logits_dtype as _logits_lookup

_UINT8 = _dtypes_mod.TABLE["uint8"]
_UINT16 = _dtypes_mod.TABLE["uint16"]
for _entry in _dtypes_mod.TABLE.values():  # the table's logits codes are feed.h's
    if _entry.code is not None:
        assert _entry.code == {"float32": MF_DTYPE_F32, "float16": MF_DTYPE_F16,
                               "bfloat16": MF_DTYPE_BF16}[_entry.name], _entry.name
_BY_DLPACK = _dtypes_mod.BY_DLPACK
_BY_DLPACK_KEY = {code << 8 | bits: entry for (code, bits), entry in _BY_DLPACK.items()}


cdef object dtype_entry(object spelling):
    """The dtype table's entry (ValueError for an unknown type or a non-native byte order)."""
    return _dtype_lookup(spelling)


cdef mf_dtype dtype_of(object dtype) except *:
    """A logits dtype's C code, from any spelling of the dtype table."""
    return <mf_dtype><int>_logits_lookup(dtype).code


# ---- exports ----

cdef void _export_deleter(DLManagedTensor *managed) noexcept nogil:
    with gil:
        _release_export(<object>managed.manager_ctx)
        Py_DECREF(<object>managed.manager_ctx)
    free(managed)


cdef void _export_deleter_versioned(DLManagedTensorVersioned *managed) noexcept nogil:
    with gil:
        _release_export(<object>managed.manager_ctx)
        Py_DECREF(<object>managed.manager_ctx)
    free(managed)


cdef void _release_export(object owner) noexcept:
    if type(owner) is DeviceBuffer:
        (<DeviceBuffer>owner)._exports -= 1
    elif type(owner) is PinnedBuffer:
        (<PinnedBuffer>owner)._exports -= 1


cdef void _capsule_destructor(object capsule) noexcept:
    # An unconsumed capsule still owns its tensor; a consumer renames it "used_dltensor".
    cdef DLManagedTensor *m
    cdef DLManagedTensorVersioned *v
    if PyCapsule_IsValid(capsule, b"dltensor"):
        m = <DLManagedTensor *>PyCapsule_GetPointer(capsule, b"dltensor")
        m.deleter(m)
    elif PyCapsule_IsValid(capsule, b"dltensor_versioned"):
        v = <DLManagedTensorVersioned *>PyCapsule_GetPointer(capsule, b"dltensor_versioned")
        v.deleter(v)


cdef object dlpack_export(object owner, void *ptr, int32_t device_type, int32_t device_id,
                          object entry, tuple shape, object stream, object max_version,
                          object dl_device, object copy):
    """A DLPack capsule over ``ptr`` (C-contiguous ``shape`` of ``entry``), keeping ``owner``
    alive until the consumer's deleter runs. Never synchronises: the caller orders its streams."""
    cdef int ndim = len(shape)
    cdef bint versioned = max_version is not None and int(max_version[0]) >= 1
    cdef size_t head = sizeof(DLManagedTensorVersioned) if versioned else sizeof(DLManagedTensor)
    cdef char *block
    cdef DLTensor *t
    cdef int64_t *dims
    cdef DLManagedTensor *m
    cdef DLManagedTensorVersioned *v
    if copy:
        raise BufferError("these buffers export their own memory only (copy=True is refused)")
    if dl_device is not None and (int(dl_device[0]), int(dl_device[1])) != (device_type, device_id):
        raise BufferError(f"the buffer lives on DLPack device {(device_type, device_id)}, "
                          f"not {tuple(dl_device)}")
    if stream is not None and not isinstance(stream, int):
        raise TypeError(f"stream must be an int or None, not {type(stream).__name__}")
    # The memory is written by work the caller queued on its own streams; the package cannot know
    # which, so it never waits here (stream=-1 and any other stream alike).
    block = <char *>malloc(head + 2 * ndim * sizeof(int64_t) + 8)
    if block == NULL:
        raise MemoryError()
    dims = <int64_t *>(block + head)
    for i in range(ndim):
        dims[i] = shape[i]
    stride = 1
    for i in range(ndim - 1, -1, -1):
        dims[ndim + i] = stride
        stride *= shape[i]
    if versioned:
        v = <DLManagedTensorVersioned *>block
        v.version.major = 1
        v.version.minor = 0
        v.manager_ctx = <void *>owner
        v.deleter = _export_deleter_versioned
        v.flags = 0
        t = &v.dl_tensor
    else:
        m = <DLManagedTensor *>block
        m.manager_ctx = <void *>owner
        m.deleter = _export_deleter
        t = &m.dl_tensor
    t.data = ptr
    t.device.device_type = device_type
    t.device.device_id = device_id
    t.ndim = ndim
    t.dtype.code = <uint8_t>entry.dl_code
    t.dtype.bits = <uint8_t>entry.dl_bits
    t.dtype.lanes = 1
    t.shape = dims
    t.strides = dims + ndim
    t.byte_offset = 0
    try:
        capsule = PyCapsule_New(block, b"dltensor_versioned" if versioned else b"dltensor",
                                <PyCapsule_Destructor>_capsule_destructor)
    except BaseException:
        free(block)
        raise
    Py_INCREF(owner)
    if type(owner) is DeviceBuffer:
        (<DeviceBuffer>owner)._exports += 1
    elif type(owner) is PinnedBuffer:
        (<PinnedBuffer>owner)._exports += 1
    return capsule


cdef int device_ordinal() except -1:
    cdef int device = 0
    if mf_active_backend() == MF_BACKEND_CUDA:
        check(mf_current_device(&device))
    return device


cdef tuple buffer_dlpack_device(bint pinned):
    if mf_active_backend() != MF_BACKEND_CUDA:
        return (<int>kDLCPU, 0)
    if pinned:
        return (<int>kDLCUDAHost, 0)
    return (<int>kDLCUDA, device_ordinal())


cdef object bfloat16_type():
    """ml_dtypes' bfloat16 (the numpy type torch and JAX exchange bfloat16 arrays as), or a
    TypeError that says what to do without it."""
    import importlib  # as Python's import statement, a None in sys.modules included
    try:
        ml_dtypes = importlib.import_module("ml_dtypes")
    except ImportError:
        raise TypeError("numpy has no bfloat16 type of its own and ml_dtypes is not installed: view "
                        "the bytes as uint16 (buf.view('uint16', shape)), or install ml_dtypes") from None
    return ml_dtypes.bfloat16


cdef object as_numpy(object exporter, bint device, object dtype, object copy):
    """``numpy.asarray(buffer)``: on the host backend the buffer's own memory (through DLPack, so a
    live array keeps ``close()`` refused); on cuda device memory is refused as CuPy refuses an
    implicit conversion, and page-locked memory is read through the buffer protocol. A bfloat16
    view becomes an ml_dtypes.bfloat16 array: numpy's DLPack import refuses the type."""
    import numpy
    cdef BufferView view = <BufferView>exporter if type(exporter) is BufferView else None
    bf16 = None
    if device and mf_active_backend() == MF_BACKEND_CUDA:
        raise TypeError("device memory has no implicit numpy conversion on the cuda backend: "
                        "copy it (copy_d2h_async) or use torch/CuPy (DLPack)")
    if view is not None and view.dtype_info.name == "bfloat16":
        bf16 = bfloat16_type()
        view = retyped(view, _UINT16)  # the same bytes, a type numpy imports; then viewed as bf16
        exporter = view
    if mf_active_backend() == MF_BACKEND_CUDA:
        base = view.base if view is not None else exporter
        entry = view.dtype_info if view is not None else _UINT8
        shape = view.shape if view is not None else (len(base),)
        n = 1
        for d in shape:
            n *= d
        arr = numpy.frombuffer(base, numpy.dtype(entry.typestr), n,
                               view._offset if view is not None else 0).reshape(shape)
    else:
        arr = numpy.from_dlpack(exporter)
    if bf16 is not None:
        arr = arr.view(bf16)
    if dtype is not None:
        arr = arr.astype(dtype, copy=bool(copy))
    elif copy:
        arr = arr.copy()
    return arr


cdef dict cuda_array_interface(size_t ptr, tuple shape, str typestr):
    if mf_active_backend() != MF_BACKEND_CUDA:
        raise AttributeError("__cuda_array_interface__ exists only on the cuda backend")
    # stream None: the producer asks for no synchronisation (it never knows the writer's stream).
    return {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 3,
            "strides": None, "stream": None}


@cython.final
cdef class BufferView:
    """A typed, shaped view of a ``DeviceBuffer`` or ``PinnedBuffer``'s bytes, for DLPack and the
    CUDA array interface. ``.base`` is the buffer, kept alive by the view and by every tensor
    made from it.

    Made by ``DeviceBuffer.view`` and ``PinnedBuffer.view``, never directly.

    Parameters
    ----------
    base : DeviceBuffer or PinnedBuffer
        The buffer whose bytes it shows (``.base``).

    Examples
    --------
    >>> import numpy as np, metrale_feed as mf
    >>> buf = mf.PinnedBuffer(4 * 4)
    >>> v = buf.view("uint32", (2, 2))
    >>> v.base is buf, v.shape, v.dtype
    (True, (2, 2), 'uint32')
    >>> np.from_dlpack(v).tolist()
    [[0, 0], [0, 0]]
    """
    cdef readonly object base
    cdef readonly object dtype_info
    cdef readonly tuple shape
    cdef size_t _offset
    cdef bint _pinned

    @property
    def dtype(self):
        """The element type's canonical name (``"float32"``, ...)."""
        return self.dtype_info.name

    @property
    def ptr(self):
        return <size_t>self._address()

    @property
    def nbytes(self):
        n = self.dtype_info.itemsize
        for d in self.shape:
            n *= d
        return n

    cdef void *_address(self) except NULL:
        if self._pinned:
            (<PinnedBuffer>self.base)._check_open()
            return <char *>(<PinnedBuffer>self.base)._ptr + self._offset
        (<DeviceBuffer>self.base)._check_open()
        return <char *>(<DeviceBuffer>self.base)._ptr + self._offset

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        cdef void *ptr = self._address()
        device = buffer_dlpack_device(self._pinned)
        return dlpack_export(self.base, ptr, device[0], device[1], self.dtype_info, self.shape,
                             stream, max_version, dl_device, copy)

    def __dlpack_device__(self):
        return buffer_dlpack_device(self._pinned)

    def __array__(self, dtype=None, copy=None):
        return as_numpy(self, not self._pinned, dtype, copy)

    @property
    def __cuda_array_interface__(self):
        return cuda_array_interface(<size_t>self._address(), self.shape, self.dtype_info.typestr)

    def __repr__(self):
        return f"<BufferView {self.dtype_info.name}{list(self.shape)} of {self.base!r}>"


cdef BufferView retyped(BufferView view, object entry):
    """``view``'s bytes as ``entry``, a type of the same size."""
    cdef BufferView out = BufferView.__new__(BufferView)
    out.base = view.base
    out.dtype_info = entry
    out.shape = view.shape
    out._offset = view._offset
    out._pinned = view._pinned
    return out


cdef BufferView make_view(object base, size_t nbytes, bint pinned, object dtype, object shape,
                          object offset):
    cdef BufferView view = BufferView.__new__(BufferView)
    entry = dtype_entry(dtype)
    cdef size_t off = size_of(offset, "offset")
    if off % entry.itemsize:
        raise ValueError(f"offset {off} is not a multiple of the {entry.name} size {entry.itemsize}")
    if off > nbytes:
        raise ValueError(f"offset {off} is past the buffer's {nbytes} bytes")
    if shape is None:
        shape = ((nbytes - off) // entry.itemsize,)
    elif not isinstance(shape, tuple):
        shape = (shape,) if hasattr(type(shape), "__index__") else tuple(shape)
    dims = tuple(index_of(d, "shape") for d in shape)
    if len(dims) > MAX_DIMS:
        raise ValueError(f"a view has at most {MAX_DIMS} dimensions")
    need = entry.itemsize
    strides = entry.itemsize  # the export's strides multiply every dimension, an empty one too
    for d in dims:
        if d < 0:
            raise ValueError(f"shape {dims} has a negative dimension")
        need *= d
        strides *= max(d, 1)
    if strides > 0x7FFFFFFFFFFFFFFF:
        # An empty view would be taken here and fail only at export (DLPack's int64 shape and
        # strides): refuse it now.
        raise ValueError(f"a view of shape {dims} is too large for DLPack's int64 sizes")
    if need > nbytes - off:
        raise ValueError(f"a {entry.name} view of shape {dims} needs {need} bytes; the buffer has "
                         f"{nbytes - off} from offset {off}")
    view.base = base
    view.dtype_info = entry
    view.shape = dims
    view._offset = off
    view._pinned = pinned
    return view


# ---- imports ----

@cython.final
@cython.freelist(8)
cdef class _Foreign:
    """A foreign array taken for one call: its address, layout and type, and what keeps it alive
    (the consumed DLPack capsule, whose deleter runs when this goes, or the object itself)."""
    cdef void *ptr
    cdef int32_t device_type
    cdef int32_t device_id
    cdef int ndim
    cdef int64_t shape[MAX_DIMS]
    cdef int64_t strides[MAX_DIMS]  # in elements; C-contiguous when none were given
    cdef object entry               # the dtype table's entry, or None for a type it lacks
    cdef uint8_t dl_code, dl_bits
    cdef bint ids                   # 32-bit integers: uint32 ids, or int32 taken as their bits
    cdef bint readonly
    cdef object owner
    cdef void *managed
    cdef bint versioned
    cdef Py_buffer view             # a buffer-protocol import's export (foreign_from_buffer)
    cdef bint viewed

    def __dealloc__(self):
        cdef DLManagedTensor *m
        cdef DLManagedTensorVersioned *v
        if self.viewed:
            PyBuffer_Release(&self.view)
        if self.managed == NULL:
            return
        if self.versioned:
            v = <DLManagedTensorVersioned *>self.managed
            if v.deleter != NULL:
                v.deleter(v)
        else:
            m = <DLManagedTensor *>self.managed
            if m.deleter != NULL:
                m.deleter(m)

    cdef size_t count(self):
        cdef size_t n = 1
        for i in range(self.ndim):
            n *= <size_t>self.shape[i]
        return n

    cdef bint contiguous(self):
        cdef int64_t expect = 1
        if self.count() == 0:
            return True  # no element to reach: any strides will do
        for i in range(self.ndim - 1, -1, -1):
            if self.shape[i] != 1 and self.strides[i] != expect:
                return False
            expect *= self.shape[i]
        return True

    cdef str type_name(self):
        return self.entry.name if self.entry is not None else f"(DLPack code {self.dl_code}, {self.dl_bits} bits)"


# (_takes_max_version and _cpu_exporters, learnt once per type, are declared in _state.pxi.)


cdef object cpu_exporter(object kind):
    f = _cpu_exporters.get(kind, False)
    if f is False:
        f = None
        if kind.__module__ == "torch" and kind.__name__ == "Tensor":
            import sys
            f = getattr(sys.modules["torch"]._C, "_to_dlpack_versioned", None)
        _cpu_exporters[kind] = f
    return f


cdef bint takes_buffer_import(object kind):
    """Whether the host backend reads arrays of this type through the buffer protocol rather than
    DLPack: numpy's ndarray, whose buffer export says what its DLPack export does (address, shape,
    strides, type, read-only) and keeps the array as alive (the array itself, referenced until the
    export is released), at half the cost: no capsule, no managed tensor to allocate and free."""
    t = _buffer_imports.get(kind)
    if t is None:
        t = kind.__module__ == "numpy" and kind.__name__ == "ndarray"
        _buffer_imports[kind] = t
    return t


cdef _Foreign foreign_from_buffer(object obj):
    """A CPU array through the buffer protocol, or None where its buffer says anything DLPack
    would say differently (a type the dtype table lacks, a byte order or strides DLPack refuses,
    more dimensions than taken): the caller then takes it through DLPack, errors included."""
    cdef _Foreign f = _Foreign.__new__(_Foreign)
    cdef const char *fmt
    cdef char kind
    cdef uint8_t code
    cdef Py_ssize_t itemsize, stride
    try:
        PyObject_GetBuffer(obj, &f.view, PyBUF_STRIDES | PyBUF_FORMAT)  # read-only allowed: f.readonly says
    except (BufferError, ValueError, TypeError):
        return None  # (a type the protocol has no format for: ml_dtypes' bfloat16)
    f.viewed = True
    fmt = f.view.format
    itemsize = f.view.itemsize
    if (fmt == NULL or f.view.ndim < 0 or f.view.ndim > MAX_DIMS or itemsize <= 0 or itemsize > 8
            or f.view.len == 0):
        return None  # (an empty array: numpy's export says its strides its own way)
    if fmt[0] == b'@' or fmt[0] == b'=' or (fmt[0] == b'<' and DL_LITTLE_ENDIAN):
        fmt += 1  # the native byte order; the size is the buffer's itemsize either way
    kind = fmt[0]
    if kind == 0 or fmt[1] != 0:
        return None
    if kind == b'f' or kind == b'd' or kind == b'e':
        code = 2  # kDLFloat
    elif kind == b'b' or kind == b'h' or kind == b'i' or kind == b'l' or kind == b'q':
        code = DL_INT
    elif kind == b'B' or kind == b'H' or kind == b'I' or kind == b'L' or kind == b'Q':
        code = DL_UINT
    else:
        return None
    f.entry = _BY_DLPACK_KEY.get(code << 8 | itemsize * 8)
    if f.entry is None:
        return None
    f.ptr = f.view.buf
    f.device_type = kDLCPU
    f.device_id = 0
    f.ndim = f.view.ndim
    f.dl_code = code
    f.dl_bits = <uint8_t>(itemsize * 8)
    f.ids = itemsize == 4 and code != 2
    f.readonly = f.view.readonly
    stride = 1
    for i in range(f.ndim - 1, -1, -1):
        f.shape[i] = f.view.shape[i]
        if f.view.strides == NULL:
            f.strides[i] = stride
        elif f.view.strides[i] % itemsize:
            return None  # DLPack counts strides in elements (numpy refuses the export)
        else:
            f.strides[i] = f.view.strides[i] // itemsize
        stride *= f.view.shape[i]
    return f


cdef int _fill_from_tensor(_Foreign f, DLTensor *t) except -1:
    if t.ndim < 0 or t.ndim > MAX_DIMS:
        raise ValueError(f"a tensor of {t.ndim} dimensions is not taken (at most {MAX_DIMS})")
    if t.dtype.lanes != 1:
        raise TypeError("vector (multi-lane) DLPack types are not taken")
    f.ptr = <char *>t.data + t.byte_offset
    f.device_type = t.device.device_type
    f.device_id = t.device.device_id
    f.ndim = t.ndim
    f.dl_code = t.dtype.code
    f.dl_bits = t.dtype.bits
    f.ids = t.dtype.bits == 32 and (t.dtype.code == DL_INT or t.dtype.code == DL_UINT)
    f.entry = _BY_DLPACK_KEY.get(t.dtype.code << 8 | t.dtype.bits)
    cdef int64_t stride = 1
    for i in range(t.ndim - 1, -1, -1):
        f.shape[i] = t.shape[i]
        if t.shape[i] < 0:
            raise ValueError("a tensor with a negative dimension")
        f.strides[i] = t.strides[i] if t.strides != NULL else stride
        stride *= t.shape[i]
    return 0


cdef _Foreign foreign_from_dlpack(object obj, object stream_arg):
    cdef _Foreign f = _Foreign.__new__(_Foreign)
    cdef DLManagedTensor *m
    cdef DLManagedTensorVersioned *v
    kind = type(obj)
    takes = _takes_max_version.get(kind)
    fast = cpu_exporter(kind) if stream_arg is None else None
    try:
        if fast is not None:
            if obj.requires_grad:  # as torch's __dlpack__ refuses it
                raise BufferError("a tensor that requires grad is not exported; detach() it")
            capsule = fast(obj)
        elif takes is None or takes:
            try:
                capsule = obj.__dlpack__(stream=stream_arg, max_version=(1, 0))
                if takes is None:
                    _takes_max_version[kind] = True
            except TypeError:
                if takes:
                    raise
                _takes_max_version[kind] = False  # a producer older than DLPack 1.0
                capsule = obj.__dlpack__(stream=stream_arg)
        else:
            capsule = obj.__dlpack__(stream=stream_arg)
    except (BufferError, RuntimeError) as error:  # an object array; a torch tensor that requires grad
        if isinstance(error, FeedError):
            raise
        raise TypeError(f"{type(obj).__name__} cannot be taken through DLPack: {error}") from error
    if PyCapsule_IsValid(capsule, b"dltensor_versioned"):
        v = <DLManagedTensorVersioned *>PyCapsule_GetPointer(capsule, b"dltensor_versioned")
        if v.version.major != 1:
            raise BufferError(f"DLPack version {v.version.major}.{v.version.minor} is not supported")
        PyCapsule_SetName(capsule, b"used_dltensor_versioned")
        f.managed = v
        f.versioned = True
        f.readonly = (v.flags & DL_FLAG_READ_ONLY) != 0
        _fill_from_tensor(f, &v.dl_tensor)
    elif PyCapsule_IsValid(capsule, b"dltensor"):
        m = <DLManagedTensor *>PyCapsule_GetPointer(capsule, b"dltensor")
        PyCapsule_SetName(capsule, b"used_dltensor")
        f.managed = m
        _fill_from_tensor(f, &m.dl_tensor)
    else:
        raise TypeError(f"{type(obj).__name__}.__dlpack__ returned no DLPack capsule")
    return f


cdef int order_after(object producer, uint64_t stream) except -1:
    """The CUDA array interface's ``stream``: the consumer's stream waits for the producer's work
    (an event, no host wait). 1 and 2 name CUDA's legacy and per-thread default streams."""
    cdef uint64_t event, p
    if producer is None:
        return 0
    u64_of(0 if producer == 1 else producer, &p, "__cuda_array_interface__ stream")
    if p == stream:
        return 0
    check(mf_event_create(MF_EVENT_UNCOUNTED, &event))
    try:
        check(mf_event_record(event, p))
        check(mf_stream_wait_event(stream, event))
    finally:
        mf_event_destroy(event)  # CUDA keeps a recorded event's work until it has run
    return 0


cdef _Foreign foreign_from_cai(object obj, uint64_t stream):
    cdef _Foreign f = _Foreign.__new__(_Foreign)
    cai = obj.__cuda_array_interface__
    order_after(cai.get("stream"), stream)
    data = cai["data"]
    shape = tuple(cai["shape"])
    entry = dtype_entry(cai["typestr"])
    if len(shape) > MAX_DIMS:
        raise ValueError(f"an array of {len(shape)} dimensions is not taken (at most {MAX_DIMS})")
    f.ptr = <void *><size_t>index_of(data[0], "data pointer")
    f.readonly = bool(data[1])
    f.device_type = kDLCUDA
    f.device_id = device_ordinal()
    f.ndim = len(shape)
    f.entry = entry
    f.dl_code = entry.dl_code
    f.dl_bits = entry.dl_bits
    f.ids = entry.name in ("uint32", "int32")
    strides = cai.get("strides")
    stride = 1
    for i in range(f.ndim - 1, -1, -1):
        f.shape[i] = shape[i]
        if strides is None:
            f.strides[i] = stride
        else:
            if strides[i] % entry.itemsize:
                raise ValueError("array strides are not whole elements")
            f.strides[i] = strides[i] // entry.itemsize
        stride *= shape[i]
    f.owner = obj
    return f
