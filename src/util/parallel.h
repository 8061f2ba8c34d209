// remat's own kernels on several cores (internal).
//
// remat runs LibTorch with one ATen thread (runtime.h: idle libgomp workers spin on the core
// OpenBLAS needs), which would leave remat's own pointwise loops (ops/kernels.h: GELU, softmax,
// dropout) on one core. This pool's workers sleep on a condition variable between jobs, so an idle
// pool takes no core from OpenBLAS; through an executor pass they poll instead (KernelThreadsAwake,
// below). Work is cut into fixed chunks of `grain` items whatever the thread count, and every chunk
// runs the same code: a call gives the same bits on 1 thread or N.
//
// Measured on 2 cores: the softmax of one T = 1024 causal layer (8 x 8 heads) takes 40 ms on one
// thread and 23 ms on two. The attention ops' batched GEMMs (util/gemm.h) run on the pool too, one
// BLAS thread per product: 1.8x OpenBLAS's own two threads per product in a standalone loop at
// T = 1024, but no faster step in the model (docs/design.md, NOTE [Threads and BLAS]).
#pragma once

#include <cstdint>
#include <functional>

namespace remat::detail {

// Threads for parallel_chunks, the caller included; 1 runs everything on the caller. Set by
// remat::apply_threads (its BLAS count). Not to be called while a parallel_chunks call runs.
void set_kernel_threads(int threads);
int kernel_threads();

// While one of these is alive and `on` (on any thread), the pool's idle workers poll for the next
// job, and a caller for the end of its job, instead of sleeping on a condition variable: for a run
// of many short jobs, such as one executor pass, where waking a sleeping thread costs more than a
// short job (on a VM, a halted virtual CPU waits for the host). Polling takes the workers' cores, so
// keep it to runs in which nothing else (the BLAS's or OpenMP's threads) needs them. NOTE [Kernel
// threads awake] in docs/design.md.
class KernelThreadsAwake {
 public:
  explicit KernelThreadsAwake(bool on);
  ~KernelThreadsAwake();
  KernelThreadsAwake(const KernelThreadsAwake&) = delete;
  KernelThreadsAwake& operator=(const KernelThreadsAwake&) = delete;

 private:
  bool on_;
};

// Calls fn(begin, end) for the chunks [0, grain), [grain, 2 grain), ... of [0, n), spread over the
// pool, and returns when all are done. Runs inline when n <= grain, with one thread, when called
// from inside another parallel_chunks, or while another thread's call runs. When fn throws, the
// chunks taken after that is seen are skipped, and once every started chunk has ended the lowest
// throwing chunk's exception is rethrown here (inline: the first, at once).
void parallel_chunks(int64_t n, int64_t grain, const std::function<void(int64_t begin, int64_t end)>& fn);

// The same, telling fn which thread runs the chunk: 0 <= worker < kernel_threads(), and no two
// of the call's chunks running at once get the same number, inline runs included (they run one
// after another), so a buffer the call allocates per worker is never shared.
void parallel_chunks_indexed(int64_t n, int64_t grain,
                             const std::function<void(int64_t begin, int64_t end, int worker)>& fn);

// Slots of thread_scratch. A task may use the operand slots while the GEMM it calls uses its own.
enum class Scratch { Operand0, Operand1, GemmPanel, Count };

// A buffer of at least n floats of the calling thread's own, one per slot, its storage kept
// between calls (outside the tensor accounting, like the GEMM library's own packing buffers;
// NOTE [The engine's GEMMs]). Valid until the same thread asks for the same slot again.
float* thread_scratch(Scratch slot, int64_t n);

}  // namespace remat::detail
