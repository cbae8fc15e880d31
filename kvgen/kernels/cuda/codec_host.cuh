// kvgen/kernels/cuda/codec_host.cuh -- host side of the C ABI in kvgen_codec.h, generic over a family.
//
// A generated codec.cu defines the family's Layer type and lifecycle tables, then expands
// KVGEN_DEFINE_CODEC_ABI(...) once.  Nothing here synchronizes: configure allocates and fills the
// per-lifecycle descriptor tables and the device error record (init time); encode/decode check
// host pairs against the pools' pages and the cold slots, then only launch (the kernels check
// device pairs, device_errors.cuh).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdio>
#include <string>
#include <vector>

#include "codec_kernels.cuh"
#include "kvgen_codec.h"
#include "last_error.cuh"

namespace kvgen {
namespace codec {

using kvgen::fail;

inline bool cuda_ok(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return true;
  return fail(std::string(what) + ": " + cudaGetErrorString(status));
}

// Family facts the generated file provides as constexpr tables.
struct FamilyTables {
  const char* name;
  int num_layers;
  int parts_per_layer;                 // quantized buffers then side buffers
  const int* part_align;               // required base/stride alignment per part
  int num_lifecycles;
  const int* lifecycle_begin;          // lifecycle i owns lifecycle_layers[begin[i] .. begin[i+1])
  const int* lifecycle_layers;
  int record_bytes;
};

// Page counts and cold slot counts a caller did not give (the entry points without them): any
// non-negative int32 index passes.
constexpr int64_t kUnknownCount = (int64_t)1 << 32;
// A launch at the priority of its stream (no launch attribute); any other value is a CUDA stream
// priority given to the kernel itself (cudaLaunchAttributePriority).
constexpr int kStreamPriority = INT_MIN;

// Host index arrays, checked before anything is enqueued: the first pair out of range fails the
// call, naming it.  Pure host code (tests/csrc/codec_host_check.cu runs it without a GPU).
inline bool check_host_pairs(const char* family, bool encode, int lifecycle, const kvgen_page_pair* pairs, int64_t n,
                             int64_t hot_pages, int64_t cold_slots) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t hot = encode ? pairs[i].src : pairs[i].dst;
    const int64_t slot = encode ? pairs[i].dst : pairs[i].src;
    const char* hot_field = encode ? "src" : "dst";
    const char* slot_field = encode ? "dst" : "src";
    if (!in_range(hot, hot_pages)) {
      return fail(std::string(family) + ": pair " + std::to_string(i) + ": " + hot_field + " " + std::to_string(hot) +
                  " is not a hot page of lifecycle " + std::to_string(lifecycle) +
                  (hot_pages == kUnknownCount ? " (pages are >= 0)"
                                              : " (its pools hold " + std::to_string(hot_pages) + " pages)"));
    }
    if (!in_range(slot, cold_slots)) {
      return fail(std::string(family) + ": pair " + std::to_string(i) + ": " + slot_field + " " +
                  std::to_string(slot) + " is not a cold slot" +
                  (cold_slots == kUnknownCount ? " (slots are >= 0)"
                                               : " (the cold buffer holds " + std::to_string(cold_slots) + " slots)"));
    }
  }
  return true;
}

// Hot pages every pool of each lifecycle holds (the smallest count of its layers' pools): a page
// index is used for all of them.  num_pages null: unknown (kUnknownCount).
inline bool lifecycle_hot_pages(const FamilyTables& f, const int64_t* num_pages, std::vector<int64_t>& out) {
  out.assign(f.num_lifecycles, kUnknownCount);
  if (num_pages == nullptr) return true;
  for (int lc = 0; lc < f.num_lifecycles; ++lc) {
    for (int i = f.lifecycle_begin[lc]; i < f.lifecycle_begin[lc + 1]; ++i) {
      for (int p = 0; p < f.parts_per_layer; ++p) {
        const int64_t d = (int64_t)f.lifecycle_layers[i] * f.parts_per_layer + p;
        if (num_pages[d] < 0) {
          return fail(std::string(f.name) + ": pool " + std::to_string(d) + " (layer " +
                      std::to_string(f.lifecycle_layers[i]) + ", buffer " + std::to_string(p) +
                      ") has a negative page count");
        }
        if (num_pages[d] < out[lc]) out[lc] = num_pages[d];
      }
    }
  }
  return true;
}

