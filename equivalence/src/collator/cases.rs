//! The document sets [`super::check_collator`] hands a collator: the fixed
//! rows of issue 36 and docs/FAULTS.md first, then random ones.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashSet;

use super::{CollatorOptions, Feature, HF_IGNORE};

/// How a case's documents are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CaseKind {
    /// One-token documents (C3: `position_ids` `[0, 1, 2, 0, 0, 1]`).
    OneToken,
    /// Documents of no token (P4).
    Empty,
    /// `labels` with the first tokens `-100` (instruction tuning's prompt mask).
    Prompt,
    /// A document carrying `position_ids` that start above 0 (a chunk of a
    /// longer document; C6 and issue 36's three readings).
    Continuation,
    /// One document far longer than the rest; longer than a row under
    /// `max_seq_len` (a packing collator must split it, P3).
    Long,
}

impl CaseKind {
    /// Every kind.
    pub const ALL: [CaseKind; 5] = [
        CaseKind::OneToken,
        CaseKind::Empty,
        CaseKind::Prompt,
        CaseKind::Continuation,
        CaseKind::Long,
    ];
}

/// One document set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollatorCase {
    /// The collator's input.
    pub features: Vec<Feature>,
    /// `fixed case 3` or `random case 17 of seed 0`.
    pub source: String,
}

impl CollatorCase {
    /// Tokens over every document.
    pub fn tokens(&self) -> usize {
        self.features.iter().map(|f| f.input_ids.len()).sum()
    }

    /// `3 documents, lengths [3@5, 0, 4(prompt 2)]` (`@p`: a continuation
    /// chunk's first position).
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .features
            .iter()
            .map(|f| {
                let mut s = f.input_ids.len().to_string();
                if let Some(p) = f.position_ids.as_ref().and_then(|p| p.first()) {
                    s += &format!("@{p}");
                }
                let k = f
                    .labels
                    .as_ref()
                    .map_or(0, |l| l.iter().filter(|&&x| x == HF_IGNORE).count());
                if k > 0 {
                    s += &format!("(prompt {k})");
                }
                s
            })
            .collect();
        format!(
            "{} document{}, lengths [{}] (@p: first position p)",
            self.features.len(),
            if self.features.len() == 1 { "" } else { "s" },
            parts.join(", ")
        )
    }
}

/// A document to draw: `(length, first position, prompt tokens)`.
type Doc = (usize, i64, usize);

/// Token ids are drawn from `1..MAX_TOKEN` without repeats inside a case, so
/// a slot's id names its document and token; 2^20 leaves the largest case
/// (8 documents up to 131 tokens, ~1.2k tokens) a sparse draw.
const MAX_TOKEN: i64 = 1 << 20;

/// The fixed cases: issue 36's three `position_ids` rows, C3, an empty
/// document, a prompt mask, C7's `[3, 5]`, and one long document.
fn fixed(options: &CollatorOptions) -> Vec<Vec<Doc>> {
    let has = |k| options.kinds.contains(&k);
    let mut out = Vec::new();
    if has(CaseKind::OneToken) {
        out.push(vec![(3, 0, 0), (1, 0, 0), (2, 0, 0)]); // C3: [0,1,2,0,0,1]
        out.push(vec![(1, 0, 0), (1, 0, 0)]);
    }
    if has(CaseKind::Continuation) {
        out.push(vec![(3, 5, 0), (2, 0, 0)]); // [5,6,7,0,1]
        out.push(vec![(3, 0, 0), (2, 5, 0)]); // [0,1,2,5,6]
        if has(CaseKind::OneToken) {
            // [2,3,4,2,3,2,0,0]
            out.push(vec![(3, 2, 0), (2, 2, 0), (1, 2, 0), (1, 0, 0), (1, 0, 0)]);
        }
    }
    if has(CaseKind::Empty) {
        out.push(vec![(2, 0, 0), (0, 0, 0), (3, 0, 0)]);
    }
    if has(CaseKind::Prompt) {
        out.push(vec![(4, 0, 2), (3, 0, 1)]);
    }
    out.push(vec![(3, 0, 0), (5, 0, 0)]); // C7: 2 + 4 predicted
    if has(CaseKind::Long) {
        let long = options.max_seq_len.map_or(61, |m| 2 * m + 3);
        out.push(vec![(5, 0, 0), (long, 0, 0), (2, 0, 0)]);
    }
    out
}

