// What every Triton AOT shim (select_abi.cpp, pack_abi.cpp) shares: the table of embedded kernel
// images, loaded once per process, and the launch of one of them. Host code only.
//
// kvgen.build.triton_aot writes aot_family.h for each library: KVGEN_AOT_FAMILY, KVGEN_AOT_ARCH,
// the family's constants and kImages, one KernelImage per kernel in the shim's order.
//
// The CUDA driver is opened with dlopen and seven of its entry points are called: the library
// links no CUDA library (no static cudart: it stays the size of its images), and loading it on a
// machine without a driver still works (the first launch then says why it cannot run).
#pragma once

#include <cuda.h>   // the driver's types only
#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace {

struct KernelImage {
  const char* name;             // the kernel's name in its shim's table
  const unsigned char* image;   // fatbinary: one cubin per target of the arch
  const char* symbol;           // the Triton kernel's name in the image
  unsigned shared_bytes;        // dynamic shared memory Triton asks for (at most 48 KiB: checked at build)
  unsigned threads;             // num_warps * 32
};

thread_local std::string last_error;

int fail(int code, const std::string& message) {
  last_error = message;
  return code;
}

constexpr int64_t kMaxGridX = 2147483647;
constexpr int64_t kMaxGridYZ = 65535;

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct Grid {
  unsigned x = 1, y = 1, z = 1;
  explicit Grid(unsigned x_, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// The driver entry points the shims use (CUDA 12.0 and newer: context-independent loading).
struct Driver {
  CUresult (*init)(unsigned) = nullptr;
  CUresult (*error_string)(CUresult, const char**) = nullptr;
  CUresult (*library_load_data)(CUlibrary*, const void*, CUjit_option*, void**, unsigned, CUlibraryOption*, void**,
                                unsigned) = nullptr;
  CUresult (*library_get_kernel)(CUkernel*, CUlibrary, const char*) = nullptr;
  CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                            void**, void**) = nullptr;
  CUresult (*ctx_get_device)(CUdevice*) = nullptr;
  CUresult (*device_get_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  std::string error;   // why the driver is unusable; empty when it is

  Driver() {
    void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      error = std::string("the CUDA driver (libcuda.so.1) cannot be opened: ") + dlerror();
      return;
    }
    bool found = bind(handle, "cuInit", init) && bind(handle, "cuGetErrorString", error_string) &&
                 bind(handle, "cuLibraryLoadData", library_load_data) &&
                 bind(handle, "cuLibraryGetKernel", library_get_kernel) && bind(handle, "cuLaunchKernel", launch_kernel) &&
                 bind(handle, "cuCtxGetDevice", ctx_get_device) &&
                 bind(handle, "cuDeviceGetAttribute", device_get_attribute);
    if (!found) error = "the CUDA driver is older than 12.0 (no cuLibraryLoadData)";
  }

  template <typename F>
  static bool bind(void* handle, const char* name, F& fn) {
    fn = reinterpret_cast<F>(dlsym(handle, name));
    return fn != nullptr;
  }

  std::string describe(CUresult result) const {
    const char* text = nullptr;
    if (error_string == nullptr || error_string(result, &text) != CUDA_SUCCESS || text == nullptr)
      return "CUDA error " + std::to_string(static_cast<int>(result));
    return text;
  }
};

// The kernels of `images`, loaded with context-independent loading (cudaLibraryLoadData: every
// device gets them on first use). A load failure sticks and every launch reports it.
template <size_t N>
class KernelTable {
 public:
  KernelTable(const KernelImage (&images)[N], const char* arch, int load_error) : images_(images) {
    if (!driver_.error.empty()) {
      status_ = load_error;
      error_ = std::string("loading the kernels (") + arch + "): " + driver_.error;
      return;
    }
    CUresult e = driver_.init(0);
    for (size_t k = 0; k < N && e == CUDA_SUCCESS; ++k) {
      CUlibrary library;
      e = driver_.library_load_data(&library, images[k].image, nullptr, nullptr, 0, nullptr, nullptr, 0);
      if (e == CUDA_SUCCESS) e = driver_.library_get_kernel(&kernels_[k], library, images[k].symbol);
      if (e != CUDA_SUCCESS) {
        status_ = load_error;
        error_ = std::string("loading kernel ") + images[k].name + " (" + arch + "): " + driver_.describe(e);
      }
    }
    if (e != CUDA_SUCCESS && status_ == 0) {
      status_ = load_error;
      error_ = std::string("loading the kernels (") + arch + "): " + driver_.describe(e);
    }
  }

  // Triton kernels take two trailing scratch pointers (global, profile): `args` ends with them,
  // null, as these kernels need neither (checked at build).
  // A CUkernel launches as a CUfunction in the current context (the stream's device must be current).
  int launch(size_t k, Grid grid, void** args, void* stream) const {
    if (status_ != 0) return fail(status_, error_);
    CUresult e = driver_.launch_kernel(reinterpret_cast<CUfunction>(kernels_[k]), grid.x, grid.y, grid.z,
                                       images_[k].threads, 1, 1, images_[k].shared_bytes, static_cast<CUstream>(stream),
                                       args, nullptr);
    if (e != CUDA_SUCCESS) return fail(static_cast<int>(e), std::string(images_[k].name) + ": " + driver_.describe(e));
    return 0;
  }

  // The multiprocessors of the current context's device (a persistent grid's size).
  int sm_count(int* out) const {
    if (status_ != 0) return fail(status_, error_);
    CUdevice device;
    CUresult e = driver_.ctx_get_device(&device);
    if (e == CUDA_SUCCESS) e = driver_.device_get_attribute(out, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device);
    if (e != CUDA_SUCCESS) return fail(static_cast<int>(e), "the current device's multiprocessors: " + driver_.describe(e));
    return 0;
  }

 private:
  Driver driver_;
  const KernelImage (&images_)[N];
  CUkernel kernels_[N] = {};
  int status_ = 0;
  std::string error_;
};

constexpr int kInvalid = -1;   // KVGEN_SELECT_EINVAL, KVGEN_PACK_EINVAL

int invalid(const char* call, const std::string& what) { return fail(kInvalid, std::string(call) + ": " + what); }

}  // namespace
