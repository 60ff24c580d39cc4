//! The f32 decoder layer packed against padded (issue #15): the speed-up
//! of packing a causal-LM batch set against its token-slot limit.

use ndarray::Array2;
use packshard_optimized::decoder_layer::{
    decoder_layer_backward, decoder_layer_forward, decoder_layer_params_f32, DecoderShape,
};
use packshard_reference::decoder::{DecoderConfig, DecoderParams};
use packshard_reference::{Error, Result};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::{time_warm, uniform2, wikipedia_lengths, Batch, BenchConfig};

/// The decoder-layer measurement.
#[derive(Debug, Clone)]
pub struct DecoderReport {
    /// Sequences.
    pub sequences: usize,
    /// Real tokens.
    pub real_tokens: usize,
    /// Packs (rows of `max_len`).
    pub num_packs: usize,
    /// Key/value heads (grouped-query attention; the query heads are the
    /// config's `heads`).
    pub kv_heads: usize,
    /// Seconds of forward + backward, packed.
    pub packed_s: f64,
    /// Seconds of forward + backward, padded.
    pub padded_s: f64,
    /// `padded_slots / packed_slots`.
    pub slot_ratio: f64,
    /// Largest relative difference of the packed and padded outputs and
    /// input gradients on real tokens (checked before timing).
    pub packed_vs_padded_rel: f64,
}

impl DecoderReport {
    /// `padded_s / packed_s`.
    pub fn speedup(&self) -> f64 {
        self.padded_s / self.packed_s
    }

    /// The speed-up as a fraction of the slot ratio (the issue asks >= 0.95).
    pub fn of_slot_ratio(&self) -> f64 {
        self.speedup() / self.slot_ratio
    }
}

/// Positions `0..len` of each segment of `cu_seqlens` (the rotary position
/// of each slot: per document in the packed rows, per row in the padded
/// ones; a pack's trailing padding is a segment of its own).
fn positions(cu_seqlens: &[usize]) -> Vec<usize> {
    cu_seqlens.windows(2).flat_map(|w| 0..w[1] - w[0]).collect()
}

/// Runs the decoder-layer measurement: `cfg.hidden`, `cfg.heads` query
/// heads over `heads / 4` key/value heads (all of them when 4 does not
/// divide), `cfg.intermediate`, rows of `cfg.max_len`, `cfg.sequences`
/// lengths from `wikipedia-512`.
///
/// # Errors
/// Invalid configuration, or packed and padded results that disagree
/// (relative difference over 1e-4: nothing is timed).
pub fn decoder_layer(cfg: &BenchConfig) -> Result<DecoderReport> {
    cfg.validate()?;
    let (hd, heads, msl) = (cfg.hidden, cfg.heads, cfg.max_len);
    let kv = if heads.is_multiple_of(4) {
        heads / 4
    } else {
        heads
    };
    let config = DecoderConfig::tiny(8, heads, kv, hd / heads, cfg.intermediate, 1);
    let shape = DecoderShape::of(&config)?;
    let p64 = DecoderParams::random(&config, cfg.seed)?;
    let p = decoder_layer_params_f32(&p64.layers[0])?;
    let batch = Batch::new(wikipedia_lengths(cfg.sequences, msl, cfg.seed)?, msl)?;
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed + 2);
    let mut per_seq = || -> Vec<Array2<f32>> {
        batch
            .lengths
            .iter()
            .map(|&l| uniform2(&mut rng, (l, hd), 1.0))
            .collect()
    };
    let (real_x, real_g) = (per_seq(), per_seq());
    let (xp, gp) = (batch.place_packed(&real_x), batch.place_packed(&real_g));
    let (xd, gd) = (batch.place_padded(&real_x), batch.place_padded(&real_g));
    let cu_packed = batch.cu_seqlens.clone();
    let cu_padded: Vec<usize> = (0..=batch.lengths.len()).map(|r| r * msl).collect();
    let (pos_packed, pos_padded) = (positions(&cu_packed), positions(&cu_padded));
    let run = |x: &Array2<f32>, g: &Array2<f32>, pos: &[usize], cu: &[usize]| -> Result<_> {
        let (y, cache) = decoder_layer_forward(&shape, &p, x.view(), pos, cu)?;
        let (dx, _) = decoder_layer_backward(&shape, &p, &cache, pos, cu, g.view())?;
        Ok((y, dx))
    };
    let (yp, dxp) = run(&xp, &gp, &pos_packed, &cu_packed)?;
    let (yd, dxd) = run(&xd, &gd, &pos_padded, &cu_padded)?;
    let worst = batch
        .packed_vs_padded(&yp, &yd)
        .max(batch.packed_vs_padded(&dxp, &dxd));
    if worst > 1e-4 {
        return Err(Error::invalid(
            "decoder_layer",
            format!("packed and padded results differ by {worst:e} (relative): not timing"),
        ));
    }
    let packed_s = time_warm(cfg.reps, || run(&xp, &gp, &pos_packed, &cu_packed));
    let padded_s = time_warm(cfg.reps, || run(&xd, &gd, &pos_padded, &cu_padded));
    Ok(DecoderReport {
        sequences: cfg.sequences,
        real_tokens: batch.real_tokens(),
        num_packs: batch.num_packs,
        kv_heads: kv,
        packed_s,
        padded_s,
        slot_ratio: batch.padded_slots() as f64 / batch.packed_slots() as f64,
        packed_vs_padded_rel: worst,
    })
}
