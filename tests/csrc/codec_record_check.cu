// Driver for the codec's record code (kvgen/kernels/cuda/codec_kernels.cuh: Layer, Quantized, Side,
// all __host__ __device__) and its per-layer scale tables (codec_host.cuh: layer_scale_rows,
// lifecycle_scale_rows) on the CPU, for one generated family: the kernels' own encode and decode
// of every layer record, one lane walking every work item, against the oracle in
// tests/test_layer_scales.py.  No GPU, no driver: nothing here calls CUDA.
//
// Build: nvcc -x cu -std=c++17 --fmad=false -I<repo>/kvgen/kernels/include -I<repo>/kvgen/kernels/cuda \
//          -DKVGEN_FAMILY_SOURCE='"<generated>/<family>/codec.cu"' tests/csrc/codec_record_check.cu
//
//   codec_record_check < in > out
//     in:  one hot page of every (layer, part), layers 0..L-1, parts in descriptor order; then
//          float G[n], float Q[n] (n = L x per-layer buffers, layer-major, as
//          kvgen_codec_set_layer_scales takes them; none for a family with compiled-in scales)
//     out: the cold page of every lifecycle (its layers' records, in lifecycle order), then every
//          lifecycle's page decoded back: each of its layers' parts, in lifecycle order
//   codec_record_check --errors
//     the message of each refused scale array (wrong count, NaN, Inf, 0, negative), one a line
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include KVGEN_FAMILY_SOURCE

namespace kc = kvgen::codec;
using L = kvgen::family::Layer;

namespace {

constexpr const kc::FamilyTables& kF = kvgen::family::kTables;
constexpr kc::Lanes kOneLane{0u, 1u};

bool read_exact(void* dst, size_t bytes) { return std::fread(dst, 1, bytes, stdin) == bytes; }
void write_all(const void* src, size_t bytes) { std::fwrite(src, 1, bytes, stdout); }

// Descriptors of one layer's parts, each pointing at its page (page index 0).
std::vector<kc::PoolDesc> layer_pools(std::vector<std::vector<uint8_t>>& pages) {
  std::vector<kc::PoolDesc> pools;
  for (auto& page : pages) pools.push_back(kc::PoolDesc{page.data(), (int64_t)page.size()});
  return pools;
}

int roundtrip() {
  // hot[l][p]: one page of part p of layer l, 16-byte aligned as the pools are
  std::vector<std::vector<std::vector<uint8_t>>> hot(kF.num_layers);
  for (auto& layer : hot) {
    for (int p = 0; p < L::kNumParts; ++p) {
      layer.emplace_back(L::kPageBytes[p]);
      if (!read_exact(layer.back().data(), layer.back().size())) return 2;
    }
  }
  const int64_t n = (int64_t)kF.num_layers * L::kLayerScaleParts;
  std::vector<float> G(n), Q(n);
  if (!read_exact(G.data(), n * sizeof(float)) || !read_exact(Q.data(), n * sizeof(float))) return 2;
  // a family without per-layer buffers reads no scales: its parts take the compiled-in G, Q
  std::vector<kc::LayerScale> rows((size_t)kF.num_layers * L::kNumParts, kc::LayerScale{1.0f, 1.0f});
  if (L::kLayerScales && !kc::layer_scale_rows(kF, L::kPartLayerScales, G.data(), Q.data(), n, rows)) {
    std::fprintf(stderr, "%s\n", kvgen::last_error().c_str());
    return 1;
  }
  std::vector<std::vector<uint8_t>> cold(kF.num_lifecycles);
  for (int lc = 0; lc < kF.num_lifecycles; ++lc) {
    const std::vector<kc::LayerScale> table = kc::lifecycle_scale_rows(kF, rows, lc);
    const int layers = kF.lifecycle_begin[lc + 1] - kF.lifecycle_begin[lc];
    cold[lc].assign((size_t)layers * L::kRecordBytes, 0xA5);  // padding must be written
    for (int j = 0; j < layers; ++j) {
      const std::vector<kc::PoolDesc> pools = layer_pools(hot[kF.lifecycle_layers[kF.lifecycle_begin[lc] + j]]);
      L::encode(cold[lc].data() + (size_t)j * L::kRecordBytes, pools.data(), 0, table.data() + j * L::kNumParts,
                kOneLane);
    }
    write_all(cold[lc].data(), cold[lc].size());
  }
  for (int lc = 0; lc < kF.num_lifecycles; ++lc) {
    const std::vector<kc::LayerScale> table = kc::lifecycle_scale_rows(kF, rows, lc);
    const int layers = kF.lifecycle_begin[lc + 1] - kF.lifecycle_begin[lc];
    for (int j = 0; j < layers; ++j) {
      std::vector<std::vector<uint8_t>> out;
      for (int p = 0; p < L::kNumParts; ++p) out.emplace_back(L::kPageBytes[p], 0xA5);
      const std::vector<kc::PoolDesc> pools = layer_pools(out);
      L::decode(cold[lc].data() + (size_t)j * L::kRecordBytes, pools.data(), 0, table.data() + j * L::kNumParts,
                kOneLane);
      for (const auto& page : out) write_all(page.data(), page.size());
    }
  }
  return 0;
}

void refused(const char* name, const std::vector<float>& G, const float* Q, int64_t n) {
  std::vector<kc::LayerScale> rows;
  kvgen::last_error().clear();
  const bool ok = kc::layer_scale_rows(kF, L::kPartLayerScales, G.empty() ? nullptr : G.data(), Q, n, rows);
  std::printf("%s: %d %s\n", name, ok ? 1 : 0, kvgen::last_error().c_str());
}

int errors() {
  const int64_t n = (int64_t)kF.num_layers * L::kLayerScaleParts;
  std::vector<float> good(n, 0.5f);
  refused("ok", good, nullptr, n);
  refused("short", good, nullptr, n - 1);
  refused("null G", {}, nullptr, n);
  for (const float bad : {NAN, INFINITY, 0.0f, -2.0f}) {
    std::vector<float> G = good;
    G[n - 1] = bad;
    refused("bad G", G, nullptr, n);
    std::vector<float> Q = good;
    Q[1] = bad;
    refused("bad Q", good, Q.data(), n);
  }
  std::vector<float> tiny = good;
  tiny[0] = 1e-45f;  // 1/G overflows to Inf
  refused("1/G", tiny, nullptr, n);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--errors") == 0) return errors();
  return roundtrip();
}
