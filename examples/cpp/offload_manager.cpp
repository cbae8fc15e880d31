// A C++ KV-cache manager using a kvgen family library through its C ABI alone: no torch, no
// kvgen Python, no compiler at run time. Build (any C++17 compiler; CUDA only at run time):
//
//   g++ -std=c++17 -I kvgen/kernels/include examples/cpp/offload_manager.cpp -ldl -o offload_manager
//   ./offload_manager build/registry/sm_90a/libkvgen_qwen3_8b.so 36 2
//
// Arguments: the library, the family's layer count and its buffers per layer (quantized buffers
// then side buffers, as `kvgen show FAMILY` lists them). The program dlopen()s the library (every
// family library exports the same names: RTLD_LOCAL), checks the ABI and family, and configures a
// codec with pool descriptors. A real manager passes its own pool base pointers and page strides;
// here they are null, so configure must refuse them with a message, which is what the CPU test
// checks. On a GPU the same program would go on to encode/decode page pairs on its stream.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kvgen_codec.h"
#include "kvgen_compact.h"

namespace {

// The entry points this manager uses, resolved once.
struct Codec {
  decltype(&kvgen_abi_version) abi_version;
  decltype(&kvgen_family_name) family_name;
  decltype(&kvgen_last_error) last_error;
  decltype(&kvgen_codec_configure) configure;
  decltype(&kvgen_codec_destroy) destroy;
  decltype(&kvgen_codec_query_cold_page_bytes) cold_page_bytes;
  decltype(&kvgen_codec_encode) encode;
  decltype(&kvgen_compact_abi_version) compact_abi_version;  // absent without TriAttention
};

template <class F>
bool resolve(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  if (*out == nullptr) std::fprintf(stderr, "missing entry point %s\n", name);
  return *out != nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s LIBRARY LAYERS BUFFERS_PER_LAYER\n", argv[0]);
    return 2;
  }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    std::fprintf(stderr, "dlopen: %s\n", dlerror());
    return 1;
  }
  Codec c{};
  bool ok = resolve(lib, "kvgen_abi_version", &c.abi_version) && resolve(lib, "kvgen_family_name", &c.family_name) &&
            resolve(lib, "kvgen_last_error", &c.last_error) && resolve(lib, "kvgen_codec_configure", &c.configure) &&
            resolve(lib, "kvgen_codec_destroy", &c.destroy) &&
            resolve(lib, "kvgen_codec_query_cold_page_bytes", &c.cold_page_bytes) &&
            resolve(lib, "kvgen_codec_encode", &c.encode);
  if (!ok) return 1;
  if (c.abi_version() < KVGEN_ABI_VERSION) {  // a library keeps every older version's entry points
    std::fprintf(stderr, "ABI %d, this manager was built for %d\n", c.abi_version(), KVGEN_ABI_VERSION);
    return 1;
  }
  c.compact_abi_version = reinterpret_cast<decltype(c.compact_abi_version)>(dlsym(lib, "kvgen_compact_abi_version"));
  std::printf("family %s, codec ABI %d, compaction %s\n", c.family_name(), c.abi_version(),
              c.compact_abi_version ? "present" : "absent");

  const int64_t layers = std::atoll(argv[2]);
  const int64_t buffers = std::atoll(argv[3]);
  std::vector<kvgen_pool_desc> pools(layers * buffers, kvgen_pool_desc{nullptr, 0});
  kvgen_codec* codec = c.configure(pools.data(), static_cast<int64_t>(pools.size()), KVGEN_INDEX_HOST);
  if (codec == nullptr) {
    std::printf("configure refused: %s\n", c.last_error());
    return 0;
  }
  std::printf("configured: cold page of lifecycle 0 = %lld bytes\n",
              static_cast<long long>(c.cold_page_bytes(codec, 0)));
  c.destroy(codec);
  return 0;
}
