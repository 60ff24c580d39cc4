//! The model laid over the ranks: which stage holds which layers and
//! vocabulary rows ([`Plan`]), and one rank's share of the parameters
//! ([`RankParams`]).

use std::ops::Range;

use ndarray::{Array1, Array2, ArrayViewD, ArrayViewMutD};
use packshard_reference::bert::LayerParams;
use packshard_reference::decoder::{DecoderConfig, DecoderParams};
use packshard_reference::vocab::{ShardLayout, ShardMap};
use packshard_reference::{Error, Result};

use crate::decoder::DecoderStage;
use crate::model::{layer_named, layer_tensors_mut, stage_layers, ModelConfig, Params};
use crate::schedule::{schedules, Costs, Op, Placement};

/// How the model is laid over `p` ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Ranks (= stages).
    pub p: usize,
    /// Where the vocabulary layers live.
    pub placement: Placement,
    /// Each stage's contiguous layers.
    pub stages: Vec<Range<usize>>,
    /// The vocabulary split (uneven contiguous shards; used when
    /// vocabulary-parallel).
    pub map: ShardMap,
    /// Every rank's schedule.
    pub schedules: Vec<Vec<Op>>,
}

impl Plan {
    /// The plan of `config` over `p` ranks.
    ///
    /// # Errors
    /// The errors of [`ModelConfig::validate`] and [`ShardMap::new`].
    pub fn new(config: &ModelConfig, p: usize, placement: Placement) -> Result<Self> {
        config.validate(p)?;
        let costs = Costs::for_model(config, p);
        Ok(Plan {
            p,
            placement,
            stages: stage_layers(config.layers, p),
            map: ShardMap::new(config.vocab, p, ShardLayout::Uneven)?,
            schedules: schedules(p, config.microbatches, placement, &costs),
        })
    }

    /// The rows `[start, start + len)` of the word embedding / output layer
    /// rank `r` holds, if any.
    pub fn vocab_rows(&self, r: usize, v: usize, input: bool) -> Option<Range<usize>> {
        if self.placement.is_vocab_parallel() {
            let s = self.map.shard(r);
            Some(s.start..s.start + s.real)
        } else if (input && r == 0) || (!input && r == self.p - 1) {
            Some(0..v)
        } else {
            None
        }
    }
}

/// The parameters (or gradients) one rank holds.
#[derive(Debug, Clone, PartialEq)]
pub struct RankParams {
    /// The rank.
    pub rank: usize,
    /// Its stage's layers.
    pub layers: Vec<LayerParams>,
    /// `[w, hidden]`: its rows of the word embedding (all `v` on stage 0 in
    /// the baseline, its shard when vocabulary-parallel).
    pub word: Option<Array2<f64>>,
    /// Stage 0: the position embedding and the embedding LayerNorm.
    pub embedding_tail: Option<(Array2<f64>, Array1<f64>, Array1<f64>)>,
    /// `[w, hidden]`: its rows of the output layer.
    pub output: Option<Array2<f64>>,
    /// The causal decoder's stage (then `layers` and `embedding_tail` are
    /// empty): its layers and, on the last rank, the final norm. With tied
    /// embeddings `word` and `output` are copies of the same rows of the one
    /// weight, and their gradients are summed after the iteration.
    pub decoder: Option<DecoderStage>,
}

impl RankParams {
    /// Rank `r`'s share of `full`.
    pub fn from_full(full: &Params, plan: &Plan, r: usize) -> Self {
        let v = full.word.nrows();
        let rows =
            |a: &Array2<f64>, range: Range<usize>| a.slice(ndarray::s![range, ..]).to_owned();
        RankParams {
            rank: r,
            layers: full.layers[plan.stages[r].clone()].to_vec(),
            word: plan.vocab_rows(r, v, true).map(|g| rows(&full.word, g)),
            embedding_tail: (r == 0)
                .then(|| (full.position.clone(), full.ln_g.clone(), full.ln_b.clone())),
            output: plan.vocab_rows(r, v, false).map(|g| rows(&full.output, g)),
            decoder: None,
        }
    }

    /// Rank `r`'s share of the decoder `full` (of shape `config`): its
    /// stage's layers, the final norm on the last rank, its rows of the
    /// embedding and of the output layer (`lm_head`, or `embed` when tied).
    pub fn from_decoder(
        full: &DecoderParams,
        config: &DecoderConfig,
        plan: &Plan,
        r: usize,
    ) -> Self {
        let v = full.embed.nrows();
        let rows =
            |a: &Array2<f64>, range: Range<usize>| a.slice(ndarray::s![range, ..]).to_owned();
        let head = if config.tie_embeddings {
            &full.embed
        } else {
            &full.lm_head
        };
        RankParams {
            rank: r,
            layers: Vec::new(),
            word: plan.vocab_rows(r, v, true).map(|g| rows(&full.embed, g)),
            embedding_tail: None,
            output: plan.vocab_rows(r, v, false).map(|g| rows(head, g)),
            decoder: Some(DecoderStage {
                config: config.clone(),
                layers: full.layers[plan.stages[r].clone()].to_vec(),
                final_norm: (r == plan.p - 1)
                    .then(|| (full.final_norm_g.clone(), full.final_norm_b.clone())),
            }),
        }
    }

