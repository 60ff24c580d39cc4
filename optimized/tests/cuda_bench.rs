//! GPU benchmarks (feature `cuda`, `--ignored`; `scripts/gpu_check.sh` runs
//! them on a device): attention forward and forward + backward on
//! `wikipedia-512`-drawn batches, packed vs padded, and the fused output
//! layer, each with the device memory it holds; the figures of docs/GPU.md.
//! Ignored by default: they need a GPU and measure, they check nothing.
#![cfg(feature = "cuda")]

mod cuda_common;

use cuda_common::{gpu_or_skip, splitmix};
use packshard_optimized::cuda;
use packshard_optimized::cuda::attention::{AttnShape, Call, Form};
use packshard_optimized::cuda::vocab::{RowInputs, ShardInput, ShardKernels};

/// Draws `count` lengths from the `wikipedia-512` histogram (inverse CDF).
fn wikipedia_lengths(count: usize, seed: u64) -> Vec<usize> {
    let h = packshard_reference::packing::Histogram::embedded("wikipedia-512").unwrap();
    let counts = h.counts();
    let total: u64 = counts.iter().skip(1).sum();
    let mut s = seed;
    (0..count)
        .map(|_| {
            let mut r = (splitmix(&mut s) * total as f64) as u64;
            for (l, &c) in counts.iter().enumerate().skip(1) {
                if r < c {
                    return l;
                }
                r -= c;
            }
            h.longest()
        })
        .collect()
}

/// Attention forward, and forward + backward, on `wikipedia-512`-drawn batches, BERT-base heads
/// (h 12, d 64): packed (segments of the real lengths) vs padded (every
/// sequence padded to 512, the same kernel over 512-token segments).
/// Tokens/s counts real tokens; TFLOP/s counts the useful work `4 d h Σ l^2`
/// (padded also shows the work it executes). Kernel time only, inputs
/// resident on the device. Run: `scripts/gpu_check.sh`.
#[test]
#[ignore = "GPU benchmark: scripts/gpu_check.sh"]
fn gpu_attention_bench() {
    let Some(gpu) = gpu_or_skip("gpu_attention_bench") else {
        return;
    };
    let (h, d, max_len) = (12usize, 64usize, 512usize);
    for &batch in &[256usize, 1024] {
        let lengths = wikipedia_lengths(batch, 42 + batch as u64);
        let real: usize = lengths.iter().sum();
        // The same lengths for scripts/gpu_torch_bench.py (PyTorch on the
        // same device, side by side).
        if let Ok(dir) = std::env::var("PACKSHARD_GPU_BENCH_OUT") {
            let text: Vec<String> = lengths.iter().map(|l| l.to_string()).collect();
            std::fs::write(format!("{dir}/lengths_{batch}.txt"), text.join("\n"))
                .unwrap_or_else(|e| panic!("{dir}: {e}"));
        }
        let mut cu = vec![0usize];
        for l in &lengths {
            cu.push(cu.last().unwrap() + l);
        }
        let padded_cu: Vec<usize> = (0..=batch).map(|i| i * max_len).collect();
        let useful = cuda::attention::attention_flops(&cu, h, d, false);
        for (name, cu_used) in [("packed", &cu), ("padded", &padded_cu)] {
            let n_tok = *cu_used.last().unwrap();
            let mut s = 7u64;
            let x: Vec<f32> = (0..n_tok * h * d)
                .map(|_| (2.0 * splitmix(&mut s) - 1.0) as f32)
                .collect();
            let shape = AttnShape { n_tok, h, d };
            let c = Call {
                q: &x,
                k: &x,
                v: &x,
                shape,
                form: Form::Packed(cu_used),
                scale: 0.125,
            };
            let secs = gpu
                .time_attention(&c, false, 10)
                .unwrap_or_else(|e| panic!("{e}"));
            let executed = cuda::attention::attention_flops(cu_used, h, d, false);
            let segments = cu_used.len() - 1;
            let mib = |backward| {
                cuda::attention::attention_device_bytes(shape, segments, backward) as f64
                    / (1u64 << 20) as f64
            };
            println!(
                "attention fwd     {name:>6} batch {batch:>5} ({real} real tokens, {n_tok} computed): \
                 {:.3} ms, {:.3e} tokens/s, {:.2} useful TFLOP/s ({:.2} executed), {:.1} MiB",
                secs * 1e3,
                real as f64 / secs,
                useful / secs / 1e12,
                executed / secs / 1e12,
                mib(false)
            );
            let secs = gpu
                .time_attention(&c, true, 5)
                .unwrap_or_else(|e| panic!("{e}"));
            let useful_fb = useful + cuda::attention::attention_flops(&cu, h, d, true);
            let executed_fb = executed + cuda::attention::attention_flops(cu_used, h, d, true);
            println!(
                "attention fwd+bwd {name:>6} batch {batch:>5} ({real} real tokens, {n_tok} computed): \
                 {:.3} ms, {:.3e} tokens/s, {:.2} useful TFLOP/s ({:.2} executed), {:.1} MiB",
                secs * 1e3,
                real as f64 / secs,
                useful_fb / secs / 1e12,
                executed_fb / secs / 1e12,
                mib(true)
            );
        }
    }
}

