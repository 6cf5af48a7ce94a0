// core: the CUDA stream functions of a build without the CUDA backend: each refuses.
#include "core/cuda_stream.h"
#include "core/error.h"

namespace infinigen::cuda_stream {

void* create_stream() {
  throw_cuda_not_compiled();
}
void destroy_stream(void*) noexcept {}
void synchronize(void*) {
  throw_cuda_not_compiled();
}
void wait(void*, void*) {
  throw_cuda_not_compiled();
}
void* acquire_event() {
  throw_cuda_not_compiled();
}
void release_event(void*) noexcept {}
void record(void*, void*) {
  throw_cuda_not_compiled();
}
bool ready(void*) {
  throw_cuda_not_compiled();
}
void synchronize_event(void*) {
  throw_cuda_not_compiled();
}
double elapsed_seconds(void*, void*) {
  throw_cuda_not_compiled();
}
void copy_async(void*, Device, const void*, Device, size_t, void*) {
  throw_cuda_not_compiled();
}

void check(int code, const char* what) {
  if (code != 0) fail("CUDA ", what, " failed: error ", code);
}

void host_func(void*, void (*)(void*), void*) {
  throw_cuda_not_compiled();
}
void copy_pieces(const CopyChunk*, size_t, void*) {
  throw_cuda_not_compiled();
}
void gather_selected_rows(const SelectedRows&, void*) {
  throw_cuda_not_compiled();
}
void match_cached_rows(const CachedRows&, int32_t*, int32_t*, void*) {
  throw_cuda_not_compiled();
}
void store_cached_rows(const CachedRows&, const void*, const void*, int64_t, int64_t, void*) {
  throw_cuda_not_compiled();
}

}  // namespace infinigen::cuda_stream