inline bool positive_finite(float v) { return nvfp4::is_finite(v) && v > 0.0f; }

// Per-layer scales (kvgen_codec_set_layer_scales), checked and laid out as the kernels read them:
// rows[l * parts_per_layer + p] is part p of family layer l; the per-layer parts (part_layer_scales)
// take G[l * k + j], Q[l * k + j] for the j-th of the k per-layer parts, the other entries stay
// unused.  Q null: Q = fl(1 / G).  Every value must be finite and > 0.  Pure host code
// (tests/csrc/codec_record_check.cu runs it without a GPU).
inline bool layer_scale_rows(const FamilyTables& f, const bool* part_layer_scales, const float* G, const float* Q,
                             int64_t n, std::vector<LayerScale>& rows) {
  std::vector<int> parts;
  for (int p = 0; p < f.parts_per_layer; ++p) {
    if (part_layer_scales[p]) parts.push_back(p);
  }
  const int k = (int)parts.size();
  if (k == 0) {
    return fail(std::string(f.name) + ": no buffer takes per-layer scales (the spec compiles them in: "
                                      "cold_page.scales)");
  }
  const int64_t expected = (int64_t)f.num_layers * k;
  if (G == nullptr || n != expected) {
    return fail(std::string(f.name) + ": expected " + std::to_string(expected) + " scales (" +
                std::to_string(f.num_layers) + " layers x " + std::to_string(k) + " per-layer buffers), got " +
                (G == nullptr ? std::string("a null G") : std::to_string(n)));
  }
  std::vector<LayerScale> out((size_t)f.num_layers * f.parts_per_layer, LayerScale{1.0f, 1.0f});
  for (int64_t i = 0; i < n; ++i) {
    const int layer = (int)(i / k);
    const int part = parts[i % k];
    const LayerScale s{G[i], Q != nullptr ? Q[i] : 1.0f / G[i]};
    const char* bad = !positive_finite(s.G) ? "G" : !positive_finite(s.Q) ? (Q != nullptr ? "Q" : "1/G") : nullptr;
    if (bad != nullptr) {
      char value[32];
      std::snprintf(value, sizeof value, "%g", bad[0] == 'G' ? s.G : s.Q);
      return fail(std::string(f.name) + ": " + bad + "[" + std::to_string(i) + "] (layer " + std::to_string(layer) +
                  ", buffer " + std::to_string(part) + ") is " + value + "; scales must be finite and > 0");
    }
    out[(size_t)layer * f.parts_per_layer + part] = s;
  }
  rows.swap(out);
  return true;
}

// The scale table of one lifecycle: the rows of its layers, in the lifecycle's order.
inline std::vector<LayerScale> lifecycle_scale_rows(const FamilyTables& f, const std::vector<LayerScale>& rows,
                                                    int lifecycle) {
  std::vector<LayerScale> out;
  for (int i = f.lifecycle_begin[lifecycle]; i < f.lifecycle_begin[lifecycle + 1]; ++i) {
    const LayerScale* row = rows.data() + (size_t)f.lifecycle_layers[i] * f.parts_per_layer;
    out.insert(out.end(), row, row + f.parts_per_layer);
  }
  return out;
}

