// kernels/cuda/emulation: one kernel launch on the CPU. The blocks of the grid run one after the
// other on the stream's worker; a block's threads are fibers (Boost.Context) that run until they
// reach a barrier or a warp collective, so that every thread of the block sees the others'
// writes exactly where CUDA guarantees it, and nowhere else is a switch needed.
//
// Barriers count arrivals: a barrier completes when every thread that has not exited has
// arrived (an exited thread counts as arrived, as on the hardware), whichever __syncthreads call
// each thread waits in. A warp collective completes when every lane of its mask has arrived at
// the same collective. When no thread can run and the block has not finished, the block is
// deadlocked: the kernel fails with a description of who waits where.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <boost/context/fiber.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_emulation/device_language.h"
#include "kernels/cuda/emulation/device_state.h"

namespace infinigen::cuda_emulation {
namespace {

namespace context = boost::context;

constexpr int kWarp = 32;
constexpr size_t kStackBytes = 256 * 1024;

// Fiber stacks, reused from block to block by the host thread that runs them; each has an
// inaccessible guard page below it, so an overflow faults instead of corrupting a neighbour.
class StackPool {
 public:
  StackPool() : page_(static_cast<size_t>(sysconf(_SC_PAGESIZE))) {}
  ~StackPool() {
    for (void* base : free_) munmap(base, kStackBytes + page_);
  }
  StackPool(const StackPool&) = delete;
  StackPool& operator=(const StackPool&) = delete;

  context::stack_context allocate() {
    void* base = nullptr;
    if (!free_.empty()) {
      base = free_.back();
      free_.pop_back();
    } else {
      base = mmap(nullptr, kStackBytes + page_, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (base == MAP_FAILED) throw std::bad_alloc();
      mprotect(base, page_, PROT_NONE);
    }
    context::stack_context stack;
    stack.size = kStackBytes;
    stack.sp = static_cast<char*>(base) + page_ + kStackBytes;
    return stack;
  }
  void deallocate(context::stack_context& stack) noexcept {
    free_.push_back(static_cast<char*>(stack.sp) - kStackBytes - page_);
  }

 private:
  size_t page_;
  std::vector<void*> free_;
};

thread_local StackPool stack_pool;

struct PooledStack {
  context::stack_context allocate() { return stack_pool.allocate(); }
  void deallocate(context::stack_context& stack) noexcept { stack_pool.deallocate(stack); }
};

enum class Status { Runnable, AtBarrier, AtCollective, Exited };

struct Thread {
  uint3 index{0, 0, 0};
  int lane = 0;
  int warp = 0;
  Status status = Status::Runnable;
  context::fiber fiber;      // the thread while it is suspended
  context::fiber scheduler;  // where it returns to while it runs
  uint64_t result = 0;       // of the collective it waited in
};

struct Collective {
  CollectiveOp op = CollectiveOp::Shuffle;
  unsigned mask = 0;
  unsigned arrived = 0;  // 0: no collective under way in this warp
  std::array<uint64_t, kWarp> values{};
  std::array<int, kWarp> args{};
  std::array<int, kWarp> widths{};
};

const char* op_name(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::Shuffle:
      return "__shfl_sync";
    case CollectiveOp::ShuffleUp:
      return "__shfl_up_sync";
    case CollectiveOp::ShuffleDown:
      return "__shfl_down_sync";
    case CollectiveOp::ShuffleXor:
      return "__shfl_xor_sync";
    case CollectiveOp::Ballot:
      return "__ballot_sync";
    case CollectiveOp::Any:
      return "__any_sync";
    case CollectiveOp::All:
      return "__all_sync";
    case CollectiveOp::SyncWarp:
      return "__syncwarp";
  }
  return "a warp collective";
}

std::string hex(unsigned value) {
  char text[16];
  std::snprintf(text, sizeof(text), "0x%08x", value);
  return text;
}

// "0-15, 17" for the set bits of a lane mask, offset by `first` (a warp's first thread).
std::string ranges(const std::vector<int>& ids) {
  std::ostringstream out;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (i > 0) out << ", ";
    out << ids[i];
    if (j > i) out << "-" << ids[j];
    i = j + 1;
  }
  return out.str();
}

class Block;
thread_local Block* current_block = nullptr;
thread_local Thread* current_thread = nullptr;

class Block {
 public:
  Block(const KernelLaunch& launch, uint3 block_index) : launch_(launch), index_(block_index) {
    const dim3 dim = launch.block;
    const int count = static_cast<int>(dim.x * dim.y * dim.z);
    threads_.resize(static_cast<size_t>(count));
    warps_.resize(static_cast<size_t>((count + kWarp - 1) / kWarp));
    for (int id = 0; id < count; ++id) {
      Thread& t = threads_[static_cast<size_t>(id)];
      const unsigned u = static_cast<unsigned>(id);
      t.index = uint3{u % dim.x, u / dim.x % dim.y, u / (dim.x * dim.y)};
      t.lane = id % kWarp;
      t.warp = id / kWarp;
      t.fiber =
          context::fiber(std::allocator_arg, PooledStack{}, [this, &t](context::fiber&& scheduler) {
            t.scheduler = std::move(scheduler);
            launch_.thread_body();
            exit_thread(t);
            return std::move(t.scheduler);
          });
    }
  }

