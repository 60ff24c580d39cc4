//! Judges one collated batch against the features it came from.

use std::collections::HashMap;

use ndarray::Array2;
use packshard_reference::decoder::packing::next_token_labels;
use packshard_reference::vocab::IGNORE_INDEX;

use super::{
    Collated, CollatorError, CollatorOptions, CuSeqlens, Feature, LabelForm, Mask, HF_IGNORE,
};

/// An additive mask entry counts as masked when it is at most -1e4: a
/// softmax weight `exp(s - 1e4)` underflows to 0 in f32 (its smallest
/// subnormal is `exp(-103.3)`) and in bf16 / f16 for any score `|s| < 9e3`,
/// so such an entry removes the key. Hugging Face writes
/// `torch.finfo(dtype).min` (at most -65504) or `-inf`.
pub const ADDITIVE_MASKED: f64 = -1e4;

/// What a batch that passed held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Judged {
    /// Rows `r`.
    pub rows: usize,
    /// Slots `r * n`.
    pub slots: usize,
    /// The fields returned (and judged).
    pub fields: Vec<&'static str>,
}

/// A real slot: document `d`, token `t`, chunk `k` (1.. in its row: a run
/// of one document's consecutive tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    d: usize,
    t: usize,
    k: usize,
}

fn err(field: &str, row: usize, index: usize, message: impl Into<String>) -> CollatorError {
    CollatorError::at(field, Some(row), Some(index), message)
}

fn check_shape(field: &str, got: &[usize], want: &[usize]) -> Result<(), CollatorError> {
    if got == want {
        return Ok(());
    }
    Err(CollatorError::at(
        field,
        None,
        None,
        format!("shape {got:?}, expected {want:?} (the shape of input_ids, [r, n])"),
    ))
}