template <class L, int kThreads, int kInFlight>
class Codec {
 public:
  // num_pages: the page count of every pool (descriptor order), or null when not known.
  static Codec* configure(const FamilyTables& f, const kvgen_pool_desc* descs, int64_t num_descs,
                          kvgen_index_location location, const int64_t* num_pages = nullptr) {
    const int64_t expected = (int64_t)f.num_layers * f.parts_per_layer;
    if (descs == nullptr || num_descs != expected) {
      fail(std::string(f.name) + ": expected " + std::to_string(expected) + " pool descriptors (" +
           std::to_string(f.num_layers) + " layers x " + std::to_string(f.parts_per_layer) +
           " buffers), got " + std::to_string(num_descs));
      return nullptr;
    }
    for (int64_t i = 0; i < num_descs; ++i) {
      const int align = f.part_align[i % f.parts_per_layer];
      if ((uintptr_t)descs[i].base % align || descs[i].page_stride_bytes % align) {
        fail(std::string(f.name) + ": descriptor " + std::to_string(i) + " (layer " +
             std::to_string(i / f.parts_per_layer) + ", buffer " + std::to_string(i % f.parts_per_layer) +
             ") base/stride not " + std::to_string(align) + "-byte aligned");
        return nullptr;
      }
    }
    if (location != KVGEN_INDEX_HOST && location != KVGEN_INDEX_DEVICE) {
      fail(std::string(f.name) + ": index location must be KVGEN_INDEX_HOST or KVGEN_INDEX_DEVICE");
      return nullptr;
    }
    std::vector<int64_t> hot_pages;
    if (!lifecycle_hot_pages(f, num_pages, hot_pages)) return nullptr;
    if (!set_shared_memory()) return nullptr;
    Codec* codec = new Codec(f, location);
    codec->hot_pages_ = hot_pages;
    if (!(codec->errors_ = alloc_device_errors()) || !codec->upload(descs)) {
      delete codec;
      return nullptr;
    }
    return codec;
  }

  ~Codec() {
    for (PoolDesc* table : tables_) cudaFree(table);
    if (errors_) cudaFreeHost(errors_);
  }

  int num_lifecycles() const { return f_.num_lifecycles; }
  kvgen_index_location location() const { return location_; }

  int64_t cold_page_bytes(int lifecycle) const {
    if (lifecycle < 0 || lifecycle >= f_.num_lifecycles) return 0;
    return (int64_t)layers_in(lifecycle) * L::kRecordBytes;
  }

  // cold_slots: slots at `cold` (kUnknownCount when the caller did not say); priority: the kernels'
  // own launch priority (kStreamPriority: the stream's).
  bool encode(int lifecycle, void* cold, int64_t cold_slots, const kvgen_page_pair* pairs, int64_t n,
              cudaStream_t stream, int priority = kStreamPriority) {
    return launch<true>(lifecycle, cold, cold_slots, pairs, n, stream, priority);
  }
  bool decode(int lifecycle, const void* cold, int64_t cold_slots, const kvgen_page_pair* pairs, int64_t n,
              cudaStream_t stream, int priority = kStreamPriority) {
    return launch<false>(lifecycle, const_cast<void*>(cold), cold_slots, pairs, n, stream, priority);
  }

  // Without a cold slot count (kvgen_codec_encode / _decode): slots are only checked to be >= 0.
  bool encode(int lifecycle, void* cold, const kvgen_page_pair* pairs, int64_t n, cudaStream_t stream) {
    return encode(lifecycle, cold, kUnknownCount, pairs, n, stream);
  }
  bool decode(int lifecycle, const void* cold, const kvgen_page_pair* pairs, int64_t n, cudaStream_t stream) {
    return decode(lifecycle, cold, kUnknownCount, pairs, n, stream);
  }

  // Device indices the kernels skipped since the last check (see device_errors.cuh).
  bool check_device_errors() { return take_device_errors(errors_); }

  // Quantized buffers whose G and Q are per layer (0: all compiled in).
  static int layer_scale_buffers() { return L::kLayerScaleParts; }

  // G and Q of every (layer, per-layer buffer), layer-major; copied into each lifecycle's scale
  // table (synchronous: no encode or decode of this codec may be in flight).  A refused call
  // changes nothing.
  bool set_layer_scales(const float* G, const float* Q, int64_t n) {
    std::vector<LayerScale> rows;
    if (!layer_scale_rows(f_, L::kPartLayerScales, G, Q, n, rows)) return false;
    for (int lc = 0; lc < f_.num_lifecycles; ++lc) {
      const std::vector<LayerScale> table = lifecycle_scale_rows(f_, rows, lc);
      LayerScale* dst = reinterpret_cast<LayerScale*>(tables_[lc] + (size_t)layers_in(lc) * f_.parts_per_layer);
      if (!cuda_ok(cudaMemcpy(dst, table.data(), table.size() * sizeof(LayerScale), cudaMemcpyHostToDevice),
                   "upload layer scales")) {
        return false;
      }
    }
    scales_set_ = true;
    return true;
  }