  // Runs the block to its end; throws DeviceFault when it cannot finish.
  //
  // Schedule: each warp in turn runs as far as it can (its lanes round-robin, since they meet at
  // collectives) before the next warp starts. A GPU gives no order between warps, and this one is
  // the least forgiving of a missing barrier: a warp that overwrites shared memory another warp
  // has yet to read, or reads what another has yet to write, does so before that warp has run.
  void run() {
    current_block = this;
    while (exited_ < static_cast<int>(threads_.size())) {
      bool progressed = false;
      for (size_t first = 0; first < threads_.size(); first += kWarp) {
        const size_t end = std::min(threads_.size(), first + kWarp);
        for (bool warp_progressed = true; warp_progressed;) {
          warp_progressed = false;
          for (size_t id = first; id < end; ++id) {
            Thread& t = threads_[id];
            if (t.status != Status::Runnable) continue;
            current_thread = &t;
            current_indices.thread_idx = t.index;
            t.fiber = std::move(t.fiber).resume();
            warp_progressed = progressed = true;
            if (!fault_.empty()) abort_block();
          }
        }
      }
      if (!progressed) {
        fault_ = deadlock_report();
        abort_block();
      }
    }
    current_block = nullptr;
    current_thread = nullptr;
  }

  void barrier() {
    Thread& t = *current_thread;
    ++barrier_arrived_;
    if (barrier_complete()) {
      release_barrier();
      return;
    }
    t.status = Status::AtBarrier;
    yield(t);
  }

  uint64_t collective(CollectiveOp op, unsigned mask, uint64_t value, int arg, int width) {
    Thread& t = *current_thread;
    const unsigned bit = 1u << t.lane;
    if ((mask & bit) == 0) {
      fault(op_name(op) + std::string(" with mask ") + hex(mask) + " called by lane " +
            std::to_string(t.lane) + ", which the mask does not name");
    }
    if (width <= 0 || width > kWarp || (width & (width - 1)) != 0) {
      fault(op_name(op) + std::string(" with width ") + std::to_string(width) +
            " (a power of 2 up to 32)");
    }
    const unsigned missing = mask & ~live_lanes(t.warp);
    if (missing != 0) {
      fault(op_name(op) + std::string(" with mask ") + hex(mask) + " in warp " +
            std::to_string(t.warp) + " names lanes that have exited or do not exist (" +
            hex(missing) + ")");
    }
    Collective& c = warps_[static_cast<size_t>(t.warp)];
    if (c.arrived != 0 && (c.op != op || c.mask != mask)) {
      fault("warp " + std::to_string(t.warp) + ": lane " + std::to_string(t.lane) + " calls " +
            op_name(op) + " with mask " + hex(mask) + " while lanes " + hex(c.arrived) +
            " wait in " + op_name(c.op) + " with mask " + hex(c.mask));
    }
    c.op = op;
    c.mask = mask;
    c.arrived |= bit;
    c.values[static_cast<size_t>(t.lane)] = value;
    c.args[static_cast<size_t>(t.lane)] = arg;
    c.widths[static_cast<size_t>(t.lane)] = width;
    if (c.arrived == mask) {
      if (std::string problem = complete(c, t.warp); !problem.empty()) fault(std::move(problem));
      return t.result;
    }
    t.status = Status::AtCollective;
    yield(t);
    return t.result;
  }

