#!/usr/bin/env python3
"""Peak memory and step time of a torchtitan-style Llama training step, measured on one CUDA GPU.

The planner's figures for `--framework torchtitan` are predictions of what torchtitan's training
step allocates. This script runs that step as torchtitan wrote it at 9dec370 (December 2024, the
code of its published benchmarks; later releases fuse AdamW and RMSNorm, shard the embedding and
the head as units of their own and drop repeat_kv) (its Llama 3 model: separate
q/k/v and w1/w3 linears, complex RoPE in fp32, GQA keys and values repeated before
scaled_dot_product_attention, RMSNorm in fp32; FSDP2 with bf16 parameters and fp32 gradient
reduction, each block sharded and resharded after forward but the last; activation checkpointing
`none`, `full` or `op` (torchtitan's selective op policy: save every mm's output except every
second one, and the attention's); cross-entropy on the logits cast to fp32, the logits freed
before backward; gradient clipping and foreach AdamW) on a one-rank process group, and writes
what the caching allocator saw: peak allocated and peak reserved bytes over the measured steps,
the bytes the device holds outside the allocator, and the step times.

`--suite` runs every case of SUITE, each in a fresh process (a fresh allocator), and writes one
JSON file; tools/validate.py reads it with validation/cases.json. `--smoke` runs one tiny case
on the CPU in fp32 without FSDP (to check the script itself where there is no GPU).

`--trace` records the allocator's events from before the model is made: the result lists the
blocks alive at the peak and the segments by the request that made them, and `--events FILE`
writes every request (validation/allocator/ holds two, replayed by the allocator model's test).

Usage: tools/gpu_memory.py --suite --json OUT.json
       tools/gpu_memory.py --layers 8 --batch 1 --ac op --json OUT.json
       tools/gpu_memory.py --layers 8 --batch 1 --ac op --warmup 2 --steps 1 --trace --events FILE
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

# Llama 3's shapes (torchtitan's "8B" flavour: dim 4096, 32 heads, 8 key/value heads, FFN 1.3 x
# 8/3 x 4096 rounded up to a multiple of 1024 = 14336; "70B": dim 8192, 64 heads, FFN 28672;
# vocabulary 128256, rope theta 5e5), at fewer layers so that one GPU holds the unsharded optimizer
# state, at torchtitan's sequence 8192.
SHAPES = {
    "llama3-8b": {"dim": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 128256, "seq": 8192, "theta": 5e5},
    "llama3-70b": {"dim": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672, "vocab": 128256, "seq": 8192, "theta": 5e5},
}
SUITE = [
    {"name": "llama3-8b-l8-op-mb1", "layers": 8, "batch": 1, "ac": "op", "expandable": True},
    {"name": "llama3-8b-l8-op-mb2", "layers": 8, "batch": 2, "ac": "op", "expandable": True},
    {"name": "llama3-8b-l16-op-mb1", "layers": 16, "batch": 1, "ac": "op", "expandable": True},
    {"name": "llama3-8b-l8-full-mb2", "layers": 8, "batch": 2, "ac": "full", "expandable": True},
    {"name": "llama3-8b-l8-none-mb1", "layers": 8, "batch": 1, "ac": "none", "expandable": True},
    {"name": "llama3-8b-l8-op-mb1-segments", "layers": 8, "batch": 1, "ac": "op", "expandable": False},
    {"name": "llama3-8b-l8-none-mb1-segments", "layers": 8, "batch": 1, "ac": "none", "expandable": False},
    {"name": "llama3-8b-l8-op-mb4", "layers": 8, "batch": 4, "ac": "op", "expandable": True},
    {"name": "llama3-8b-l8-full-mb2-segments", "layers": 8, "batch": 2, "ac": "full", "expandable": False},
    {"name": "llama3-70b-l2-op-mb1", "model": "llama3-70b", "layers": 2, "batch": 1, "ac": "op", "expandable": True},
    {"name": "llama3-70b-l2-none-mb1", "model": "llama3-70b", "layers": 2, "batch": 1, "ac": "none",
     "expandable": True},
    {"name": "llama3-8b-l8-op-mb1-trace", "layers": 8, "batch": 1, "ac": "op", "expandable": True, "trace": True},
    {"name": "llama3-8b-l8-none-mb1-trace", "layers": 8, "batch": 1, "ac": "none", "expandable": True, "trace": True},
]
SMOKE_SHAPE = {"dim": 64, "heads": 4, "kv_heads": 2, "ffn": 96, "vocab": 300, "seq": 32, "theta": 10000.0}


def build_model(torch, shape, layers):
    """torchtitan's Llama 3 Transformer (torchtitan/models/llama/model.py), written out here."""
    nn, F = torch.nn, torch.nn.functional

    class RMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-5):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            y = x.float()
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
            return y.type_as(x) * self.weight

    def math_attention(q, k, v, is_causal):  # PyTorch before 2.0 (the smoke test on Debian's 1.13)
        t = q.shape[-2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v

    sdpa = getattr(F, "scaled_dot_product_attention", math_attention)

    def rope(x, freqs):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        freqs = freqs[: x.shape[1]].view(1, x.shape[1], 1, xc.shape[-1])
        return torch.view_as_real(xc * freqs).flatten(3).type_as(x)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            d, h, kv = shape["dim"], shape["heads"], shape["kv_heads"]
            self.h, self.kv, self.hd = h, kv, d // h
            self.wq = nn.Linear(d, h * self.hd, bias=False)
            self.wk = nn.Linear(d, kv * self.hd, bias=False)
            self.wv = nn.Linear(d, kv * self.hd, bias=False)
            self.wo = nn.Linear(h * self.hd, d, bias=False)

        def forward(self, x, freqs):
            b, t, _ = x.shape
            q = self.wq(x).view(b, t, -1, self.hd)
            k = self.wk(x).view(b, t, -1, self.hd)
            v = self.wv(x).view(b, t, -1, self.hd)
            q, k = rope(q, freqs), rope(k, freqs)
            rep = self.h // self.kv
            if rep > 1:  # torchtitan's repeat_kv: an expanded copy of keys and values
                k = k.unsqueeze(3).expand(b, t, self.kv, rep, self.hd).reshape(b, t, self.h, self.hd)
                v = v.unsqueeze(3).expand(b, t, self.kv, rep, self.hd).reshape(b, t, self.h, self.hd)
            o = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            return self.wo(o.transpose(1, 2).contiguous().view(b, t, -1))

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(shape["dim"], shape["ffn"], bias=False)
            self.w2 = nn.Linear(shape["ffn"], shape["dim"], bias=False)
            self.w3 = nn.Linear(shape["dim"], shape["ffn"], bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention, self.feed_forward = Attention(), FeedForward()
            self.attention_norm, self.ffn_norm = RMSNorm(shape["dim"]), RMSNorm(shape["dim"])

        def forward(self, x, freqs):
            h = x + self.attention(self.attention_norm(x), freqs)
            return h + self.feed_forward(self.ffn_norm(h))

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(shape["vocab"], shape["dim"])
            self.register_buffer("freqs_cis", torch.zeros(shape["seq"], shape["dim"] // shape["heads"] // 2,
                                                          dtype=torch.complex64))
            self.layers = nn.ModuleDict({str(i): Block() for i in range(layers)})
            self.norm = RMSNorm(shape["dim"])
            self.output = nn.Linear(shape["dim"], shape["vocab"], bias=False)

        def forward(self, tokens):
            h = self.tok_embeddings(tokens)
            for layer in self.layers.values():
                h = layer(h, self.freqs_cis)
            return self.output(self.norm(h))

    return Transformer()


def init_weights(torch, model, shape):
    """Fills every parameter and the RoPE table in place (torchtitan's init_weights, in spirit:
    the values do not change the bytes)."""
    with torch.no_grad():
        hd = shape["dim"] // shape["heads"]
        freqs = 1.0 / (shape["theta"] ** (torch.arange(0, hd, 2, device=model.freqs_cis.device).float() / hd))
        angles = torch.outer(torch.arange(shape["seq"], device=freqs.device).float(), freqs)
        model.freqs_cis.copy_(torch.polar(torch.ones_like(angles), angles))
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)


def wrap_checkpoint(torch, model, mode):
    """torchtitan's apply_ac: each block wrapped whole (`full`) or under the selective op policy."""
    if mode == "none":
        return
    from torch.utils.checkpoint import checkpoint

    context_fn = None
    if mode == "op":
        from collections import defaultdict

        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        aten = torch.ops.aten
        save = {aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
                aten._scaled_dot_product_flash_attention.default}

        def context_fn():
            meta = defaultdict(int)

            def policy(ctx, func, *args, **kwargs):
                key = "recompute" if ctx.is_recompute else "forward"
                if func == aten.mm.default:
                    meta[key] += 1
                keep = func in save and not (func == aten.mm.default and meta[key] % 2 == 0)
                return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

            return create_selective_checkpoint_contexts(policy)

    class Checkpointed(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x, freqs):
            kwargs = {"use_reentrant": False, "preserve_rng_state": False}
            if context_fn is not None:
                kwargs["context_fn"] = context_fn
            return checkpoint(self.block, x, freqs, **kwargs)

    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, Checkpointed(block))


