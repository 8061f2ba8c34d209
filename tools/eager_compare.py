#!/usr/bin/python3
"""remat's ops engine against PyTorch eager on the seed experiment, in one run.

The seed experiment's model (6 layers, width 512, 8 heads, FFN 2048 with ReLU, residuals, no norm; batch
8, seq 128, fp32; MSE loss; Adam) is written here in plain PyTorch (torch.nn.MultiheadAttention,
torch.nn.Linear) and trained under the four strategies of the experiment with torch.utils.checkpoint
(non-reentrant, PyTorch's recommended form): none, full (each layer a checkpoint), every:2 and
every:3 (layer i a checkpoint when i % K != 0), as remat's presets of the same names choose.

Rounds alternate between the two: a `remat bench` process (its own warm-up, then --steps steps of
each strategy, round-robin) and the same number of PyTorch steps in this process (one warm-up step
of each strategy, then round-robin). Every timed step of all rounds is pooled: the table gives the
median and the range, and the ratio of medians; `ratio range` is the least and the greatest ratio of
the per-round medians, so a difference can be told from the machine's drift; `fastest / fastest` is
the ratio of each side's fastest step, each at its best (a shared host's load slows PyTorch's
memory-bound passes more than remat's, so the ratio of medians moves with it). Both sides are also given
as a multiple of the matmul floor (the step's FLOPs at the 1024^3 rate of the fastest GEMM here, measured in each round):
remat / PyTorch cannot fall much below the floor over PyTorch's step.

PyTorch's ATen thread count is chosen by measuring: one thread (what torch.get_num_threads() reads
here unset) or one per core, each timed on the none strategy's step, alternating, before the
rounds; the one with the faster median is kept (a bare median: PyTorch's default has no claim to
keep), and both medians are printed. OMP_WAIT_POLICY is
set to PASSIVE before torch loads (unless the user set it): with OpenMP's default, idle ATen
threads spin on the cores OpenBLAS's threads need for the next matmul, and the step with one
thread per core runs far slower than with one. PyTorch's matmuls run on OpenBLAS's own threads (the same libblas.so.3), with the kernel remat's bench runs
with: OpenBLAS picks its kernel from the CPU model when it loads, and on a CPU it does not know it
falls back to SSE3 (a third of the speed), which remat corrects and a plain `import torch` would
not. So the first remat round runs before torch is imported, and OPENBLAS_CORETYPE is set to the
kernel it reports (unless the user set it). remat's engine runs each class of GEMM on the one it
measured fastest here (NOTE [The engine's GEMMs]): both sides' GEMMs are printed. Saved bytes on the PyTorch side are the distinct storages
autograd keeps for backward after the forward pass (saved_tensors_hooks, in an untimed step),
parameters excluded.

Usage: tools/eager_compare.py [--remat build/remat] [--rounds 3] [--steps 3]
                              [--json results/eager.json] [--markdown results/eager.md]
Needs Debian's python3-torch (scripts/setup.sh eager).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

STRATEGIES = ["none", "full", "every:2", "every:3"]
LAYERS, DIM, HEADS, HIDDEN, BATCH, SEQ, LR = 6, 512, 8, 2048, 8, 128, 1e-4


def fail(message):
    print(f"eager_compare: error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--remat", default="build/remat", help="the remat binary (default build/remat)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of each side (>= 1)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per strategy per round (>= 1)")
    p.add_argument("--json", help="write the pooled results as JSON here")
    p.add_argument("--markdown", help="write the table here")
    a = p.parse_args()
    if a.rounds < 1:
        fail(f"--rounds {a.rounds}: must be at least 1")
    if a.steps < 1:
        fail(f"--steps {a.steps}: must be at least 1")
    if not os.access(a.remat, os.X_OK):
        fail(f"--remat {a.remat}: not an executable; build it first (make build)")
    return a


def import_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        fail("PyTorch is not installed for /usr/bin/python3; run scripts/setup.sh eager (Debian's python3-torch)")
    import torch
    return torch


def choose_torch_threads(torch, model, opt, step, rounds=3, steps=2):
    """The ATen thread count (1 or one per core) whose none step is faster: medians of rounds x steps
    steps each, alternating. Returns (chosen, {threads: median ms}, steps timed per count)."""
    candidates = sorted({1, os.cpu_count() or 1})
    times = {n: [] for n in candidates}
    for _ in range(rounds):
        for n in candidates:
            torch.set_num_threads(n)
            step(model, opt)  # the first step after a change pays for the new thread team
            for _ in range(steps):
                t0 = time.perf_counter()
                step(model, opt)
                times[n].append((time.perf_counter() - t0) * 1e3)
    medians = {n: statistics.median(v) for n, v in times.items()}
    chosen = min(candidates, key=lambda n: medians[n])
    torch.set_num_threads(chosen)
    return chosen, medians, rounds * steps


def build_torch_side(torch):
    nn = torch.nn
    import torch.utils.checkpoint
    checkpoint = torch.utils.checkpoint.checkpoint

    class SeedBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
            self.fc1 = nn.Linear(DIM, HIDDEN)
            self.fc2 = nn.Linear(HIDDEN, DIM)

        def forward(self, x):
            h = x + self.attn(x, x, x, need_weights=False)[0]
            return h + self.fc2(torch.relu(self.fc1(h)))

    # Which layers are checkpointed (each on its own), as remat's presets choose them: none, all
    # (full), or every layer i with i % K != 0 (every:K; layers 0, K, 2K... run plainly).
    def checkpointed(strategy, i):
        if strategy == "none":
            return False
        if strategy == "full":
            return True
        return i % int(strategy.split(":")[1]) != 0

    class Seed(nn.Module):
        def __init__(self, strategy):
            super().__init__()
            self.blocks = nn.ModuleList(SeedBlock() for _ in range(LAYERS))
            self.checkpointed = [checkpointed(strategy, i) for i in range(LAYERS)]
            self.kept = None  # set by saved_bytes: the inputs the checkpoints hold

        def forward(self, x):
            for block, ckpt in zip(self.blocks, self.checkpointed):
                if not ckpt:
                    x = block(x)
                    continue
                if self.kept is not None:
                    self.kept.append(x)  # a checkpoint holds its input for the recompute
                x = checkpoint(block, x, use_reentrant=False)
            return x

    torch.manual_seed(1234)
    x = torch.randn(BATCH, SEQ, DIM)  # data, no gradient (as remat's bench)
    target = torch.randn(BATCH, SEQ, DIM)
    subjects = []
    for s in STRATEGIES:
        torch.manual_seed(1234)
        model = Seed(s)
        subjects.append((s, model, torch.optim.Adam(model.parameters(), lr=LR)))

    def step(model, opt):
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()

    # Bytes kept for backward that the forward pass created: what autograd saves (outside
    # checkpoints; inside one its own hooks take over) and the inputs the checkpoints hold. The
    # parameters, the data and the target existed before and are not counted, as in remat's bench.
    def saved_bytes(model):
        existing = {t.storage().data_ptr() for t in list(model.parameters()) + [x, target]}
        seen = {}

        def keep(t):
            ptr = t.storage().data_ptr()
            if ptr not in existing:
                seen[ptr] = max(seen.get(ptr, 0), t.storage().nbytes())
            return t

        model.kept = []
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = torch.nn.functional.mse_loss(model(x), target)
        for t in model.kept:
            keep(t)
        model.kept = None
        del loss
        return sum(seen.values())

    return subjects, step, saved_bytes


def remat_round(binary, steps, env=None):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        cmd = [binary, "bench", "--engine", "ops", "--policies", ",".join(STRATEGIES), "--steps", str(steps),
               "--warmup", "1", "--json", out]
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        if r.returncode != 0:
            fail(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-2000:]}")
        with open(out) as f:
            return json.load(f)


def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "steps": values}


def loaded_openblas_kernel():
    """openblas_get_corename() of the OpenBLAS this process loaded (through torch), or "unknown"."""
    import ctypes
    try:
        lib = ctypes.CDLL("libopenblas.so.0", mode=os.RTLD_NOLOAD)
        lib.openblas_get_corename.restype = ctypes.c_char_p
        return lib.openblas_get_corename().decode()
    except (OSError, AttributeError):
        return "unknown"


def markdown(a, rows, config, floor, floors, torch, torch_kernel, threads):
    """The table and its header lines: the CPU, both sides' GEMMs and PyTorch's thread trial
    (threads: {threads: median ms} and the steps timed for each), and the floor."""
    thread_ms, thread_steps = threads
    mib = 1 << 20
    lines = [
        f"CPU: {config['cpu']}, {os.cpu_count()} cores",
        f"remat bench (ops engine) against PyTorch {torch.__version__} eager, seed model "
        f"L={LAYERS} C={DIM} H={HEADS} B={BATCH} T={SEQ} fp32; {a.rounds} alternating rounds of {a.steps} steps",
        f"remat: BLAS {config['blas']}; GEMM {config.get('gemm', 'BLAS')}; matmul {config['matmul_gflops']:.1f} "
        f"GFLOP/s, the fastest GEMM here beside each step (last remat round)",
        f"PyTorch: OpenBLAS kernel {torch_kernel}; torch threads {torch.get_num_threads()}, the faster measured "
        f"(none step, median of {thread_steps}: " + ", ".join(f"{n} thread{'s' if n > 1 else ''} {ms:.0f} ms"
                                                 for n, ms in sorted(thread_ms.items())) +
        f"; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')})",
        f"floor: {floor:.1f} ms ({config['flops_per_step'] / 1e9:.1f} GFLOP per step at the 1024^3 rate of the fastest GEMM here; "
        f"median of the {len(floors)} rounds, {min(floors):.1f}-{max(floors):.1f})",
        "",
        "| strategy | remat ms | min-max | PyTorch ms | min-max | remat / PyTorch | ratio range | fastest / fastest | remat / floor | PyTorch / floor | remat saved MiB | PyTorch saved MiB |",
        "|:---------|---------:|--------:|-----------:|--------:|----------------:|------------:|------------------:|--------------:|----------------:|----------------:|------------------:|",
    ]
    for row in rows:
        rm, tm = row["remat"], row["torch"]
        lines.append(f"| {row['policy']} | {rm['median']:.1f} | {rm['min']:.0f}-{rm['max']:.0f} | {tm['median']:.1f} | "
                     f"{tm['min']:.0f}-{tm['max']:.0f} | {row['ratio']:.2f}x | {row['ratio_min']:.2f}-{row['ratio_max']:.2f} | "
                     f"{row['fastest_ratio']:.2f}x | "
                     f"{row['remat_floor_ratio']:.2f}x | {row['torch_floor_ratio']:.2f}x | "
                     f"{row['remat_saved_bytes'] / mib:.1f} | {row['torch_saved_bytes'] / mib:.1f} |")
    return "\n".join(lines) + "\n"


def main():
    a = parse_args()
    remat_env = dict(os.environ)  # remat chooses its own kernel, as a user's run would
    first = remat_round(a.remat, a.steps)  # before torch loads OpenBLAS: its kernel is chosen at load
    kernel = first["config"].get("blas_kernel", "")
    if kernel and "OPENBLAS_CORETYPE" not in os.environ:
        os.environ["OPENBLAS_CORETYPE"] = kernel
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when OpenMP starts (with torch)
    torch = import_torch()
    torch_kernel = loaded_openblas_kernel()
    subjects, step, saved_bytes = build_torch_side(torch)
    _, none_model, none_opt = next(x for x in subjects if x[0] == "none")
    threads, thread_ms, thread_steps = choose_torch_threads(torch, none_model, none_opt, step)
    print(f"PyTorch threads: {threads} (none step: " +
          ", ".join(f"{n}: {ms:.0f} ms" for n, ms in sorted(thread_ms.items())) + ")", flush=True)
    remat_steps = {s: [] for s in STRATEGIES}
    torch_steps = {s: [] for s in STRATEGIES}
    round_ratios = {s: [] for s in STRATEGIES}
    remat_saved, config, floors = {}, None, []
    for r in range(a.rounds):
        bench = first if r == 0 else remat_round(a.remat, a.steps, remat_env)
        config = bench["config"]
        floors.append(config["floor_ms"])
        medians = {}
        for row in bench["rows"]:
            remat_steps[row["policy"]] += row["step_ms"]
            remat_saved[row["policy"]] = row["saved_bytes"]
            medians[row["policy"]] = row["step_ms_median"]
            if row["grad_max_abs_diff"] != 0:
                fail(f"remat's {row['policy']} gradients differ from none's by {row['grad_max_abs_diff']}")
        this_round = {s: [] for s in STRATEGIES}
        for _, model, opt in subjects:  # warm-up
            step(model, opt)
        for _ in range(a.steps):
            for s, model, opt in subjects:
                t0 = time.perf_counter()
                step(model, opt)
                this_round[s].append((time.perf_counter() - t0) * 1e3)
        for s in STRATEGIES:
            torch_steps[s] += this_round[s]
            round_ratios[s].append(medians[s] / statistics.median(this_round[s]))
        print(f"round {r + 1}/{a.rounds}: " + ", ".join(
            f"{s} {medians[s]:.0f} / {statistics.median(this_round[s]):.0f} ms" for s in STRATEGIES), flush=True)
    torch_saved = {s: saved_bytes(model) for s, model, _ in subjects}

    # The matmul floor: the step's FLOPs at the 1024^3 rate of the fastest GEMM, measured in every remat
    # round (the median of the rounds). A step cannot run much below it on either side, so it says
    # how far each side is from its GEMMs' speed, and what a ratio of the two can reach.
    floor = statistics.median(floors)
    rows = []
    for s in STRATEGIES:
        rm, tm = spread(remat_steps[s]), spread(torch_steps[s])
        rows.append({"policy": s, "remat": rm, "torch": tm, "ratio": rm["median"] / tm["median"],
                     "fastest_ratio": rm["min"] / tm["min"],
                     "remat_floor_ratio": rm["median"] / floor, "torch_floor_ratio": tm["median"] / floor,
                     "ratio_min": min(round_ratios[s]), "ratio_max": max(round_ratios[s]),
                     "remat_saved_bytes": remat_saved[s], "torch_saved_bytes": torch_saved[s]})
    table = markdown(a, rows, config, floor, floors, torch, torch_kernel, (thread_ms, thread_steps))
    print("\n" + table, end="")
    if a.markdown:
        write_atomic(a.markdown, table)
    if a.json:
        write_atomic(a.json, json.dumps({"torch": torch.__version__, "torch_blas_kernel": torch_kernel,
                                         "torch_threads": threads, "torch_thread_step_ms": thread_ms,
                                         "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                                         "rounds": a.rounds, "steps": a.steps, "floor_ms": floor,
                                         "round_floor_ms": floors,
                                         "remat_config": config, "rows": rows}, indent=2) + "\n")


def write_atomic(path, text):
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".eager-")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # as a plain open() would make it, not mkstemp's 0600
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