  unsigned active_mask() const { return live_lanes(current_thread->warp); }

  [[noreturn]] void fault(std::string message) {
    fault_ = std::move(message);
    yield(*current_thread);
    std::abort();  // not reached: the block is unwound instead of resumed
  }

 private:
  void yield(Thread& t) { t.scheduler = std::move(t.scheduler).resume(); }

  bool barrier_complete() const {
    return barrier_arrived_ > 0 && barrier_arrived_ == static_cast<int>(threads_.size()) - exited_;
  }

  void release_barrier() {
    for (Thread& t : threads_)
      if (t.status == Status::AtBarrier) t.status = Status::Runnable;
    barrier_arrived_ = 0;
  }

  unsigned live_lanes(int warp) const {
    unsigned lanes = 0;
    for (int lane = 0; lane < kWarp; ++lane) {
      const size_t id = static_cast<size_t>(warp * kWarp + lane);
      if (id < threads_.size() && threads_[id].status != Status::Exited) lanes |= 1u << lane;
    }
    return lanes;
  }

  void exit_thread(Thread& t) {
    t.status = Status::Exited;
    ++exited_;
    const Collective& c = warps_[static_cast<size_t>(t.warp)];
    if (c.arrived != 0 && (c.mask & (1u << t.lane)) != 0 && fault_.empty()) {
      fault_ = "lane " + std::to_string(t.lane) + " of warp " + std::to_string(t.warp) +
               " exited while lanes " + hex(c.arrived) + " wait for it in " + op_name(c.op) +
               " with mask " + hex(c.mask);
    }
    if (barrier_complete()) release_barrier();
  }

  // Every lane of the mask has arrived: each gets its result, as the hardware computes it.
  // Returns what is wrong with the collective, if anything.
  std::string complete(Collective& c, int warp) {
    unsigned ballot = 0;
    for (int lane = 0; lane < kWarp; ++lane)
      if ((c.mask >> lane & 1u) && c.values[static_cast<size_t>(lane)] != 0) ballot |= 1u << lane;
    for (int lane = 0; lane < kWarp; ++lane) {
      if ((c.mask >> lane & 1u) == 0) continue;
      Thread& t = threads_[static_cast<size_t>(warp * kWarp + lane)];
      const size_t l = static_cast<size_t>(lane);
      const int width = c.widths[l], arg = c.args[l];
      const int first = lane & ~(width - 1), last = first + width - 1;
      int source = lane;
      switch (c.op) {
        case CollectiveOp::Shuffle:
          source = first + (arg & (width - 1));
          break;
        case CollectiveOp::ShuffleUp:
          source = lane - arg >= first ? lane - arg : lane;
          break;
        case CollectiveOp::ShuffleDown:
          source = lane + arg <= last ? lane + arg : lane;
          break;
        case CollectiveOp::ShuffleXor:
          source = (lane ^ arg) <= last ? lane ^ arg : lane;  // earlier groups may be read
          break;
        case CollectiveOp::Ballot:
          t.result = ballot;
          break;
        case CollectiveOp::Any:
          t.result = ballot != 0;
          break;
        case CollectiveOp::All:
          t.result = ballot == c.mask;
          break;
        case CollectiveOp::SyncWarp:
          t.result = 0;
          break;
      }
      if (c.op == CollectiveOp::Shuffle || c.op == CollectiveOp::ShuffleUp ||
          c.op == CollectiveOp::ShuffleDown || c.op == CollectiveOp::ShuffleXor) {
        if (source < 0 || source >= kWarp || (c.mask >> source & 1u) == 0) {
          c.arrived = 0;
          return std::string(op_name(c.op)) + " with mask " + hex(c.mask) + ": lane " +
                 std::to_string(lane) + " reads lane " + std::to_string(source) +
                 ", which the mask does not name";
        }
        t.result = c.values[static_cast<size_t>(source)];
      }
      if (t.status == Status::AtCollective) t.status = Status::Runnable;
    }
    c.arrived = 0;
    return {};
  }

