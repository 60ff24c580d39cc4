//! The `pack` and `batch` ops.

use packshard_reference::packing::histogram::MAX_HISTOGRAM_LENGTH;
use packshard_reference::packing::{
    bound_is_cheap, pack_histogram, pack_lengths, with_bound, Algorithm, Histogram, Overlong,
    PackedBatch, PackingConfig, PackingMetrics,
};
use serde_json::{json, Value};

use super::{Case, EvalError};

const CONFIG_FIELDS: [&str; 4] = [
    "max_seq_len",
    "algorithm",
    "max_sequences_per_pack",
    "overlong",
];

fn config(case: &Case) -> Result<PackingConfig, EvalError> {
    let algorithm = case
        .opt_parse::<Algorithm>("algorithm")?
        .unwrap_or(Algorithm::Spfhp);
    Ok(PackingConfig::new(algorithm, case.usize("max_seq_len")?)
        .with_max_sequences_per_pack(case.opt_usize("max_sequences_per_pack")?)
        .with_overlong(case.opt_parse::<Overlong>("overlong")?.unwrap_or_default()))
}

/// A `pack` or `batch` case, whose fields are the packing config's and
/// `extra`, and the config it gives.
fn packing_case<'a>(
    value: &'a Value,
    extra: &[&str],
) -> Result<(Case<'a>, PackingConfig), EvalError> {
    let allowed: Vec<&str> = CONFIG_FIELDS.iter().chain(extra).copied().collect();
    let case = Case::new(value, &allowed)?;
    let config = config(&case)?;
    Ok((case, config))
}

/// The metrics fields of a `pack` result (everything but the wall time, so
/// results are reproducible).
pub(crate) fn metrics_json(m: &PackingMetrics) -> serde_json::Map<String, Value> {
    let mut v = serde_json::to_value(m).expect("metrics serialize");
    let obj = v.as_object_mut().expect("metrics are an object");
    obj.shift_remove("seconds");
    obj.clone()
}

/// The metrics with the lower bound for the config's limit
/// ([`with_bound`]) when `want` says so (`None`: only where it is cheap,
/// [`bound_is_cheap`]); where it is not wanted or cannot be computed (a
/// `lengths` input over the histogram's length limit) the bound fields stay
/// `null` — the packing itself stands. An `lphp` result always carries its own.
fn bounded(
    metrics: PackingMetrics,
    histogram: packshard_reference::Result<Histogram>,
    config: &PackingConfig,
    want: Option<bool>,
) -> PackingMetrics {
    if metrics.bound_packs.is_some() || want == Some(false) {
        return metrics;
    }
    histogram
        .and_then(|h| {
            if want.is_none() && !bound_is_cheap(&h, config) {
                return Ok(metrics.clone());
            }
            with_bound(metrics.clone(), &h, config)
        })
        .unwrap_or(metrics)
}

/// `pack`: `lengths` ([n]) or `histogram` ([[length, count], ...]), `max_seq_len`,
/// `algorithm` (default `spfhp`), `max_sequences_per_pack`, `overlong`,
/// `bound` (`true`: always compute the lower bound, `false`: never, absent:
/// only where it is cheap). The result carries `bound_packs`,
/// `bound_efficiency` and `bound_depth` (`null` where not computed).
pub(super) fn pack(value: &Value) -> Result<Value, EvalError> {
    let (case, config) = packing_case(value, &["lengths", "histogram", "bound"])?;
    let want_bound = case.opt_bool("bound")?;
    let mut out = match case.either("lengths", "histogram")? {
        true => {
            let lengths = case.usize_list("lengths")?;
            let plan = pack_lengths(&lengths, &config)?;
            let metrics = bounded(
                plan.metrics.clone(),
                Histogram::from_lengths(&lengths),
                &config,
                want_bound,
            );
            let mut out = metrics_json(&metrics);
            out.insert(
                "strategies".into(),
                serde_json::to_value(&plan.strategies).expect("serialize"),
            );
            out.insert(
                "packs".into(),
                serde_json::to_value(&plan.packs).expect("serialize"),
            );
            out.insert("empty_sequence_indices".into(), json!(plan.empty_sequences));
            out.insert(
                "dropped_sequence_indices".into(),
                json!(plan.dropped_sequences),
            );
            out
        }
        false => {
            let pairs = case.pairs("histogram")?;
            let max = pairs.iter().map(|p| p.0).max().unwrap_or(0);
            if max > MAX_HISTOGRAM_LENGTH {
                return Err(EvalError::invalid(
                    "histogram",
                    format!("length {max} is over the {MAX_HISTOGRAM_LENGTH} a histogram can hold"),
                ));
            }
            let mut counts = vec![0u64; max + 1];
            for (i, (length, count)) in pairs.into_iter().enumerate() {
                counts[length] = counts[length].checked_add(count).ok_or_else(|| {
                    EvalError::invalid(&format!("histogram[{i}]"), "count overflows")
                })?;
            }
            let histogram = Histogram::from_counts(counts);
            let packing = pack_histogram(&histogram, &config)?;
            let metrics = bounded(packing.metrics.clone(), Ok(histogram), &config, want_bound);
            let mut out = metrics_json(&metrics);
            out.insert(
                "strategies".into(),
                serde_json::to_value(&packing.strategies).expect("serialize"),
            );
            out
        }
    };
    out.insert("op".into(), json!("pack"));
    Ok(Value::Object(out))
}

/// `batch`: `sequences` ([[token ids], ...]), `max_seq_len`, `algorithm`,
/// `max_sequences_per_pack`, `overlong`, `pad_token_id` (0), `position_offset` (0).
pub(super) fn batch(value: &Value) -> Result<Value, EvalError> {
    let (case, config) = packing_case(value, &["sequences", "pad_token_id", "position_offset"])?;
    let sequences = case.i64_lists("sequences")?;
    let pad = case.opt_i64("pad_token_id")?.unwrap_or(0);
    let offset = case.opt_i64("position_offset")?.unwrap_or(0);
    let (plan, batch) = PackedBatch::from_sequences(&sequences, &config, pad, offset)?;
    let rows =
        |a: &ndarray::Array2<i64>| -> Value { a.rows().into_iter().map(|r| r.to_vec()).collect() };
    Ok(json!({
        "op": "batch",
        "input_ids": rows(&batch.input_ids),
        "position_ids": rows(&batch.position_ids),
        "sequence_ids": rows(&batch.sequence_ids),
        "cu_seqlens": batch.cu_seqlens,
        "max_seqlen": batch.max_seqlen,
        "sequence_index": batch.sequence_index,
        "packs": plan.packs,
        "num_packs": batch.num_packs(),
        "empty_sequence_indices": plan.empty_sequences,
        "dropped_sequence_indices": plan.dropped_sequences,
        "dropped_tokens": plan.metrics.dropped_tokens,
    }))
}
