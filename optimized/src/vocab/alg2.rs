//! One vocabulary shard of `alg2` (Yeung et al., Algorithm 2; the
//! reference's `sharded` module), per rank over a [`Collective`]:
//!
//! - **S pass**, chunked over tokens and vocabulary: the local
//!   statistics `(m_i, s_i, target term)` of each row over the shard's
//!   real columns, then `D_i = (softmax'_i - q_i) W_i` (one product per
//!   tile with the local deltas), `B_i = q_i W_i`, and with the z-loss
//!   `A_i = softmax'_i W_i = D_i + B_i`, into the reference's record
//!   `[stats, s_i D_i, B_i (, s_i A_i)]` ([`Alg2Record`]);
//! - **the one barrier**: the reference's merge ([`Alg2Record::merge`])
//!   in the collective, which gives the global statistics and
//!   `dL/dhidden` ([`Alg2Record::input_grad`], no further communication);
//! - **T pass**: the logits recomputed chunk by chunk, `dL/dz_i =
//!   alpha_i (softmax'_i - q_i) + (alpha_i - 1) q_i (+ z-loss)` in place,
//!   `dL/dW_i += G^T hidden`.
//!
//! No `[n, w_r]` buffer exists (the reference's alg2 keeps the shard's
//! logits between S and T; this one recomputes them: four products
//! instead of three). The record and the merge are f64, the rest f32.

use super::*;
use packshard_reference::vocab::cross_entropy::STATS_WIDTH;
use packshard_reference::vocab::sharded::{
    check_inputs, check_rank_inputs, local_delta, local_probability, Alg2Record, RankLoss,
    ShardedLoss,
};
use packshard_reference::vocab::{run_ranks, Collective, ShardMap, ShardedAlgorithm};

/// The local and global statistics of a row: `alpha_i` and `alpha_i - 1`
/// as the reference's alg2 forms them.
fn alphas(l: &SoftmaxStats, g: &SoftmaxStats) -> (f64, f64) {
    let alpha = l.sum_exp() * l.scale_to(g.max) / g.sum_exp();
    let minus_1 = if l.max == g.max {
        (l.rest - g.rest) / g.sum_exp()
    } else {
        alpha - 1.0
    };
    (alpha, minus_1)
}

struct DeltaOp<'a> {
    z: &'a mut [f32],
    q: RowQ,
    l: SoftmaxStats,
    cap: Option<f64>,
}

impl WithSimd for DeltaOp<'_> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) {
        let l = self.l;
        gradient_row(
            simd,
            self.z,
            &self.q,
            1.0,
            (l.max, l.sum_exp()),
            1.0,
            1.0,
            self.cap,
            |x, q| local_delta(&l, x, q),
        );
    }
}

struct TOp<'a> {
    z: &'a mut [f32],
    q: RowQ,
    w: f64,
    l: SoftmaxStats,
    g: SoftmaxStats,
    /// `(z_loss, softcap)`.
    options: (f64, Option<f64>),
}

impl WithSimd for TOp<'_> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) {
        let (l, g, (c, cap)) = (self.l, self.g, self.options);
        let (alpha, am1) = alphas(&l, &g);
        let zl = z_loss_factor(c, &g);
        // w (alpha (p' - q) + (alpha - 1) q + zl alpha p')
        //   = w ((alpha + zl alpha) p' - (alpha - am1) q)
        gradient_row(
            simd,
            self.z,
            &self.q,
            self.w,
            (l.max, l.sum_exp()),
            alpha * (1.0 + zl),
            alpha - am1,
            cap,
            |x, q| alpha * local_delta(&l, x, q) + am1 * q + zl * alpha * local_probability(&l, x),
        );
    }
}

/// A rank's shard and what it may read.
struct Shard<'a> {
    comm: &'a dyn Collective,
    rank: usize,
    start: usize,
    width: usize,
    real: usize,
    rows: Rows<'a>,
}

fn shard<'a>(
    comm: &'a dyn Collective,
    map: &ShardMap,
    n: usize,
    call: &LossCall<'a>,
) -> Result<Shard<'a>> {
    check_rank_inputs(comm, map, n, call)?;
    let v = map.vocab_size();
    let s = map.shard(comm.rank());
    Ok(Shard {
        comm,
        rank: s.rank,
        start: s.start,
        width: s.width,
        real: s.real,
        rows: Rows::new(call, v, s.start, s.real)?,
    })
}