/// The fused output layer (`lce_stats`, `lce_dx`, `lce_dw`: loss, `∂L/∂x`
/// and `∂L/∂W` without ever holding the `[n, V]` logits) on one shard, the
/// whole vocabulary: seconds per forward + backward pass and the device
/// memory it holds, at Llama-like sizes (the vocabulary of Llama 2, 32,000,
/// and of Llama 3, 128,256). `scripts/gpu_torch_bench.py` times PyTorch's
/// `cross_entropy` on materialized logits at the same sizes.
#[test]
#[ignore = "GPU benchmark: scripts/gpu_check.sh"]
fn gpu_output_layer_bench() {
    let Some(gpu) = gpu_or_skip("gpu_output_layer_bench") else {
        return;
    };
    for &(n, hd, v) in &[(4096usize, 1024usize, 32_000usize), (4096, 2048, 128_256)] {
        let mut s = 11u64;
        let mut gen = |k: usize, a: f64| -> Vec<f32> {
            (0..k)
                .map(|_| (a * (2.0 * splitmix(&mut s) - 1.0)) as f32)
                .collect()
        };
        let hidden = gen(n * hd, 1.0);
        // Weights at 1/sqrt(hd), as an initialised layer: logits of order 1.
        let weight = gen(v * hd, 1.0 / (hd as f64).sqrt());
        let target: Vec<i32> = (0..n).map(|i| ((i * 7919) % v) as i32).collect();
        let x = ShardInput {
            hidden: &hidden,
            weight: &weight,
            target: &target,
            n,
            hd,
            w: v,
        };
        let st = gpu.stats(&x).unwrap_or_else(|e| panic!("{e}"));
        let ones = vec![1.0f32; n];
        let zeros = vec![0.0f32; n];
        let scale = vec![1.0 / n as f32; n];
        let rows = RowInputs {
            q_target: &ones,
            q_other: &zeros,
            row_max: &st.local_max,
            row_rest: &st.local_rest,
            row_scale: &scale,
            row_zl: &zeros,
        };
        let (secs, bytes) = gpu
            .time_output_layer(&x, &rows, 3)
            .unwrap_or_else(|e| panic!("{e}"));
        // Three products of 2 n hd V flops each (logits, dx, dW).
        let flops = 6.0 * (n * hd * v) as f64;
        println!(
            "output layer fwd+bwd n {n} hidden {hd} vocab {v}: {:.3} ms, {:.2} TFLOP/s, {:.1} MiB \
             (logits alone would be {:.1} MiB)",
            secs * 1e3,
            flops / secs / 1e12,
            bytes as f64 / (1u64 << 20) as f64,
            (4 * n * v) as f64 / (1u64 << 20) as f64
        );
    }
}