/// Judges `out`, the collator's batch of `features`, under `options`:
///
/// - `input_ids` `[r, n]`: every token of every document exactly once
///   (P3: none lost, none repeated), a document's tokens in order and
///   contiguous within a row (C4; a document may continue in another row,
///   a split), every other slot `pad_token_id`. The layout is read from the
///   ids (unique per case; an EOS slot belongs to the document whose
///   second-to-last token precedes it).
/// - `labels`: `next_token_labels` of the reference over the chunks read
///   back (a chunk's last token predicts nothing: its next token is in
///   another row or document, C1), then a feature's prompt mask (its
///   `labels[t + 1] == -100`: token `t` predicts nothing) and the separator
///   (every chunk but a row's last predicts `separator_id`); compared in the
///   declared [`LabelForm`] (unshifted: `labels[row, 0]` not judged).
/// - `position_ids`: the feature's positions (0.. or a continuation chunk's
///   own, C6); absent, the model numbers each row `0..n`, which must then be
///   right.
/// - `cu_seqlens` / `seq_idx`: a boundary at every chunk's first slot
///   (C3), extra ones only at padding slots or row starts; at least one of
///   them or a 4D mask when a row holds two chunks (unless
///   `require_boundaries` is off).
/// - `max_seqlen`: at least the longest chunk, at most `n`.
/// - `num_items_in_batch`: the targets that are not ignored (C7).
/// - `attention_mask`: 4D, query `i` sees key `j` iff both are in one chunk
///   and `j <= i` (padding queries not judged); 2D, 1 on tokens, 0 on
///   padding.
///
/// # Errors
/// The first wrong value, as a [`CollatorError`] naming the field, the row
/// and the slot; `features` whose ids repeat (outside EOS) name `features`.
pub fn judge_collated(
    features: &[Feature],
    out: &Collated,
    options: &CollatorOptions,
) -> Result<Judged, CollatorError> {
    let (r, n) = out.input_ids.dim();
    if r == 0 || n == 0 {
        return Err(CollatorError::at(
            "input_ids",
            None,
            None,
            format!("shape [{r}, {n}]: no slot for the documents' tokens"),
        ));
    }
    let mut fields = vec!["input_ids", "labels"];
    check_shape("labels", out.labels.shape(), &[r, n])?;
    for (name, a) in [
        ("position_ids", &out.position_ids),
        ("seq_idx", &out.seq_idx),
    ] {
        if let Some(a) = a {
            check_shape(name, a.shape(), &[r, n])?;
            fields.push(name);
        }
    }
    let slots = read_layout(features, &out.input_ids, options)?;
    let ignore = options.ignore_index;

    // Targets in the shifted form.
    let mut want = Array2::from_elem((r, n), ignore);
    for p in 0..r {
        let ids: Vec<i64> = out.input_ids.row(p).to_vec();
        let chunks: Vec<usize> = slots[p].iter().map(|s| s.map_or(0, |s| s.k)).collect();
        let base = next_token_labels(&ids, &chunks, None).map_err(|e| {
            CollatorError::at("input_ids", Some(p), None, format!("layout refused: {e}"))
        })?;
        let last_chunk = chunks.iter().copied().max().unwrap_or(0);
        for c in 0..n {
            let Some(s) = slots[p][c] else { continue };
            let same_next = c + 1 < n && slots[p][c + 1].is_some_and(|x| x.k == s.k);
            let mut w = if base[c] == IGNORE_INDEX {
                ignore
            } else {
                base[c]
            };
            if same_next {
                if let Some(l) = &features[s.d].labels {
                    w = if l[s.t + 1] == HF_IGNORE {
                        ignore
                    } else {
                        l[s.t + 1]
                    };
                }
            } else if let Some(sep) = options.separator_id {
                if s.k != last_chunk {
                    w = sep;
                }
            }
            want[[p, c]] = w;
        }
    }
    let num_items = want.iter().filter(|&&w| w != ignore).count();

    // Positions.
    let pos_want = |p: usize, c: usize| slots[p][c].map(|s| features[s.d].position(s.t));
    for p in 0..r {
        for c in 0..n {
            let (Some(w), Some(s)) = (pos_want(p, c), slots[p][c]) else {
                continue;
            };
            match &out.position_ids {
                Some(pos) if pos[[p, c]] != w => {
                    return Err(err(
                        "position_ids",
                        p,
                        c,
                        format!(
                            "is {}, expected {w}: document {} token {} (each document from 0, a continuation chunk from its own first position, C6; P1)",
                            pos[[p, c]],
                            s.d,
                            s.t
                        ),
                    ));
                }
                None if c as i64 != w => {
                    return Err(err(
                        "position_ids",
                        p,
                        c,
                        format!(
                            "not returned: the model numbers the row 0..{n}, so document {} token {} gets position {c}, expected {w}",
                            s.d, s.t
                        ),
                    ));
                }
                _ => {}
            }
        }
    }

    // Boundaries.
    let chunk_starts: Vec<Vec<usize>> = (0..r)
        .map(|p| {
            (0..n)
                .filter(|&c| {
                    slots[p][c]
                        .is_some_and(|s| c == 0 || slots[p][c - 1].is_none_or(|x| x.k != s.k))
                })
                .collect()
        })
        .collect();
    let has_4d = matches!(
        out.attention_mask,
        Some(Mask::Block(_)) | Some(Mask::Additive(_))
    );
    if options.require_boundaries && out.cu_seqlens.is_none() && out.seq_idx.is_none() && !has_4d {
        if let Some(p) = chunk_starts.iter().position(|s| s.len() > 1) {
            let (a, b) = (chunk_starts[p][0], chunk_starts[p][1]);
            let (da, db) = (slots[p][a].unwrap().d, slots[p][b].unwrap().d);
            return Err(CollatorError::at(
                "cu_seqlens",
                Some(p),
                None,
                format!(
                    "no document boundaries (cu_seqlens, seq_idx or a 4D attention_mask): document {db} (slot {b}) attends to document {da} (slot {a})"
                ),
            ));
        }
    }
    if let Some(cu) = &out.cu_seqlens {
        fields.push("cu_seqlens");
        judge_cu(cu, &slots, &chunk_starts, n)?;
    }
    if let Some(si) = &out.seq_idx {
        for p in 0..r {
            let row = si.row(p);
            let mut given = vec![0usize];
            for c in 1..n {
                if row[c] < row[c - 1] {
                    return Err(err(
                        "seq_idx",
                        p,
                        c,
                        format!(
                            "is {}, below seq_idx[{p}, {}] = {} (non-decreasing in a row)",
                            row[c],
                            c - 1,
                            row[c - 1]
                        ),
                    ));
                }
                if row[c] != row[c - 1] {
                    given.push(c);
                }
            }
            judge_boundaries("seq_idx", p, &given, |c| c, &slots[p], &chunk_starts[p])?;
        }
    }
    let longest = chunk_starts
        .iter()
        .enumerate()
        .flat_map(|(p, starts)| {
            let slots = &slots;
            starts.iter().map(move |&c| {
                let k = slots[p][c].unwrap().k;
                (c..n)
                    .take_while(|&x| slots[p][x].is_some_and(|s| s.k == k))
                    .count()
            })
        })
        .max()
        .unwrap_or(0);
    if let Some(m) = out.max_seqlen {
        fields.push("max_seqlen");
        if m < longest || m > n {
            return Err(CollatorError::at(
                "max_seqlen",
                None,
                None,
                format!("is {m}, expected {longest} (the longest document chunk; any bound up to the row's {n} slots is valid: flash-attention sizes its grid by it)"),
            ));
        }
    }

    // Labels.
    for p in 0..r {
        let pairs: Vec<(usize, usize)> = match options.labels {
            LabelForm::Shifted => (0..n).map(|c| (c, c)).collect(),
            LabelForm::Unshifted => (0..n.saturating_sub(1)).map(|c| (c + 1, c)).collect(),
        };
        for (at, of) in pairs {
            let (got, w) = (out.labels[[p, at]], want[[p, of]]);
            if got != w {
                let whose = match slots[p][of] {
                    None => "a padding slot".to_string(),
                    Some(s) => format!("document {} token {}", s.d, s.t),
                };
                let form = match options.labels {
                    LabelForm::Shifted => "shifted: slot i holds slot i's target",
                    LabelForm::Unshifted => "unshifted: slot i + 1 holds slot i's target",
                };
                return Err(err(
                    "labels",
                    p,
                    at,
                    format!("is {got}, expected {w}: the target of {whose} ({form}; the next token of the same document, {ignore} after its last, on padding and on a prompt, C1)"),
                ));
            }
        }
        if options.labels == LabelForm::Unshifted && want[[p, n - 1]] != ignore {
            return Err(err(
                "labels",
                p,
                n - 1,
                "the row's last slot has a target, which unshifted labels cannot hold",
            ));
        }
    }
    if let Some(k) = out.num_items_in_batch {
        fields.push("num_items_in_batch");
        if k != num_items {
            return Err(CollatorError::at(
                "num_items_in_batch",
                None,
                None,
                format!("is {k}, expected {num_items} (the tokens with a target: the per-token loss divides by it, C7)"),
            ));
        }
    }
    if let Some(mask) = &out.attention_mask {
        fields.push("attention_mask");
        judge_mask(mask, &slots, r, n)?;
    }
    Ok(Judged {
        rows: r,
        slots: r * n,
        fields,
    })
}

