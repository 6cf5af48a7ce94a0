// core: how many OpenMP threads the CPU backend's kernels use, and why not always every core.
//
// OpenMP's worker threads spin at the end of a parallel region before they sleep (libgomp's
// default spins for a few milliseconds), so that the next region starts at once. On an idle
// machine that is what makes small ops fast. On a machine whose other processes keep cores busy
// (every GPU server's host: its other jobs, our own transfer and gather threads) a team as large
// as the cores must wait at every barrier for a member the kernel has descheduled, while the
// members that arrived spin away the time slice that member needs: the built-in model's default
// run took 25 s instead of 0.24 s beside two CPU-bound processes on two cores
// (docs/benchmarks/cpu-contention.md). A passive wait policy avoids that, but costs every region
// a wake-up (0.38 s idle).
//
// So by default the team is sized to the cores other processes leave free: the cores this process
// may run on less the CPU time the others used on them since the last look, measured from
// /proc/stat and /proc/self/stat at most every 100 ms at the safe points of a forward pass
// (adapt_cpu_threads), never fewer than one; until the first interval is measured, less the
// threads of other processes runnable when the team was configured (a short run is over before
// a first interval would end). Idle, that is every core and the spinning default;
// busy, a smaller team whose barriers wait for no descheduled member. A count the user chose
// (--threads N, or OMP_NUM_THREADS) is kept as it is.
#pragma once

namespace infinigen {

// `fixed` > 0: exactly that many threads; 0: OMP_NUM_THREADS when it is set, else adapt between
// one and every core this process may run on, measuring from now. Without a call the default (0)
// is taken at the first adapt_cpu_threads, the first layer of the first forward pass.
// Call it on the thread that runs the forward passes (an OpenMP thread count belongs to the
// thread that sets it).
void configure_cpu_threads(int fixed);
// At a safe point between parallel regions of the configuring thread: when adapting and at least
// 100 ms have passed since the last look, sizes the team to the cores others leave free.
void adapt_cpu_threads();
// What a run reports: the team size now, the most it may be, and whether it adapts.
struct CpuThreads {
  int now = 1;
  int most = 1;
  bool adapts = false;
};
CpuThreads cpu_threads();

// CPU time spent on the cores this process may run on, in seconds: by anything, by this process.
struct CpuTimes {
  double busy = 0;
  double self = 0;
};
// The cores' worth of CPU time other processes used between two readings `seconds` apart.
double others_busy_cores(const CpuTimes& earlier, const CpuTimes& later, double seconds);
// The team size for `cores` cores when other processes keep `others_busy` cores' worth busy: the
// free cores, rounded, at least one.
int free_core_threads(int cores, double others_busy);

}  // namespace infinigen
