// kvgen/kernels/cuda/codec_abi.cuh -- the extern "C" functions of kvgen_codec.h for one family.
//
// Included exactly once, at the end of a generated codec.cu, after it has defined
//   kvgen::family::CodecT   (kvgen::codec::Codec<Layer, threads, in_flight>)
//   kvgen::family::kTables  (kvgen::codec::FamilyTables)
#pragma once

#include "codec_host.cuh"
#include "codec_staged.cuh"

struct kvgen_codec {
  kvgen::family::CodecT* impl;
  kvgen::codec::Staged<kvgen::family::CodecT> staged;   // ABI v2: empty until set_staging
};

// A null codec is refused by every call (a destroyed one cannot be told apart from a live one in C).
static bool kvgen_live(const kvgen_codec* codec) {
  return codec != nullptr || kvgen::fail(std::string(kvgen::family::kTables.name) + ": null codec");
}

extern "C" {

int kvgen_abi_version(void) { return KVGEN_ABI_VERSION; }

const char* kvgen_family_name(void) { return kvgen::family::kTables.name; }

const char* kvgen_last_error(void) { return kvgen::last_error().c_str(); }

kvgen_codec* kvgen_codec_configure(const kvgen_pool_desc* descs, int64_t num_descs, kvgen_index_location location) {
  kvgen::family::CodecT* impl = kvgen::family::CodecT::configure(kvgen::family::kTables, descs, num_descs, location);
  return impl ? new kvgen_codec{impl} : nullptr;
}

void kvgen_codec_destroy(kvgen_codec* codec) {
  if (codec) delete codec->impl;
  delete codec;
}

int kvgen_codec_num_lifecycles(const kvgen_codec* codec) { return codec ? codec->impl->num_lifecycles() : 0; }

int64_t kvgen_codec_query_cold_page_bytes(const kvgen_codec* codec, int lifecycle) {
  return codec ? codec->impl->cold_page_bytes(lifecycle) : 0;
}

int kvgen_codec_get_batching_layer_group_id(const kvgen_codec*, int lifecycle) { return lifecycle; }

kvgen_index_location kvgen_codec_query_page_index_location(const kvgen_codec* codec, int) {
  return codec ? codec->impl->location() : KVGEN_INDEX_HOST;
}

int kvgen_codec_encode(kvgen_codec* codec, int lifecycle, void* cold_base, const kvgen_page_pair* pairs,
                       int64_t num_pairs, void* stream) {
  return kvgen_live(codec) && codec->impl->encode(lifecycle, cold_base, pairs, num_pairs, static_cast<cudaStream_t>(stream));
}

int kvgen_codec_decode(kvgen_codec* codec, int lifecycle, const void* cold_base, const kvgen_page_pair* pairs,
                       int64_t num_pairs, void* stream) {
  return kvgen_live(codec) && codec->impl->decode(lifecycle, cold_base, pairs, num_pairs, static_cast<cudaStream_t>(stream));
}

// ---- Bounds-checked entry points (kvgen_codec.h, second block)

kvgen_codec* kvgen_codec_configure_checked(const kvgen_pool_extent* pools, int64_t num_pools,
                                           kvgen_index_location location) {
  if (pools == nullptr || num_pools < 0) {
    kvgen::fail(std::string(kvgen::family::kTables.name) + ": null pool array or negative pool count");
    return nullptr;
  }
  std::vector<kvgen_pool_desc> descs;
  std::vector<int64_t> pages;
  for (int64_t i = 0; i < num_pools; ++i) {
    descs.push_back(kvgen_pool_desc{pools[i].base, pools[i].page_stride_bytes});
    pages.push_back(pools[i].num_pages);
  }
  kvgen::family::CodecT* impl =
      kvgen::family::CodecT::configure(kvgen::family::kTables, descs.data(), num_pools, location, pages.data());
  return impl ? new kvgen_codec{impl} : nullptr;
}

int kvgen_codec_encode_checked(kvgen_codec* codec, int lifecycle, void* cold_base, int64_t cold_slots,
                               const kvgen_page_pair* pairs, int64_t num_pairs, void* stream) {
  return kvgen_live(codec) &&
         codec->impl->encode(lifecycle, cold_base, cold_slots, pairs, num_pairs, static_cast<cudaStream_t>(stream));
}

int kvgen_codec_decode_checked(kvgen_codec* codec, int lifecycle, const void* cold_base, int64_t cold_slots,
                               const kvgen_page_pair* pairs, int64_t num_pairs, void* stream) {
  return kvgen_live(codec) &&
         codec->impl->decode(lifecycle, cold_base, cold_slots, pairs, num_pairs, static_cast<cudaStream_t>(stream));
}

int kvgen_codec_check_device_errors(kvgen_codec* codec) {
  return kvgen_live(codec) && codec->impl->check_device_errors();
}

int kvgen_codec_layer_scale_buffers(const kvgen_codec*) { return kvgen::family::CodecT::layer_scale_buffers(); }

int kvgen_codec_set_layer_scales(kvgen_codec* codec, const float* G, const float* Q, int64_t n) {
  return kvgen_live(codec) && codec->impl->set_layer_scales(G, Q, n);
}

int kvgen_codec_set_staging(kvgen_codec* codec, void* staging, int64_t staging_bytes) {
  return codec->staged.set(*codec->impl, staging, staging_bytes);
}

int64_t kvgen_codec_staging_bytes(const kvgen_codec* codec) { return codec->staged.bytes(); }

int kvgen_codec_offload(kvgen_codec* codec, int lifecycle, void* host_cold, int64_t num_cold_slots,
                        const kvgen_page_pair* pairs, int64_t num_pairs, void* stream) {
  return codec->staged.offload(*codec->impl, lifecycle, host_cold, num_cold_slots, pairs, num_pairs,
                               static_cast<cudaStream_t>(stream));
}

int kvgen_codec_onboard(kvgen_codec* codec, int lifecycle, const void* host_cold, int64_t num_cold_slots,
                        const kvgen_page_pair* pairs, int64_t num_pairs, void* stream) {
  return codec->staged.onboard(*codec->impl, lifecycle, host_cold, num_cold_slots, pairs, num_pairs,
                               static_cast<cudaStream_t>(stream));
}

}  // extern "C"