/// Each slot's document and token (None: padding), chunks numbered per row.
fn read_layout(
    features: &[Feature],
    ids: &Array2<i64>,
    options: &CollatorOptions,
) -> Result<Vec<Vec<Option<Slot>>>, CollatorError> {
    let eos = options.eos_token_id;
    let mut lookup: HashMap<i64, (usize, usize)> = HashMap::new();
    for (d, f) in features.iter().enumerate() {
        for (t, &x) in f.input_ids.iter().enumerate() {
            if Some(x) == eos && t + 1 == f.input_ids.len() {
                continue;
            }
            if lookup.insert(x, (d, t)).is_some() || x == options.pad_token_id {
                return Err(CollatorError::at(
                    "features",
                    None,
                    Some(d),
                    format!("token {t} ({x}) repeats an id or is pad_token_id: the check reads the layout from ids unique in the case"),
                ));
            }
        }
    }
    let (r, n) = ids.dim();
    let mut seen: Vec<Vec<Option<(usize, usize)>>> = features
        .iter()
        .map(|f| vec![None; f.input_ids.len()])
        .collect();
    let mut out = vec![vec![None; n]; r];
    for p in 0..r {
        let mut k = 0;
        let mut done_in_row: Vec<usize> = Vec::new();
        for c in 0..n {
            let x = ids[[p, c]];
            let prev: Option<Slot> = if c > 0 { out[p][c - 1] } else { None };
            let dt = if let Some(&dt) = lookup.get(&x) {
                Some(dt)
            } else if Some(x) == eos
                && prev.is_some_and(|s| s.t + 2 == features[s.d].input_ids.len())
            {
                let s = prev.unwrap();
                Some((s.d, s.t + 1))
            } else if x == options.pad_token_id {
                None
            } else {
                return Err(err(
                    "input_ids",
                    p,
                    c,
                    format!(
                        "is {x}, which is no token of any document (nor pad_token_id {}{})",
                        options.pad_token_id,
                        if eos.is_some() {
                            ", nor an EOS after its document's other tokens"
                        } else {
                            ""
                        }
                    ),
                ));
            };
            let Some((d, t)) = dt else { continue };
            if let Some((p0, c0)) = seen[d][t] {
                return Err(err(
                    "input_ids",
                    p,
                    c,
                    format!(
                        "is document {d} token {t} again (first at [{p0}, {c0}]): a token repeated"
                    ),
                ));
            }
            seen[d][t] = Some((p, c));
            let continues = prev.is_some_and(|s| s.d == d);
            if continues && prev.unwrap().t + 1 != t {
                return Err(err(
                    "input_ids",
                    p,
                    c,
                    format!(
                        "is document {d} token {t} after its token {}: tokens out of order",
                        prev.unwrap().t
                    ),
                ));
            }
            if !continues {
                if done_in_row.contains(&d) {
                    return Err(err(
                        "input_ids",
                        p,
                        c,
                        format!("document {d} comes back in the row after other slots: a document's tokens in a row are contiguous (padding inside a document, C4)"),
                    ));
                }
                done_in_row.push(d);
                k += 1;
            }
            out[p][c] = Some(Slot { d, t, k });
        }
    }
    for (d, s) in seen.iter().enumerate() {
        if let Some(t) = s.iter().position(Option::is_none) {
            return Err(CollatorError::at(
                "input_ids",
                None,
                None,
                format!(
                    "document {d} token {t} (of {}) is in no slot: tokens lost (P3)",
                    s.len()
                ),
            ));
        }
    }
    Ok(out)
}