def shard(torch, model):
    """torchtitan's apply_fsdp on a one-rank mesh: bf16 parameters, fp32 gradient reduction; every
    block resharded after forward but the last, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cuda", (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)


def measure(args):
    import torch

    smoke = args.smoke
    shape = SMOKE_SHAPE if smoke else SHAPES[args.model]
    device = torch.device("cpu" if smoke else "cuda")
    if not smoke:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        torch.cuda.set_device(0)
        if args.backend == "fake":  # no communication at all: the same buffers, values not gathered
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
        else:
            dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    if args.trace:  # from the start, so that every block live at the peak has its origin
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=2000000)
    torch.manual_seed(0)
    if smoke:
        model = build_model(torch, shape, args.layers)
        wrap_checkpoint(torch, model, args.ac)
    else:  # torchtitan's order: a model on the meta device, checkpointed, sharded, then materialised
        with torch.device("meta"):
            model = build_model(torch, shape, args.layers)
        wrap_checkpoint(torch, model, args.ac)
        shard(torch, model)
        model.to_empty(device=device)
    init_weights(torch, model, shape)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=not smoke)
    attention = None
    if not smoke:  # torchtitan's runs used flash attention, the one its op policy saves
        from torch.nn.attention import SDPBackend, sdpa_kernel

        attention = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
        attention.__enter__()

    def clip(parameters):  # torchtitan's clip_grad_norm_: the total norm made whole, then the foreach scale
        parameters = list(parameters)
        if smoke:
            return torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        total = torch.nn.utils.get_total_norm([p.grad for p in parameters], foreach=True)
        if hasattr(total, "full_tensor"):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(parameters, 1.0, total, foreach=True)

    def step():
        tokens = torch.randint(0, shape["vocab"], (args.batch, shape["seq"]), device=device)
        labels = torch.randint(0, shape["vocab"], (args.batch, shape["seq"]), device=device)
        opt.zero_grad()
        pred = model(tokens)
        loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
        del pred
        loss.backward()
        clip(model.parameters())
        opt.step()
        return loss

    marks = []  # --trace: where each step's events begin
    for _ in range(args.warmup):
        if args.trace:
            marks.append(len(torch.cuda.memory._snapshot()["device_traces"][0]))
        step()
    result = {"params": params, "torch": torch.__version__}
    if not smoke:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        result["allocated_before"] = torch.cuda.memory_allocated()
    trace_start = len(torch.cuda.memory._snapshot()["device_traces"][0]) if args.trace else 0
    times = []
    for _ in range(args.steps):
        if args.trace:
            marks.append(len(torch.cuda.memory._snapshot()["device_traces"][0]))
        start = time.perf_counter()
        loss = step()
        if not smoke:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    result["loss"] = float(loss)
    result["step_s"] = times
    result["step_s_median"] = statistics.median(times)
    result["tokens_per_s"] = args.batch * shape["seq"] / result["step_s_median"]
    if not smoke:
        stats = torch.cuda.memory_stats()
        free, total = torch.cuda.mem_get_info()
        props = torch.cuda.get_device_properties(0)
        result.update({
            "backend": args.backend, "gpu": props.name, "cuda": torch.version.cuda, "total_bytes": total,
            "allocated_peak": stats["allocated_bytes.all.peak"], "reserved_peak": stats["reserved_bytes.all.peak"],
            "reserved_now": stats["reserved_bytes.all.current"], "alloc_retries": stats["num_alloc_retries"],
            "outside_allocator": total - free - stats["reserved_bytes.all.current"],
            "segments_peak": stats.get("segment.all.peak"),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        })
        if not os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):  # the segments the cache holds (never returned)
            result["segments"] = segments(torch.cuda.memory_snapshot())
        if args.trace:
            snapshot = torch.cuda.memory._snapshot()
            result["peak_live"] = live_at_peak(snapshot, trace_start)
            result["segment_origins"] = segment_origins(snapshot, marks)
            if args.events:
                write_events(args.events, snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
        attention.__exit__(None, None, None)
        torch.distributed.destroy_process_group()
    return result


def live_at_peak(snapshot, start):
    """The blocks allocated at the highest point of the trace after event `start` (the trace runs
    from before the model was made, so every block's size and origin are known), grouped by the
    line of this script (or of the framework, in backward) that made them and by size."""
    events = snapshot["device_traces"][0]

    def replay(stop):
        live, now, peak, peak_at = {}, 0, -1, 0
        for i, event in enumerate(events[:stop]):
            if event["action"] == "alloc":
                live[event["addr"]] = event
                now += event["size"]
                if now > peak and i >= start:
                    peak, peak_at = now, i + 1
            elif event["action"] == "free_completed" and event["addr"] in live:
                now -= live.pop(event["addr"])["size"]
        return live, peak, peak_at

    _, peak, peak_at = replay(len(events))
    at_peak, _, _ = replay(peak_at)
    groups = {}
    for event in at_peak.values():
        key = (where(event.get("frames", [])), event["size"])
        groups[key] = groups.get(key, 0) + 1
    rows = [{"where": k[0], "size": k[1], "count": n, "bytes": k[1] * n} for k, n in groups.items()]
    rows.sort(key=lambda r: -r["bytes"])
    last = events[peak_at - 1] if peak_at else {}
    return {"traced_peak": peak, "events": len(events), "peak_event": peak_at - 1,
            "peak_made_by": where(last.get("frames", [])), "peak_block": last.get("size"),
            "blocks": rows[:80], "other_bytes": sum(r["bytes"] for r in rows[80:])}


def write_events(path, snapshot):
    """The allocator's requests from the start (before the model is made), one a line, for replaying
    them through remat's model of the allocator: `+ BYTES STREAM BLOCK` for an allocation, `- BLOCK`
    for its free; streams numbered from 0 in the order they appear, a block by the line that made it."""
    streams, blocks, lines = {}, {}, []
    for e in snapshot["device_traces"][0]:
        if e["action"] == "alloc":
            blocks[e["addr"]] = len(lines)  # its line: unique
            stream = streams.setdefault(e["stream"], len(streams))
            lines.append(f"+ {e['size']} {stream} {blocks[e['addr']]}")
        elif e["action"] == "free_completed" and e["addr"] in blocks:
            lines.append(f"- {blocks.pop(e['addr'])}")
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)


def segment_origins(snapshot, marks):
    """Every segment the allocator reserved, in order: its size, stream, the step it came in (0:
    before the first), and the request that made it (its size and origin)."""
    events = snapshot["device_traces"][0]
    out = []
    for i, event in enumerate(events):
        if event["action"] != "segment_alloc":
            continue
        request = next((e for e in events[i + 1:i + 50] if e["action"] == "alloc" and e["stream"] == event["stream"]), {})
        out.append({"size": event["size"], "stream": event["stream"], "step": sum(1 for m in marks if m <= i),
                    "request": request.get("size"), "where": where(request.get("frames", []))})
    return out


def segments(snapshot):
    """The caching allocator's segments by stream and pool: count and bytes, and the large pool's
    segment sizes, largest first."""
    out = {}
    for s in snapshot:
        key = f"stream {s['stream']} {s['segment_type']}"
        entry = out.setdefault(key, {"count": 0, "bytes": 0, "allocated": 0, "sizes": []})
        entry["count"] += 1
        entry["bytes"] += s["total_size"]
        entry["allocated"] += s["allocated_size"]
        if s["segment_type"] == "large":
            entry["sizes"].append(s["total_size"])
    for entry in out.values():
        entry["sizes"].sort(reverse=True)
    return out


def where(frames):
    """This script's innermost line among an allocation's Python frames, with the innermost frame."""
    inner = f"{os.path.basename(frames[0]['filename'])}:{frames[0]['name']}" if frames else "?"
    for f in frames:
        if f["filename"].endswith("gpu_memory.py"):
            return f"{f['name']}:{f['line']} ({inner})"
    return inner


def suite(args):
    out = {"about": __doc__.strip().split("\n\n")[0], "shapes": SHAPES, "cases": []}
    # (--smoke: PyTorch before 2.4 has no selective checkpointing, so no op cases)
    for i, case in enumerate(c for c in SUITE if not (args.smoke and c["ac"] == "op")):
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if case["expandable"]:  # torchtitan's launcher, run_llama_train.sh, sets it
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        cmd = [sys.executable, os.path.abspath(__file__), "--model", case.get("model", "llama3-8b"),
               "--layers", str(case["layers"]), "--batch",
               str(case["batch"]), "--ac", case["ac"], "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--backend", args.backend]
        if case.get("trace"):
            cmd[cmd.index("--steps") + 1] = "1"
            cmd.append("--trace")
        if args.smoke:  # the suite's plumbing, tiny and on the CPU
            cmd[cmd.index("--layers") + 1] = "2"
            cmd.append("--smoke")
        start = time.perf_counter()
        try:
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.case_timeout)
            if run.returncode == 0:
                record = dict(case, **json.loads(run.stdout.strip().splitlines()[-1]))
            else:
                record = dict(case, error=run.stderr.strip().splitlines()[-20:])
        except subprocess.TimeoutExpired:
            record = dict(case, error=[f"timed out after {args.case_timeout} s"])
        record["wall_s"] = round(time.perf_counter() - start, 1)
        out["cases"].append(record)
        print(json.dumps(record), flush=True)
        write(args.json, out)
        if i == 0 and "error" in record:
            if args.backend == "nccl" and not args.smoke:  # a one-rank NCCL group refused: no collectives
                print("the first case failed with NCCL; the suite again on the fake process group", flush=True)
                args.backend = "fake"
                return suite(args)
            sys.exit("the first case failed; the suite stops")
    return out


def write(path, data):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, before any work
        sys.stderr.write(f"gpu_memory.py: error: {message}\n")
        sys.exit(2)


def main():
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", action="store_true", help="every case of SUITE, each in its own process")
    p.add_argument("--smoke", action="store_true", help="a tiny fp32 case on the CPU, no FSDP")
    p.add_argument("--model", choices=sorted(SHAPES), default="llama3-8b", help="the layers' shape")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=1, help="the micro-batch (torchtitan's local batch size)")
    p.add_argument("--ac", choices=["none", "full", "op"], default="op")
    p.add_argument("--warmup", type=int, default=2, help="steps before the peaks are reset (the optimizer state is made)")
    p.add_argument("--steps", type=int, default=3, help="measured steps")
    p.add_argument("--case-timeout", type=int, default=150, help="seconds for one case of the suite")
    p.add_argument("--json", help="where the suite's results go")
    p.add_argument("--backend", choices=["nccl", "fake"], default="nccl",
                   help="the one-rank process group FSDP2 runs on (fake: torch's test group, no communication)")
    p.add_argument("--events", help="with --trace: the allocator's requests from the start, one a line, into this file")
    p.add_argument("--trace", action="store_true", help="record the allocator's events from the start and list "
                   "the blocks live at the measured steps' peak, by the line that made them (slows the steps)")
    args = p.parse_args()
    for name in ("layers", "batch", "steps", "case_timeout"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup}: must be at least 0")
    if args.events and not args.trace:
        p.error(f"--events {args.events}: needs --trace (the events are the trace's)")
    if args.trace and args.smoke:
        p.error("--trace: records the CUDA allocator; --smoke runs on the CPU")
    if args.suite:
        if not args.json:
            p.error("--suite needs --json FILE")
        suite(args)
    else:
        result = measure(args)
        if args.json:
            write(args.json, result)
        print(json.dumps(result))


if __name__ == "__main__":
    main()
