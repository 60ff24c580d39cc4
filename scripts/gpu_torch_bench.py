#!/usr/bin/env python3
"""PyTorch on the same GPU as packshard's CUDA kernels, at the same sizes.

The baselines a CUDA user would pick instead (issue 38):

- attention, f32 like packshard's kernel: `scaled_dot_product_attention` on
  the batch padded to 512 with a key-padding mask (BERT-base heads: h 12,
  d 64), and, where this PyTorch has it, the packed varlen kernel
  (`torch.nn.attention.varlen.varlen_attn`, bf16 only, so a different
  precision: shown for scale, not as a like-for-like figure);
- the output layer: `cross_entropy` on materialized logits `x @ W^T`, f32
  (TF32 off, as packshard's kernels compute in f32), forward + backward for
  `x` and `W`.

Lengths come from `gpu_attention_bench` (PACKSHARD_GPU_BENCH_OUT=DIR writes
DIR/lengths_{batch}.txt), so both sides run the same batches.
Time: CUDA events, mean of `reps` passes after one warm-up. Memory:
`torch.cuda.max_memory_allocated` over the pass, inputs included (what the
packshard bench counts for its own buffers).

Usage: python3 scripts/gpu_torch_bench.py DIR
"""
import sys

import torch
import torch.nn.functional as F

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
DEV = "cuda"
MIB = float(1 << 20)


def timed(fn, reps):
    """Seconds per call of `fn` (one warm-up), and peak bytes allocated."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps, torch.cuda.max_memory_allocated(), base


def attention(batch, lengths):
    h, d, L = 12, 64, 512
    real = sum(lengths)
    useful = 4.0 * d * h * sum(l * l for l in lengths)
    rows = []
    g = torch.Generator(device=DEV).manual_seed(7)
    q = torch.rand(batch, h, L, d, device=DEV, generator=g) * 2 - 1
    mask = torch.zeros(batch, 1, 1, L, dtype=torch.bool, device=DEV)
    for i, l in enumerate(lengths):
        mask[i, :, :, :l] = True
    for bwd in (False, True):
        qq = q.clone().requires_grad_(bwd)

        def fwd():
            return F.scaled_dot_product_attention(qq, qq, qq, attn_mask=mask, scale=0.125)

        def fwd_bwd():
            o = fwd()
            o.backward(o.detach())

        torch.cuda.empty_cache()
        secs, peak, _ = timed(fwd_bwd if bwd else fwd, 5 if bwd else 10)
        flops = useful * (3.5 if bwd else 1.0)  # backward ~2.5x forward
        rows.append(("sdpa f32 padded+mask", "fwd+bwd" if bwd else "fwd", batch, real, secs, flops, peak))
        del qq
    try:
        from torch.nn.attention.varlen import varlen_attn  # torch >= 2.10
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"varlen_attn not available: {e}")
        return rows
    n = real
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=DEV)
    x = (torch.rand(n, h, d, device=DEV, generator=g) * 2 - 1).to(torch.bfloat16)
    for bwd in (False, True):
        xx = x.clone().requires_grad_(bwd)

        def vfwd():
            return varlen_attn(xx, xx, xx, cu, cu, max(lengths), max(lengths))

        def vfwd_bwd():
            o = vfwd()
            o.backward(o.detach())

        try:
            secs, peak, _ = timed(vfwd_bwd if bwd else vfwd, 10)
        except Exception as e:  # noqa: BLE001
            print(f"varlen_attn failed: {e}")
            break
        rows.append(("varlen_attn bf16 packed", "fwd+bwd" if bwd else "fwd", batch, real, secs,
                     useful * (3.5 if bwd else 1.0), peak))
    return rows


def output_layer(n, hd, v):
    g = torch.Generator(device=DEV).manual_seed(11)
    x = (torch.rand(n, hd, device=DEV, generator=g) * 2 - 1).requires_grad_(True)
    w = ((torch.rand(v, hd, device=DEV, generator=g) * 2 - 1) / hd**0.5).requires_grad_(True)
    t = (torch.arange(n, device=DEV) * 7919) % v

    def step():
        x.grad = None
        w.grad = None
        loss = F.cross_entropy(x @ w.t(), t)
        loss.backward()

    torch.cuda.empty_cache()
    secs, peak, _ = timed(step, 3)
    return secs, 6.0 * n * hd * v / secs / 1e12, peak


def main():
    out = sys.argv[1]
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, {p.total_memory / MIB / 1024:.0f} GiB; torch {torch.__version__}, CUDA {torch.version.cuda}")
    print("| baseline | pass | batch | real tokens | ms | useful TFLOP/s | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    for batch in (256, 1024):
        with open(f"{out}/lengths_{batch}.txt") as f:
            lengths = [int(x) for x in f.read().split()]
        assert len(lengths) == batch, (batch, len(lengths))
        for name, pas, b, real, secs, flops, peak in attention(batch, lengths):
            print(f"| {name} | {pas} | {b} | {real} | {secs * 1e3:.3f} | {flops / secs / 1e12:.2f} | {peak / MIB:.1f} |")
    print()
    print("| baseline | n | hidden | vocab | ms | TFLOP/s | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    for n, hd, v in ((4096, 1024, 32000), (4096, 2048, 128256)):
        secs, tf, peak = output_layer(n, hd, v)
        print(f"| cross_entropy f32 on logits | {n} | {hd} | {v} | {secs * 1e3:.3f} | {tf:.2f} | {peak / MIB:.1f} |")


if __name__ == "__main__":
    main()