/// Judges a row's boundaries `given` (row-local slots; `index_of(slot)`:
/// the index in the field of a boundary at `slot`, or where a missing one
/// belongs): each chunk start present, any other only at padding or the
/// row's end.
fn judge_boundaries(
    field: &str,
    p: usize,
    given: &[usize],
    index_of: impl Fn(usize) -> usize,
    slots: &[Option<Slot>],
    starts: &[usize],
) -> Result<(), CollatorError> {
    for &s in starts {
        if s != 0 && !given.contains(&s) {
            let d = slots[s].unwrap();
            return Err(CollatorError::at(
                field,
                Some(p),
                Some(index_of(s)),
                format!(
                    "no boundary at slot {s}, where document {} (token {}) starts (boundaries {given:?}, expected {starts:?} and any at padding)",
                    d.d, d.t
                ),
            ));
        }
    }
    for &g in given {
        if let Some(Some(s)) = slots.get(g) {
            if !starts.contains(&g) {
                return Err(CollatorError::at(
                    field,
                    Some(p),
                    Some(index_of(g)),
                    format!(
                        "a boundary at slot {g} splits document {} (at its token {})",
                        s.d, s.t
                    ),
                ));
            }
        }
    }
    Ok(())
}

fn judge_cu(
    cu: &CuSeqlens,
    slots: &[Vec<Option<Slot>>],
    starts: &[Vec<usize>],
    n: usize,
) -> Result<(), CollatorError> {
    let r = slots.len();
    let rows: Vec<Vec<usize>> = match cu {
        CuSeqlens::Slots(cu) => {
            let total = r * n;
            if cu.first() != Some(&0) {
                return Err(CollatorError::at(
                    "cu_seqlens",
                    None,
                    Some(0),
                    format!("is {:?}, expected 0", cu.first()),
                ));
            }
            if cu.last() != Some(&total) {
                return Err(CollatorError::at(
                    "cu_seqlens",
                    None,
                    Some(cu.len() - 1),
                    format!("is {}, expected {total} (the last offset: every one of the r * n = {r} * {n} slots)", cu[cu.len() - 1]),
                ));
            }
            if let Some(i) = (1..cu.len()).find(|&i| cu[i] < cu[i - 1]) {
                return Err(CollatorError::at(
                    "cu_seqlens",
                    None,
                    Some(i),
                    format!("is {}, below cu_seqlens[{}] = {}", cu[i], i - 1, cu[i - 1]),
                ));
            }
            (0..r)
                .map(|p| {
                    cu.iter()
                        .filter(|&&x| x >= p * n && x <= p * n + n)
                        .map(|&x| x - p * n)
                        .collect()
                })
                .collect()
        }
        CuSeqlens::PerRow(rows) => {
            if rows.len() != r {
                return Err(CollatorError::at(
                    "cu_seqlens",
                    None,
                    None,
                    format!(
                        "{} rows, expected {r} (one per row of input_ids)",
                        rows.len()
                    ),
                ));
            }
            for (p, cu) in rows.iter().enumerate() {
                if cu.first() != Some(&0) {
                    return Err(err(
                        "cu_seqlens",
                        p,
                        0,
                        format!("is {:?}, expected 0", cu.first()),
                    ));
                }
                if let Some(i) = (1..cu.len()).find(|&i| cu[i] < cu[i - 1] || cu[i] > n) {
                    return Err(err(
                        "cu_seqlens",
                        p,
                        i,
                        format!("is {}, expected between cu_seqlens[{p}][{}] = {} and the row's {n} slots", cu[i], i - 1, cu[i - 1]),
                    ));
                }
                let last = cu[cu.len() - 1];
                if let Some(c) = (last..n).find(|&c| slots[p][c].is_some()) {
                    let s = slots[p][c].unwrap();
                    return Err(err(
                        "cu_seqlens",
                        p,
                        cu.len() - 1,
                        format!("is {last}, so slot {c} (document {} token {}) is in no segment (the slots past the last offset are padding)", s.d, s.t),
                    ));
                }
            }
            rows.iter()
                .map(|cu| {
                    let mut v = cu.clone();
                    v.push(n);
                    v
                })
                .collect()
        }
    };
    for p in 0..r {
        let given = &rows[p];
        let index_of = |g: usize| match cu {
            CuSeqlens::Slots(cu) => cu.partition_point(|&x| x < p * n + g),
            CuSeqlens::PerRow(rows) => rows[p].partition_point(|&x| x < g),
        };
        judge_boundaries("cu_seqlens", p, given, index_of, &slots[p], &starts[p])?;
    }
    Ok(())
}

