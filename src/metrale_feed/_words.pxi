# uint32 word arrays in: a buffer of uint32 is read in place (no copy); a sequence is converted once.

@cython.final
@cython.freelist(8)
cdef class _Words:
    cdef Py_buffer view
    cdef bint has_view
    cdef uint32_t *owned
    cdef const uint32_t *data
    cdef Py_ssize_t n

    def __dealloc__(self):
        if self.has_view:
            PyBuffer_Release(&self.view)
        free(self.owned)


cdef bint is_u32_format(const char *fmt) noexcept:
    if fmt == NULL:
        return False
    if fmt[0] in (b'@', b'=', b'<') and fmt[1] != 0:
        fmt += 1
    return (fmt[0] == b'I' or fmt[0] == b'L' and sizeof(long) == 4) and fmt[1] == 0


cdef inline uint32_t word_of(object item) except? 0xFFFFFFFF:
    # An int (FeedSource and numpy integers included); a float is refused, not truncated.
    if not PyLong_Check(item) and (isinstance(item, float) or not hasattr(type(item), "__index__")):
        raise TypeError(f"an id must be an int, not {type(item).__name__}")
    return <uint32_t>item


cdef _Words words_of(object obj, bint pairs, str what, Py_ssize_t max_items=8192):
    """``obj`` as a flat uint32 array: a C-contiguous uint32 buffer, or a sequence of at most
    ``max_items`` ints (of (a, b) pairs when ``pairs``)."""
    cdef _Words words = _Words.__new__(_Words)
    cdef Py_ssize_t i, n
    cdef object item
    if PyObject_CheckBuffer(obj) and not isinstance(obj, (bytes, bytearray)):
        PyObject_GetBuffer(obj, &words.view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
        words.has_view = True
        if words.view.itemsize != 4 or not is_u32_format(words.view.format):
            raise TypeError(f"{what} must be a uint32 buffer, not format {words.view.format.decode()!r}")
        words.data = <const uint32_t *>words.view.buf
        words.n = words.view.len // 4
        return words
    try:
        n = len(obj)
    except TypeError:
        raise TypeError(f"{what} must be a uint32 buffer or a sequence, not {type(obj).__name__}") from None
    if n < 0 or n > max_items:  # before any arithmetic on n: a huge __len__ must not wrap malloc
        raise ValueError(f"{what} holds {n} items; at most {max_items}")
    words.owned = <uint32_t *>malloc((2 * n if pairs else n) * sizeof(uint32_t) + 4)
    if words.owned == NULL:
        raise MemoryError()
    words.data = words.owned
    try:
        if pairs:
            for i in range(n):
                item = obj[i]
                if len(item) != 2:
                    raise ValueError(f"{what}[{i}] must be a pair of ids")
                words.owned[2 * i] = word_of(item[0])
                words.owned[2 * i + 1] = word_of(item[1])
            words.n = 2 * n
        else:
            for i in range(n):
                words.owned[i] = word_of(obj[i])
            words.n = n
    except OverflowError:
        raise ValueError(f"{what} holds an id outside uint32") from None
    except TypeError as error:
        raise TypeError(f"{what}: {error}") from None
    return words
