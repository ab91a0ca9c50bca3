# The C API capsule for C/C++ extensions (cuda/include/metrale_feed/capi.h).

cdef extern from *:
    """
    #define MF_CAPI_IMPLEMENTATION
    #include "metrale_feed/capi.h"
    static mf_capi mf_capi_table;
    """
    ctypedef struct mf_capi:
        pass
    mf_capi mf_capi_table
    void mf_capi_fill(mf_capi *table)

mf_capi_fill(&mf_capi_table)
_C_API = PyCapsule_New(<void *>&mf_capi_table, b"metrale_feed._C_API", NULL)
