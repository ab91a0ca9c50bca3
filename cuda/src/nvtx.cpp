// NVTX 3 is header-only: with no profiler attached each call is a check of a null pointer.
#include <cstdlib>
#include <cstring>

#include "api.hpp"

#ifdef MF_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

namespace mf {
namespace {
bool nvtx_enabled_from_env() {
    const char *value = std::getenv("METRALE_FEED_NVTX");
    return !(value && (std::strcmp(value, "0") == 0 || std::strcmp(value, "off") == 0));
}
bool g_nvtx_on = nvtx_enabled_from_env();
#ifdef MF_HAVE_NVTX
// A profiler attaches through NVTX's injection at its first call; once NVTX has initialised with
// none, its entry points are null and a range only has to test this flag.
bool g_tool_attached = false;
bool g_nvtx_live = false;  // on, and a tool is listening

nvtxDomainHandle_t create_domain() {
    nvtxDomainHandle_t handle = nvtxDomainCreateA("metrale_feed");
    g_tool_attached = NVTX_VERSIONED_IDENTIFIER(nvtxGlobals).nvtxDomainRangePushEx_impl_fnptr != nullptr;
    g_nvtx_live = g_nvtx_on && g_tool_attached;
    return handle;
}

nvtxDomainHandle_t domain() {
    static nvtxDomainHandle_t handle = create_domain();
    return handle;
}
#endif
}  // namespace

const void *NvtxRange::attributes(const char *text) {
#ifdef MF_HAVE_NVTX
    auto *attributes = new nvtxEventAttributes_t();  // one per call site, for the process
    attributes->version = NVTX_VERSION;
    attributes->size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    attributes->messageType = NVTX_MESSAGE_TYPE_REGISTERED;
    attributes->message.registered = nvtxDomainRegisterStringA(domain(), text);
    return attributes;
#else
    return text;
#endif
}

NvtxRange::NvtxRange(const void *attributes) : pushed_(false) {
#ifdef MF_HAVE_NVTX
    if (!g_nvtx_live) return;  // attributes() ran first (a static of the call site): flag is set
    nvtxDomainRangePushEx(domain(), static_cast<const nvtxEventAttributes_t *>(attributes));
    pushed_ = true;
#else
    (void)attributes;
#endif
}

NvtxRange::~NvtxRange() {
#ifdef MF_HAVE_NVTX
    if (pushed_) nvtxDomainRangePop(domain());
#endif
}

}  // namespace mf

extern "C" {
void mf_nvtx_push(const char *name) {
#ifdef MF_HAVE_NVTX
    mf::domain();
    if (!mf::g_nvtx_live) return;
    if (!name) name = "";
    nvtxEventAttributes_t attributes;
    std::memset(&attributes, 0, sizeof attributes);
    attributes.version = NVTX_VERSION;
    attributes.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    attributes.messageType = NVTX_MESSAGE_TYPE_ASCII;
    attributes.message.ascii = name;
    nvtxDomainRangePushEx(mf::domain(), &attributes);
#else
    (void)name;
#endif
}
void mf_nvtx_pop(void) {
#ifdef MF_HAVE_NVTX
    if (mf::g_nvtx_live) nvtxDomainRangePop(mf::domain());
#endif
}
void mf_nvtx_enable(int on) {
    mf::g_nvtx_on = on != 0;
#ifdef MF_HAVE_NVTX
    mf::domain();
    mf::g_nvtx_live = mf::g_nvtx_on && mf::g_tool_attached;
#endif
}
int mf_build_has_nvtx(void) {
#ifdef MF_HAVE_NVTX
    return 1;
#else
    return 0;
#endif
}
}