 private:
  Codec(const FamilyTables& f, kvgen_index_location location) : f_(f), location_(location) {}

  int layers_in(int lifecycle) const {
    return f_.lifecycle_begin[lifecycle + 1] - f_.lifecycle_begin[lifecycle];
  }

  // Dynamic shared memory above 48 KiB (a record, or decode's two record buffers under DecodePages)
  // needs an explicit opt-in; more than the GPU allows fails here.
  static bool set_shared_memory() {
    const int bytes = L::kRecordBytes;
    const int decode_bytes = decode_smem_bytes<L>();
    return cuda_ok(cudaFuncSetAttribute(encode_kernel<L, kThreads, kInFlight, false>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), "encode smem") &&
           cuda_ok(cudaFuncSetAttribute(encode_kernel<L, kThreads, kInFlight, true>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), "encode smem") &&
           cuda_ok(cudaFuncSetAttribute(decode_kernel<L, kThreads, kInFlight, false>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, decode_bytes), "decode smem") &&
           cuda_ok(cudaFuncSetAttribute(decode_kernel<L, kThreads, kInFlight, true>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, decode_bytes), "decode smem");
  }

  // One device table per lifecycle: [layer position][part] descriptors, then (per-layer scales)
  // [layer position][part] LayerScale, filled by set_layer_scales.
  bool upload(const kvgen_pool_desc* descs) {
    for (int lc = 0; lc < f_.num_lifecycles; ++lc) {
      std::vector<PoolDesc> host;
      for (int i = f_.lifecycle_begin[lc]; i < f_.lifecycle_begin[lc + 1]; ++i) {
        const int layer = f_.lifecycle_layers[i];
        for (int p = 0; p < f_.parts_per_layer; ++p) {
          const kvgen_pool_desc& d = descs[(int64_t)layer * f_.parts_per_layer + p];
          host.push_back(PoolDesc{static_cast<uint8_t*>(d.base), d.page_stride_bytes});
        }
      }
      PoolDesc* table = nullptr;
      const size_t bytes = host.size() * sizeof(PoolDesc);
      const size_t scale_bytes = L::kLayerScales ? host.size() * sizeof(LayerScale) : 0;
      if (!cuda_ok(cudaMalloc(&table, bytes + scale_bytes), "cudaMalloc descriptor table")) return false;
      tables_.push_back(table);
      if (!cuda_ok(cudaMemcpy(table, host.data(), bytes, cudaMemcpyHostToDevice), "upload descriptors")) {
        return false;
      }
    }
    return true;
  }