    /// Copies this rank's decoder tensors into their places in `full`: the
    /// input-embedding rows into `embed`, the output rows into `lm_head`
    /// (untied) or, tied, into `tied_head: [v, hidden]` (the output ranks'
    /// copy of the one weight, checked against `embed` separately).
    pub fn place_into_decoder(
        &self,
        full: &mut DecoderParams,
        tied_head: &mut Array2<f64>,
        plan: &Plan,
    ) {
        let v = full.embed.nrows();
        let r = self.rank;
        let Some(stage) = &self.decoder else { return };
        for (l, lp) in plan.stages[r].clone().zip(&stage.layers) {
            full.layers[l] = lp.clone();
        }
        if let Some((g, b)) = &stage.final_norm {
            full.final_norm_g.assign(g);
            full.final_norm_b.assign(b);
        }
        if let (Some(w), Some(g)) = (&self.word, plan.vocab_rows(r, v, true)) {
            full.embed.slice_mut(ndarray::s![g, ..]).assign(w);
        }
        if let (Some(o), Some(g)) = (&self.output, plan.vocab_rows(r, v, false)) {
            let head = if stage.config.tie_embeddings {
                tied_head
            } else {
                &mut full.lm_head
            };
            head.slice_mut(ndarray::s![g, ..]).assign(o);
        }
    }

    /// Zeros of the same shapes (a gradient).
    pub fn zeros_like(&self) -> Self {
        RankParams {
            rank: self.rank,
            layers: self.layers.iter().map(LayerParams::zeros_like).collect(),
            word: self.word.as_ref().map(|a| Array2::zeros(a.dim())),
            embedding_tail: self.embedding_tail.as_ref().map(|(p, g, b)| {
                (
                    Array2::zeros(p.dim()),
                    Array1::zeros(g.len()),
                    Array1::zeros(b.len()),
                )
            }),
            output: self.output.as_ref().map(|a| Array2::zeros(a.dim())),
            decoder: self.decoder.as_ref().map(DecoderStage::zeros_like),
        }
    }

    /// Every tensor, in a fixed order.
    pub fn tensors(&self) -> Vec<ArrayViewD<'_, f64>> {
        let mut out: Vec<ArrayViewD<'_, f64>> = self
            .layers
            .iter()
            .flat_map(|l| layer_named(0, l).into_iter().map(|(_, t)| t))
            .collect();
        if let Some(w) = &self.word {
            out.push(w.view().into_dyn());
        }
        if let Some((p, g, b)) = &self.embedding_tail {
            out.extend([
                p.view().into_dyn(),
                g.view().into_dyn(),
                b.view().into_dyn(),
            ]);
        }
        if let Some(o) = &self.output {
            out.push(o.view().into_dyn());
        }
        if let Some(d) = &self.decoder {
            for l in &d.layers {
                out.extend(l.named().into_iter().map(|(_, t)| t));
            }
            if let Some((g, b)) = &d.final_norm {
                out.extend([g.view().into_dyn(), b.view().into_dyn()]);
            }
        }
        out
    }

    /// Every tensor, mutable, in the order of [`RankParams::tensors`].
    pub fn tensors_mut(&mut self) -> Vec<ArrayViewMutD<'_, f64>> {
        let mut out: Vec<ArrayViewMutD<'_, f64>> = Vec::new();
        for l in &mut self.layers {
            out.extend(layer_tensors_mut(l));
        }
        if let Some(w) = &mut self.word {
            out.push(w.view_mut().into_dyn());
        }
        if let Some((p, g, b)) = &mut self.embedding_tail {
            out.extend([
                p.view_mut().into_dyn(),
                g.view_mut().into_dyn(),
                b.view_mut().into_dyn(),
            ]);
        }
        if let Some(o) = &mut self.output {
            out.push(o.view_mut().into_dyn());
        }
        if let Some(d) = &mut self.decoder {
            for l in &mut d.layers {
                out.extend(l.named_mut().into_iter().map(|(_, t)| t));
            }
            if let Some((g, b)) = &mut d.final_norm {
                out.extend([g.view_mut().into_dyn(), b.view_mut().into_dyn()]);
            }
        }
        out
    }

    /// Values held.
    pub fn num_values(&self) -> usize {
        self.tensors().iter().map(|t| t.len()).sum()
    }

    /// Bytes of the parameters (f64).
    pub fn bytes(&self) -> usize {
        8 * self.num_values()
    }

    /// All values, flat, in the order of [`RankParams::tensors`].
    pub fn flatten(&self) -> Vec<f64> {
        let mut out = Vec::with_capacity(self.num_values());
        for t in self.tensors() {
            out.extend(t.iter().copied());
        }
        out
    }

    /// Fills the tensors from `flat` (as [`RankParams::flatten`] made it).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the lengths differ.
    pub fn fill(&mut self, flat: &[f64]) -> Result<()> {
        if flat.len() != self.num_values() {
            return Err(Error::ShapeMismatch {
                field: format!("gradients of rank {}", self.rank),
                expected: format!("{} values", self.num_values()),
                actual: vec![flat.len()],
            });
        }
        let mut at = 0;
        for mut t in self.tensors_mut() {
            for x in t.iter_mut() {
                *x = flat[at];
                at += 1;
            }
        }
        Ok(())
    }

    /// Copies this rank's tensors into their places in `full`.
    pub fn place_into(&self, full: &mut Params, plan: &Plan) {
        let v = full.word.nrows();
        let r = self.rank;
        for (l, lp) in plan.stages[r].clone().zip(&self.layers) {
            full.layers[l] = lp.clone();
        }
        if let (Some(w), Some(g)) = (&self.word, plan.vocab_rows(r, v, true)) {
            full.word.slice_mut(ndarray::s![g, ..]).assign(w);
        }
        if let Some((p, g, b)) = &self.embedding_tail {
            full.position.assign(p);
            full.ln_g.assign(g);
            full.ln_b.assign(b);
        }
        if let (Some(o), Some(g)) = (&self.output, plan.vocab_rows(r, v, false)) {
            full.output.slice_mut(ndarray::s![g, ..]).assign(o);
        }
    }
}
