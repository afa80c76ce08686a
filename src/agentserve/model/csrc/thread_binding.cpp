// Pin each thread of the intra-op (OpenMP) team to one CPU: team member t to cpus[t].
//
// Why: a decode step is a few hundred short parallel ops, each ending at a barrier. Unpinned,
// when anything else ran on a core (the HTTP event loop, a client, a compile), the kernel woke
// the sleeping team member onto the master's core, where it waited until the master reached
// the barrier: the op ran serially. perf sched in the server (4 streams, a 40-tool request at
// the door) showed the master blocked at those barriers 5.7% of the time, the member then
// running on the master's core 665 times in 8 s. Pinned, the member waits for its own core,
// which the kernel gives it back as soon as the other thread's short burst ends.
//
// libgomp keeps a master's team threads in a pool and gives team member t the same pool thread
// in every later team of at most that size, so the binding made here holds for torch's ops and
// ours (one runtime: cpu_kernels.py). Returns each member's thread id, -1 where the kernel
// refused (a CPU outside the process's cpuset); Linux only, elsewhere every entry is -1.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <cstdint>
#include <vector>

#ifdef __linux__
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

std::vector<int64_t> bind_intraop_threads(const std::vector<int64_t>& cpus) {
  const int n = at::get_num_threads();
  TORCH_CHECK(static_cast<int64_t>(cpus.size()) >= n, "bind_intraop_threads: ", n, " threads, ", cpus.size(), " CPUs");
  std::vector<int64_t> tids(n, -1);
#ifdef __linux__
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[t]), &set);
    if (sched_setaffinity(0, sizeof(set), &set) == 0) tids[t] = static_cast<int64_t>(syscall(SYS_gettid));
  }
#endif
  return tids;
}