  // No thread can run: say who waits where.
  std::string deadlock_report() const {
    std::vector<int> at_barrier;
    for (size_t i = 0; i < threads_.size(); ++i)
      if (threads_[i].status == Status::AtBarrier) at_barrier.push_back(static_cast<int>(i));
    std::ostringstream out;
    out << "deadlock: ";
    if (!at_barrier.empty()) {
      out << "__syncthreads cannot complete: threads " << ranges(at_barrier) << " wait at it";
    }
    for (size_t w = 0; w < warps_.size(); ++w) {
      const Collective& c = warps_[w];
      if (c.arrived == 0) continue;
      std::vector<int> waiting, awaited;
      for (int lane = 0; lane < kWarp; ++lane) {
        const int id = static_cast<int>(w) * kWarp + lane;
        if (c.arrived >> lane & 1u)
          waiting.push_back(id);
        else if (c.mask >> lane & 1u)
          awaited.push_back(id);
      }
      if (out.tellp() > 10) out << "; ";
      out << "threads " << ranges(waiting) << " wait in " << op_name(c.op) << " (mask "
          << hex(c.mask) << ") for threads " << ranges(awaited)
          << (at_barrier.empty() ? "" : ", which wait at __syncthreads");
    }
    return out.str();
  }

  [[noreturn]] void abort_block() {
    std::string message = describe_site(launch_.site) + ", block (" + std::to_string(index_.x) +
                          ", " + std::to_string(index_.y) + ", " + std::to_string(index_.z) +
                          "): " + fault_;
    current_block = nullptr;
    current_thread = nullptr;
    threads_.clear();  // unwinds every suspended fiber
    throw DeviceFault{cudaErrorLaunchFailure, std::move(message)};
  }

  const KernelLaunch& launch_;
  uint3 index_;
  std::vector<Thread> threads_;
  std::vector<Collective> warps_;
  int exited_ = 0;
  int barrier_arrived_ = 0;
  std::string fault_;
};

Block& running_block(const char* what) {
  if (current_block == nullptr) {
    std::fprintf(stderr, "cuda emulation: %s called outside a kernel\n", what);
    std::abort();
  }
  return *current_block;
}

thread_local void* current_dynamic_shared = nullptr;

}  // namespace

void barrier() {
  running_block("__syncthreads").barrier();
}

uint64_t warp_collective(CollectiveOp op, unsigned mask, uint64_t value, int arg, int width) {
  return running_block(op_name(op)).collective(op, mask, value, arg, width);
}

unsigned active_mask() {
  return running_block("__activemask").active_mask();
}

void* dynamic_shared_memory() {
  return current_dynamic_shared;
}

void device_trap(const char* what) {
  running_block(what).fault(std::string(what) + " in device code");
}

void run_kernel(const KernelLaunch& launch) {
  for (const PointerArgument& argument : launch.pointers) {
    const std::optional<Allocation> allocation = find_allocation(argument.pointer);
    if (!allocation) {
      throw DeviceFault{cudaErrorIllegalAddress,
                        describe_site(launch.site) + ": argument " +
                            std::to_string(argument.index) + " is " +
                            describe_pointer(argument.pointer) +
                            "; a kernel reads only device memory (cudaMalloc) and pinned memory "
                            "(cudaHostAlloc)"};
    }
  }
  // Dynamic shared memory: uninitialised on a GPU, NaN-poisoned here before every block.
  std::vector<float> shared((launch.shared_bytes + sizeof(float) - 1) / sizeof(float));
  current_dynamic_shared = shared.empty() ? nullptr : shared.data();
  current_indices.grid_dim = launch.grid;
  current_indices.block_dim = launch.block;
  for (unsigned z = 0; z < launch.grid.z; ++z) {
    for (unsigned y = 0; y < launch.grid.y; ++y) {
      for (unsigned x = 0; x < launch.grid.x; ++x) {
        if (poison_enabled() && !shared.empty()) {
          std::memset(shared.data(), 0xff, shared.size() * sizeof(float));
        }
        current_indices.block_idx = uint3{x, y, z};
        Block block(launch, uint3{x, y, z});
        block.run();
      }
    }
  }
  current_dynamic_shared = nullptr;
}

}  // namespace infinigen::cuda_emulation