fn judge_mask(
    mask: &Mask,
    slots: &[Vec<Option<Slot>>],
    r: usize,
    n: usize,
) -> Result<(), CollatorError> {
    let allowed = |p: usize, i: usize, j: usize| match (slots[p][i], slots[p][j]) {
        (Some(a), Some(b)) => a.k == b.k && j <= i,
        _ => false,
    };
    let who = |p: usize, c: usize| {
        slots[p][c].map_or("padding".to_string(), |s| {
            format!("document {} token {}", s.d, s.t)
        })
    };
    let check = |p: usize, i: usize, j: usize, attends: bool, shown: String| {
        let want = allowed(p, i, j);
        if attends == want {
            return Ok(());
        }
        let say = |a: bool| if a { "attends" } else { "masked" };
        Err(err(
            "attention_mask",
            p,
            i,
            format!(
                "[{p}, 0, {i}, {j}] is {shown} ({}), expected {}: query {} , key {} (block-causal: same document, j <= i)",
                say(attends),
                say(want),
                who(p, i),
                who(p, j)
            ),
        ))
    };
    match mask {
        Mask::Block(m) => {
            check_shape("attention_mask", m.shape(), &[r, 1, n, n])?;
            for p in 0..r {
                for i in (0..n).filter(|&i| slots[p][i].is_some()) {
                    for j in 0..n {
                        let v = m[[p, 0, i, j]];
                        check(p, i, j, v, v.to_string())?;
                    }
                }
            }
        }
        Mask::Additive(m) => {
            check_shape("attention_mask", m.shape(), &[r, 1, n, n])?;
            for p in 0..r {
                for i in (0..n).filter(|&i| slots[p][i].is_some()) {
                    for j in 0..n {
                        let v = m[[p, 0, i, j]];
                        if !(v == 0.0 || v <= ADDITIVE_MASKED) {
                            return Err(err(
                                "attention_mask",
                                p,
                                i,
                                format!("[{p}, 0, {i}, {j}] is {v}, expected 0 (attend) or at most {ADDITIVE_MASKED} (masked) in an additive mask"),
                            ));
                        }
                        check(p, i, j, v == 0.0, v.to_string())?;
                    }
                }
            }
        }
        Mask::Padding(m) => {
            check_shape("attention_mask", m.shape(), &[r, n])?;
            for p in 0..r {
                for c in 0..n {
                    let want = i64::from(slots[p][c].is_some());
                    if m[[p, c]] != want {
                        return Err(err(
                            "attention_mask",
                            p,
                            c,
                            format!(
                                "is {}, expected {want} (2D: 1 on tokens, 0 on padding; {})",
                                m[[p, c]],
                                who(p, c)
                            ),
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}