  template <bool kEncode>
  bool launch(int lifecycle, void* cold, int64_t cold_slots, const kvgen_page_pair* pairs, int64_t n,
              cudaStream_t stream, int priority) {
    if (!take_device_errors(errors_)) return false;  // an earlier launch's device indices
    if (lifecycle < 0 || lifecycle >= f_.num_lifecycles) {
      return fail(std::string(f_.name) + ": no lifecycle " + std::to_string(lifecycle));
    }
    if (L::kLayerScales && !scales_set_) {
      return fail(std::string(f_.name) + ": per-layer scales not set (call kvgen_codec_set_layer_scales after "
                                         "configure)");
    }
    if (n < 0 || (n > 0 && (pairs == nullptr || cold == nullptr))) return fail("null cold base or pairs");
    if ((uintptr_t)cold % 16) return fail("cold base must be 16-byte aligned");
    if (cold_slots < 0) return fail(std::string(f_.name) + ": negative cold slot count");
    if (location_ == KVGEN_INDEX_HOST &&
        !check_host_pairs(f_.name, kEncode, lifecycle, pairs, n, hot_pages_[lifecycle], cold_slots)) {
      return false;
    }
    if (n == 0) return true;
    bool cold_on_device = false;  // read only by the bulk record load
    if constexpr (!kEncode && DecodeLoad<L>::kRoute == RecordLoad::Bulk) {
      if (!cold_is_device_memory(cold, &cold_on_device)) return false;
    }
    const PairLimits limits{hot_pages_[lifecycle], cold_slots, errors_};
    const int64_t page_bytes = cold_page_bytes(lifecycle);
    const int layers = layers_in(lifecycle);
    const PoolDesc* table = tables_[lifecycle];
    const PagePair* device_pairs = reinterpret_cast<const PagePair*>(pairs);
    PairBatch batch;
    if (location_ == KVGEN_INDEX_DEVICE) {
      const int64_t per_launch = kMaxGridX * pairs_per_cta<kEncode>();
      for (int64_t first = 0; first < n; first += per_launch) {
        const int64_t count = n - first < per_launch ? n - first : per_launch;
        enqueue<kEncode, true>(table, cold, page_bytes, batch, device_pairs + first, count, limits, cold_on_device,
                               layers, stream, priority);
      }
    } else {
      for (int64_t first = 0; first < n; first += kPairsPerLaunch) {
        const int count = (int)(n - first < kPairsPerLaunch ? n - first : kPairsPerLaunch);
        memcpy(batch.pairs, pairs + first, count * sizeof(PagePair));
        enqueue<kEncode, false>(table, cold, page_bytes, batch, nullptr, count, limits, cold_on_device, layers,
                                stream, priority);
      }
    }
    return cuda_ok(cudaGetLastError(), kEncode ? "encode launch" : "decode launch");
  }

  // Whether the cold slots are device memory (the staging ring, a device tier) rather than mapped host
  // memory: decode's bulk record load (DecodeLoad) is only issued for device memory.  A host query,
  // no stream work, so a launch stays graph-capturable.
  static bool cold_is_device_memory(const void* cold, bool* on_device) {
    cudaPointerAttributes attr{};
    if (!cuda_ok(cudaPointerGetAttributes(&attr, cold), "cold base attributes")) return false;
    *on_device = attr.type == cudaMemoryTypeDevice;
    return true;
  }

  // Decode CTAs take DecodePages consecutive pairs each, so a record loads while the previous decodes.
  template <bool kEncode>
  static constexpr int64_t pairs_per_cta() {
    return kEncode ? 1 : DecodePages<L>::kPages;
  }

  // count pairs from batch (host indices) or pairs (device indices), in ceil(count / pairs_per_cta) x
  // layers CTAs.
  template <bool kEncode, bool kDevicePairs>
  static void enqueue(const PoolDesc* table, void* cold, int64_t page_bytes, const PairBatch& batch,
                      const PagePair* pairs, int64_t count, const PairLimits& limits, bool cold_on_device,
                      int layers, cudaStream_t stream, int priority) {
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributePriority;
    attribute.val.priority = priority;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3((count + pairs_per_cta<kEncode>() - 1) / pairs_per_cta<kEncode>(), layers);
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = kEncode ? L::kRecordBytes : decode_smem_bytes<L>();
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = priority == kStreamPriority ? 0 : 1;
    if constexpr (kEncode) {
      cudaLaunchKernelEx(&config, encode_kernel<L, kThreads, kInFlight, kDevicePairs>, table,
                         static_cast<uint8_t*>(cold), page_bytes, batch, pairs, limits);
    } else {
      cudaLaunchKernelEx(&config, decode_kernel<L, kThreads, kInFlight, kDevicePairs>, table,
                         static_cast<const uint8_t*>(cold), page_bytes, batch, pairs, limits, cold_on_device, count);
    }
  }

  static constexpr int64_t kMaxGridX = 0x7FFFFFFF;
  FamilyTables f_;
  kvgen_index_location location_;
  std::vector<PoolDesc*> tables_;
  std::vector<int64_t> hot_pages_;     // per lifecycle
  DeviceErrors* errors_ = nullptr;     // mapped pinned: the kernels' record of skipped indices
  bool scales_set_ = false;            // per-layer scales uploaded (families with L::kLayerScales)
};

}  // namespace codec
}  // namespace kvgen