fn random_docs(rng: &mut ChaCha8Rng, options: &CollatorOptions) -> Vec<Doc> {
    let use_kind: Vec<CaseKind> = options
        .kinds
        .iter()
        .copied()
        .filter(|_| rng.random_bool(0.5))
        .collect();
    let has = |k| use_kind.contains(&k);
    let b = rng.random_range(1..9);
    // Lengths not powers of two, so a fixed-size tile or block misaligns.
    const LENGTHS: [usize; 7] = [2, 3, 5, 7, 11, 17, 29];
    let mut docs: Vec<Doc> = (0..b)
        .map(|_| {
            let mut m = LENGTHS[rng.random_range(0..LENGTHS.len())];
            if has(CaseKind::OneToken) && rng.random_bool(0.4) {
                m = 1;
            }
            if has(CaseKind::Empty) && rng.random_bool(0.2) {
                m = 0;
            }
            let start = if has(CaseKind::Continuation) && rng.random_bool(0.4) {
                rng.random_range(1..40)
            } else {
                0
            };
            let prompt = if has(CaseKind::Prompt) && m > 1 && rng.random_bool(0.6) {
                rng.random_range(0..m)
            } else {
                0
            };
            (m, start, prompt)
        })
        .collect();
    if has(CaseKind::Long) {
        let k = rng.random_range(0..b);
        docs[k].0 = match options.max_seq_len {
            Some(m) => m + rng.random_range(1..=m),
            None => [61, 97, 131][rng.random_range(0..3)],
        };
    }
    docs
}

/// The features of `docs` (with `labels` on every one when any has a
/// prompt): ids unique in the case (never `pad_token_id`,
/// EOS, the separator, negative or `ignore_index`); with `eos_token_id`
/// each non-empty document ends with EOS and has at least 2 tokens (a
/// one-token EOS document would not name its document). A continuation
/// chunk's first position is moved off its predecessor's last + 1, so its
/// `position_ids` alone name the boundary (C3's reading).
fn features(rng: &mut ChaCha8Rng, docs: &[Doc], options: &CollatorOptions) -> Vec<Feature> {
    let reserved: HashSet<i64> = [
        Some(options.pad_token_id),
        options.eos_token_id,
        options.separator_id,
        Some(options.ignore_index),
    ]
    .into_iter()
    .flatten()
    .collect();
    let mut used = HashSet::new();
    let mut last: Option<i64> = None;
    let mut out = Vec::with_capacity(docs.len());
    let any_prompt = docs.iter().any(|d| d.2 > 0);
    for &(m, mut start, prompt) in docs {
        let m = if options.eos_token_id.is_some() && m == 1 {
            2
        } else {
            m
        };
        let mut ids = Vec::with_capacity(m);
        while ids.len() < m {
            let t = rng.random_range(1..MAX_TOKEN);
            if !reserved.contains(&t) && used.insert(t) {
                ids.push(t);
            }
        }
        if let (Some(e), Some(x)) = (options.eos_token_id, ids.last_mut()) {
            *x = e;
        }
        let mut f = Feature {
            input_ids: ids,
            ..Default::default()
        };
        if start > 0 && m > 0 {
            if last == Some(start - 1) {
                start += 1;
            }
            f.position_ids = Some((start..start + m as i64).collect());
        }
        if any_prompt {
            // Every feature of a case has the same keys, as a dataset's
            // (Hugging Face's collators read `labels` of all or none).
            let mut l = f.input_ids.clone();
            l[..prompt].fill(HF_IGNORE);
            f.labels = Some(l);
        }
        if m > 0 {
            last = Some(start + m as i64 - 1);
        }
        out.push(f);
    }
    out
}

/// The cases of `options`: the fixed ones, then `options.cases` random ones
/// (1..8 documents of 1..29 tokens, not powers of two; one of 61..131 with
/// [`CaseKind::Long`], or longer than a row under `max_seq_len`). Cases with
/// no token are left out.
pub fn generate(options: &CollatorOptions) -> Vec<CollatorCase> {
    let mut rng = ChaCha8Rng::seed_from_u64(options.seed);
    let mut out = Vec::new();
    for (i, docs) in fixed(options).into_iter().enumerate() {
        out.push(CollatorCase {
            features: features(&mut rng, &docs, options),
            source: format!("fixed case {i}"),
        });
    }
    for i in 0..options.cases {
        let docs = random_docs(&mut rng, options);
        out.push(CollatorCase {
            features: features(&mut rng, &docs, options),
            source: format!("random case {i} of seed {}", options.seed),
        });
    }
    out.retain(|c| c.tokens() > 0);
    out
}