impl Shard<'_> {
    /// Refuses a `field` of `shape` (`form`, e.g. `[n, w_r]`) whose
    /// vocabulary extent `got` is not this shard's width `w_r`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] naming `field`, as the reference.
    fn check_width(&self, field: &str, got: usize, shape: &[usize], form: &str) -> Result<()> {
        if got == self.width {
            return Ok(());
        }
        Err(Error::ShapeMismatch {
            field: field.into(),
            expected: format!("{form} with w_r = {} (shard {})", self.width, self.rank),
            actual: shape.to_vec(),
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn output(
        &self,
        (per_token_loss, loss): (Array1<f64>, f64),
        local: Vec<SoftmaxStats>,
        global: Vec<SoftmaxStats>,
        grad_logits: Option<Array2<f64>>,
        grad_hidden: Option<Array2<f64>>,
        grad_weight: Option<Array2<f64>>,
        peak_bytes: usize,
    ) -> RankLoss {
        RankLoss {
            rank: self.rank,
            loss,
            per_token_loss,
            local,
            global,
            grad_logits,
            grad_hidden,
            grad_weight,
            counts: self.comm.counts(),
            peak_bytes,
        }
    }

    /// `T` pass gradient of the tile `j0..j0 + tile` of rows `i0..` in `buf`.
    fn t_tile(
        &self,
        buf: &mut [f32],
        j0: usize,
        tile: usize,
        i0: usize,
        local: &[SoftmaxStats],
        global: &[SoftmaxStats],
    ) {
        let options = (self.rows.config.z_loss, self.rows.config.softcap);
        let rows = &self.rows;
        for_rows(buf, self.real, j0, tile, |arch, r, z| {
            let i = i0 + r;
            arch.dispatch(TOp {
                z,
                q: rows.q[i].tile(j0, tile),
                w: rows.weights[i],
                l: local[i],
                g: global[i],
                options,
            })
        });
    }
}

/// `alg2` on one rank, from its shard of the logits `logits: [n, w_r]`
/// (f32; padding columns never read) and the replicated `targets: [n]`.
/// The semantics (and errors) of the reference's `cross_entropy_rank`
/// with `ShardedAlgorithm::Alg2`; the gradient `[n, w_r]` (padding
/// columns 0) with `want_grad`.
///
/// # Errors
/// As the reference.
pub fn cross_entropy_rank(
    comm: &dyn Collective,
    map: &ShardMap,
    logits: ArrayView2<f32>,
    call: &LossCall,
) -> Result<RankLoss> {
    let (config, want_grad) = (call.config, call.want_grad());
    let n = logits.nrows();
    let sh = shard(comm, map, n, call)?;
    sh.check_width("logits", logits.ncols(), logits.shape(), "[n, w_r]")?;
    check_logits("logits", logits, sh.real, map.vocab_size(), sh.start)?;
    let mut z = logits
        .slice(s![.., ..sh.real])
        .as_standard_layout()
        .into_owned();
    let flat = z.as_slice_mut().expect("standard");
    let local = capped_row_stats(flat, (n, sh.real), &sh.rows, config.softcap);
    let mut record: Vec<f64> = local.iter().flat_map(|s| s.to_record()).collect();
    let global = Alg2Record::new(0, false, 0.0).all_reduce(sh.comm, &mut record)?;
    let forward = sh.rows.losses(&global)?;
    let peak = 4 * n * sh.real + 8 * STATS_WIDTH * n;
    if !want_grad {
        return Ok(sh.output(forward, local, global, None, None, None, peak));
    }
    sh.t_tile(
        z.as_slice_mut().expect("standard"),
        0,
        sh.real,
        0,
        &local,
        &global,
    );
    let mut g = Array2::zeros((n, sh.width));
    g.slice_mut(s![.., ..sh.real]).assign(&z.mapv(f64::from));
    Ok(sh.output(forward, local, global, Some(g), None, None, peak))
}

/// `alg2` on one rank for the output layer: `hidden: [n, h]`
/// (replicated), this rank's rows `weight: [w_r, h]` (padding rows never
/// read), `call.targets: [n]`. Chunked as `chunks` says; when `call` asks
/// for gradients, `dL/dhidden` (replicated) and this shard's `dL/dW`
/// (padding rows 0), and with `keep_grad_logits` also `dL/dz` of the shard `[n, w_r]` (for
/// checking: that buffer is what the fused kernel avoids).
///
/// # Errors
/// As the reference's `linear_cross_entropy_rank` (with
/// [`F32_LOGIT_BOUND`]); [`Error::InvalidArgument`] (`chunks`).
pub fn linear_cross_entropy_rank(
    comm: &dyn Collective,
    map: &ShardMap,
    hidden: ArrayView2<f32>,
    weight: ArrayView2<f32>,
    call: &LossCall,
    (chunks, keep_grad_logits): (Chunks, bool),
) -> Result<RankLoss> {
    let (config, want_grad) = (call.config, call.want_grad());
    let (n, h) = hidden.dim();
    let sh = shard(comm, map, n, call)?;
    sh.check_width("weight", weight.nrows(), weight.shape(), "[w_r, h]")?;
    check_linear(hidden, weight, sh.real, sh.start)?;
    check_chunks(chunks)?;
    let w_real = weight.slice(s![..sh.real, ..]);
    let real = sh.real;
    let tn = chunks.tokens.min(n).max(1);
    let tv = chunks.vocab;
    let mut buf = Array2::<f32>::zeros((tn, real));
    let (c, cap) = (config.z_loss, config.softcap);
    let layout = Alg2Record::new(h, want_grad, c);
    let (blocks, width) = (layout.blocks, layout.width());
    let mut record = vec![0.0f64; width * n];
    let mut local = vec![SoftmaxStats::EMPTY; n];
    // B_i = q_other colsum(W) + (q_target - q_other) W_t (f64 sums).
    let colsum: Vec<f64> = if blocks > 0 && sh.rows.q.first().is_some_and(|q| q.qo != 0.0) {
        (0..h)
            .map(|k| w_real.column(k).iter().map(|&x| x as f64).sum())
            .collect()
    } else {
        vec![0.0; h]
    };
    let mut d_chunk = Array2::<f32>::zeros((tn, h));
    // With a softcap B_i = Σ_j q_ij (dy/dz)_ij W_j has no column-sum form:
    // one more product per tile, of `q dy/dz` (docs/FAULTS.md O1).
    let capped_b = cap.is_some() && blocks > 0;
    let mut qf = capped_b.then(|| {
        (
            Array2::<f32>::zeros((tn, tv.min(real).max(1))),
            Array2::<f32>::zeros((tn, h)),
        )
    });
    // S pass.
    for (i0, m) in spans(n, tn) {
        let x = hidden.slice(s![i0..i0 + m, ..]);
        let mut b = rows_view(&mut buf, m);
        for (j0, tile) in spans(real, tv) {
            capped_logits_tile(&mut b, x, w_real, (j0, tile), cap);
            merge_tile_stats(
                b.as_slice().expect("standard rows"),
                real,
                j0,
                tile,
                &sh.rows,
                i0,
                &mut local[i0..i0 + m],
            );
        }
        if blocks > 0 {
            let mut d = d_chunk.slice_mut(s![..m, ..]);
            d.fill(0.0);
            if let Some((_, bq)) = qf.as_mut() {
                bq.fill(0.0);
            }
            for (j0, tile) in spans(real, tv) {
                if let (Some((f, bq)), Some(c)) = (qf.as_mut(), cap) {
                    let mut f = f.slice_mut(s![..m, ..tile]);
                    for ((r, j), fx) in f.indexed_iter_mut() {
                        let y = b[[r, j0 + j]] as f64;
                        let q = sh.rows.q[i0 + r].at(j0 + j);
                        *fx = (q * softcap::grad_factor(y, c)) as f32;
                    }
                    matmul(
                        bq.slice_mut(s![..m, ..]),
                        f.view(),
                        w_real.slice(s![j0..j0 + tile, ..]),
                        true,
                        Threads::All,
                    );
                }
                for_rows(
                    b.as_slice_mut().expect("standard rows"),
                    real,
                    j0,
                    tile,
                    |arch, r, z| {
                        arch.dispatch(DeltaOp {
                            z,
                            q: sh.rows.q[i0 + r].tile(j0, tile),
                            l: local[i0 + r],
                            cap,
                        })
                    },
                );
                matmul(
                    d.view_mut(),
                    b.slice(s![.., j0..j0 + tile]),
                    w_real.slice(s![j0..j0 + tile, ..]),
                    true,
                    Threads::All,
                );
            }
            for r in 0..m {
                let i = i0 + r;
                let q = &sh.rows.q[i];
                let b_ik = |k: usize| {
                    if !q.active {
                        return 0.0;
                    }
                    if let Some((_, bq)) = qf.as_ref() {
                        return bq[[r, k]] as f64;
                    }
                    let t = q
                        .target
                        .map_or(0.0, |t| (q.qt - q.qo) * w_real[[t, k]] as f64);
                    q.qo * colsum[k] + t
                };
                let d_ik = |k: usize| d[[r, k]] as f64;
                layout.write_partials(&mut record, i, local[i].sum_exp(), d_ik, b_ik, |k| {
                    d_ik(k) + b_ik(k)
                });
            }
        }
    }
    for (i, l) in local.iter().enumerate() {
        record[i * width..i * width + STATS_WIDTH].copy_from_slice(&l.to_record());
    }
    // The one barrier.
    let global = layout.all_reduce(sh.comm, &mut record)?;
    let forward = sh.rows.losses(&global)?;
    let peak = 4 * tn * (real + h) + 8 * width * n;
    if !want_grad {
        return Ok(sh.output(forward, local, global, None, None, None, peak));
    }
    // dL/dx from the merged record: w (Y / S + 2 c lse U / S).
    let gx = layout.input_grad(&record, &global, &sh.rows.weights, c);
    // T pass: recompute the logits, the gradient in place, dW += G^T x.
    let mut gw = Array2::<f32>::zeros((sh.width, h));
    let mut gz = keep_grad_logits.then(|| Array2::<f64>::zeros((n, sh.width)));
    for (i0, m) in spans(n, tn) {
        let x = hidden.slice(s![i0..i0 + m, ..]);
        let mut b = rows_view(&mut buf, m);
        for (j0, tile) in spans(real, tv) {
            capped_logits_tile(&mut b, x, w_real, (j0, tile), cap);
            sh.t_tile(
                b.as_slice_mut().expect("standard rows"),
                j0,
                tile,
                i0,
                &local,
                &global,
            );
            matmul(
                gw.slice_mut(s![j0..j0 + tile, ..]),
                b.slice(s![.., j0..j0 + tile]).t(),
                x,
                true,
                Threads::All,
            );
        }
        if let Some(gz) = gz.as_mut() {
            gz.slice_mut(s![i0..i0 + m, ..real])
                .assign(&b.mapv(f64::from));
        }
    }
    Ok(sh.output(
        forward,
        local,
        global,
        gz,
        Some(gx),
        Some(gw.mapv(f64::from)),
        peak,
    ))
}

fn finish(
    map: &ShardMap,
    ranks: Vec<packshard_reference::vocab::collective::RankResult<RankLoss>>,
) -> ShardedLoss {
    ShardedLoss {
        map: *map,
        ranks: ranks.into_iter().map(|r| r.output).collect(),
    }
}

/// `alg2` on `p` in-process ranks over `logits: [n, w]` (f32, `w >= v`,
/// columns `v..` padding, never read): the reference's
/// `sharded_cross_entropy` with `ShardedAlgorithm::Alg2`.
///
/// # Errors
/// As the reference (validation in the same order).
pub fn sharded_cross_entropy(
    map: &ShardMap,
    logits: ArrayView2<f32>,
    call: &LossCall,
) -> Result<ShardedLoss> {
    let (n, w) = logits.dim();
    let v = map.vocab_size();
    map.check_width("logits", w, &[n, w], "[n, v]")?;
    check_inputs(n, call, v)?;
    check_logits("logits", logits, v, v, 0)?;
    let parts = map.split_along(logits, ndarray::Axis(1), f32::NAN);
    let ranks = run_ranks(map.num_shards(), |comm| {
        cross_entropy_rank(comm, map, parts[comm.rank()].view(), call)
    })?;
    Ok(finish(map, ranks))
}

/// `alg2` on `p` in-process ranks for the output layer: `hidden: [n, h]`,
/// `weight: [w, h]` (`w >= v`, rows `v..` padding, never read); `kernel`
/// is `(chunks, keep_grad_logits)` of [`linear_cross_entropy_rank`].
///
/// # Errors
/// As the reference's `sharded_linear_cross_entropy` (with
/// [`F32_LOGIT_BOUND`] and no bound on `n * v`).
pub fn sharded_linear_cross_entropy(
    map: &ShardMap,
    hidden: ArrayView2<f32>,
    weight: ArrayView2<f32>,
    call: &LossCall,
    kernel: (Chunks, bool),
) -> Result<ShardedLoss> {
    let n = hidden.nrows();
    let v = map.vocab_size();
    map.check_width("weight", weight.nrows(), weight.shape(), "[v, h]")?;
    check_inputs(n, call, v)?;
    check_linear(hidden, weight, v, 0)?;
    check_chunks(kernel.0)?;
    let parts = map.split_along(weight, ndarray::Axis(0), f32::NAN);
    let ranks = run_ranks(map.num_shards(), |comm| {
        linear_cross_entropy_rank(comm, map, hidden, parts[comm.rank()].view(), call, kernel)
    })?;
    Ok(finish(map, ranks))
}

/// The algorithm this module implements.
pub const ALGORITHM: ShardedAlgorithm = ShardedAlgorithm::Alg2;
