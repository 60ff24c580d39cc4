//! The collator check of `packshard_equivalence::collator` for Python
//! (issue 36): `packshard.collator.check_batches` generates its cases and
//! judges each batch here. One entry, [`handle`], JSON in and out (the
//! batch's integer fields are small); the 4D mask, `[r, 1, n, n]` values,
//! comes as a numpy array. Bad requests answer `{"error": {...}}` (the
//! Python wrapper raises `PackshardError`); a batch judged wrong answers
//! `{"ok": false, "failure": {"field", "row", "index", "message"}}`.

use ndarray::{Array2, ArrayViewD, Ix4};
use packshard_equivalence::collator::{
    generate, judge_collated, CaseKind, Collated, CollatorError, CollatorOptions, CuSeqlens,
    Feature, LabelForm, Mask,
};
use serde_json::{json, Map, Value};

/// A bad request: the field named and what is wrong.
fn bad(field: &str, message: impl Into<String>) -> Value {
    json!({"error": {"kind": "invalid_argument", "field": field, "message": format!("{field}: {}", message.into())}})
}

type Req<T> = Result<T, Value>;

fn int(v: &Value, field: &str) -> Req<i64> {
    v.as_i64()
        .ok_or_else(|| bad(field, format!("{v} is not an integer")))
}

fn size(v: &Value, field: &str) -> Req<usize> {
    v.as_u64()
        .map(|x| x as usize)
        .ok_or_else(|| bad(field, format!("{v} is not a count (an integer >= 0)")))
}

fn ints(v: &Value, field: &str) -> Req<Vec<i64>> {
    let xs = v
        .as_array()
        .ok_or_else(|| bad(field, "expected a list of integers"))?;
    xs.iter()
        .enumerate()
        .map(|(i, x)| int(x, &format!("{field}[{i}]")))
        .collect()
}

fn sizes(v: &Value, field: &str) -> Req<Vec<usize>> {
    let xs = v
        .as_array()
        .ok_or_else(|| bad(field, "expected a list of counts"))?;
    xs.iter()
        .enumerate()
        .map(|(i, x)| size(x, &format!("{field}[{i}]")))
        .collect()
}

/// `[r, n]` from a list of `r` equal-length lists.
fn matrix(v: &Value, field: &str) -> Req<Array2<i64>> {
    let rows = v
        .as_array()
        .ok_or_else(|| bad(field, "expected [r, n] integers"))?;
    let rows: Vec<Vec<i64>> = rows
        .iter()
        .enumerate()
        .map(|(p, r)| ints(r, &format!("{field}[{p}]")))
        .collect::<Req<_>>()?;
    let n = rows.first().map_or(0, Vec::len);
    if let Some(p) = rows.iter().position(|r| r.len() != n) {
        return Err(bad(
            field,
            format!("row {p} has {} values, row 0 {n}", rows[p].len()),
        ));
    }
    let r = rows.len();
    Array2::from_shape_vec((r, n), rows.concat()).map_err(|e| bad(field, e.to_string()))
}

fn options(v: &Value) -> Req<CollatorOptions> {
    let mut o = CollatorOptions::default();
    let Some(m) = v.as_object() else {
        return Err(bad("options", "expected an object"));
    };
    for (k, x) in m {
        let opt_int = |x: &Value| -> Req<Option<i64>> {
            if x.is_null() {
                Ok(None)
            } else {
                int(x, k).map(Some)
            }
        };
        match k.as_str() {
            "cases" => o.cases = size(x, k)?,
            "seed" => o.seed = size(x, k)? as u64,
            "labels" => {
                o.labels = match x.as_str() {
                    Some("shifted") => LabelForm::Shifted,
                    Some("unshifted") => LabelForm::Unshifted,
                    _ => return Err(bad(k, format!("{x}, expected 'shifted' or 'unshifted'"))),
                }
            }
            "ignore_index" => o.ignore_index = int(x, k)?,
            "eos_token_id" => o.eos_token_id = opt_int(x)?,
            "separator_id" => o.separator_id = opt_int(x)?,
            "pad_token_id" => o.pad_token_id = int(x, k)?,
            "max_seq_len" => {
                o.max_seq_len = if x.is_null() { None } else { Some(size(x, k)?) };
                if o.max_seq_len == Some(0) {
                    return Err(bad(k, "0: a row holds at least one slot"));
                }
            }
            "require_boundaries" => {
                o.require_boundaries = x.as_bool().ok_or_else(|| bad(k, "expected a bool"))?
            }
            "kinds" => {
                let names = x
                    .as_array()
                    .ok_or_else(|| bad(k, "expected a list of names"))?;
                o.kinds = names
                    .iter()
                    .map(|n| match n.as_str() {
                        Some("one_token") => Ok(CaseKind::OneToken),
                        Some("empty") => Ok(CaseKind::Empty),
                        Some("prompt") => Ok(CaseKind::Prompt),
                        Some("continuation") => Ok(CaseKind::Continuation),
                        Some("long") => Ok(CaseKind::Long),
                        _ => Err(bad(k, format!("unknown kind {n}, expected one_token, empty, prompt, continuation, long"))),
                    })
                    .collect::<Req<_>>()?;
            }
            _ => return Err(bad(k, "unknown option")),
        }
    }
    if o.eos_token_id == Some(o.ignore_index) {
        return Err(bad("eos_token_id", "is the ignore_index"));
    }
    Ok(o)
}

fn feature_to_json(f: &Feature) -> Value {
    let mut m = Map::new();
    m.insert("input_ids".into(), json!(f.input_ids));
    if let Some(l) = &f.labels {
        m.insert("labels".into(), json!(l));
    }
    if let Some(p) = &f.position_ids {
        m.insert("position_ids".into(), json!(p));
    }
    Value::Object(m)
}

fn features(v: &Value) -> Req<Vec<Feature>> {
    let xs = v
        .as_array()
        .ok_or_else(|| bad("features", "expected a list of features"))?;
    xs.iter()
        .enumerate()
        .map(|(d, f)| {
            let at = |k: &str| format!("features[{d}].{k}");
            let ids = ints(&f["input_ids"], &at("input_ids"))?;
            let opt = |k: &str| -> Req<Option<Vec<i64>>> {
                match f.get(k) {
                    None | Some(Value::Null) => Ok(None),
                    Some(x) => {
                        let v = ints(x, &at(k))?;
                        if v.len() != ids.len() {
                            return Err(bad(
                                &at(k),
                                format!("{} values for {} input_ids", v.len(), ids.len()),
                            ));
                        }
                        Ok(Some(v))
                    }
                }
            };
            Ok(Feature {
                labels: opt("labels")?,
                position_ids: opt("position_ids")?,
                input_ids: ids,
            })
        })
        .collect()
}

fn collated(v: &Value, mask: Option<(ArrayViewD<'_, f64>, &str)>) -> Req<Collated> {
    let opt_matrix = |k: &str| -> Req<Option<Array2<i64>>> {
        match v.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => matrix(x, k).map(Some),
        }
    };
    let opt_size = |k: &str| -> Req<Option<usize>> {
        match v.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => size(x, k).map(Some),
        }
    };
    let cu = match (v.get("cu_seqlens"), v.get("cu_seqlens_per_row")) {
        (Some(x), None) if !x.is_null() => Some(CuSeqlens::Slots(sizes(x, "cu_seqlens")?)),
        (None, Some(x)) => {
            let rows = x
                .as_array()
                .ok_or_else(|| bad("cu_seqlens", "expected one list per row"))?;
            Some(CuSeqlens::PerRow(
                rows.iter()
                    .enumerate()
                    .map(|(p, r)| sizes(r, &format!("cu_seqlens[{p}]")))
                    .collect::<Req<_>>()?,
            ))
        }
        (Some(_), Some(_)) => return Err(bad("cu_seqlens", "give it flat or per row, not both")),
        _ => None,
    };
    let attention_mask = match mask {
        None => match v.get("attention_mask") {
            None | Some(Value::Null) => None,
            Some(x) => Some(Mask::Padding(matrix(x, "attention_mask")?)),
        },
        Some((m, form)) => {
            let m = m
                .into_dimensionality::<Ix4>()
                .map_err(|_| bad("attention_mask", "a 4D mask is [r, 1, n, n]"))?;
            Some(match form {
                "bool" => Mask::Block(m.mapv(|x| x != 0.0)),
                "additive" => Mask::Additive(m.to_owned()),
                _ => {
                    return Err(bad(
                        "mask_form",
                        format!("{form}, expected bool or additive"),
                    ))
                }
            })
        }
    };
    Ok(Collated {
        input_ids: opt_matrix("input_ids")?
            .ok_or_else(|| bad("input_ids", "required field is missing"))?,
        labels: opt_matrix("labels")?.ok_or_else(|| bad("labels", "required field is missing"))?,
        position_ids: opt_matrix("position_ids")?,
        cu_seqlens: cu,
        seq_idx: opt_matrix("seq_idx")?,
        max_seqlen: opt_size("max_seqlen")?,
        num_items_in_batch: opt_size("num_items_in_batch")?,
        attention_mask,
    })
}

fn failure(e: &CollatorError) -> Value {
    json!({"field": e.field, "row": e.row, "index": e.index, "message": e.message, "text": e.to_string()})
}

/// One request: `{"op": "cases", "options": {...}}` gives the cases
/// (`[{"features", "source", "describe", "tokens"}]`); `{"op": "judge",
/// "features": [...], "batch": {...}, "options": {...}, "mask_form":
/// "bool" | "additive"}` with `mask` the 4D mask judges one batch:
/// `{"ok": true, "rows", "slots", "fields"}` or `{"ok": false, "failure"}`.
/// `batch` holds `[r, n]` lists (`input_ids`, `labels`, `position_ids`,
/// `seq_idx`, a 2D `attention_mask`), `cu_seqlens` (flat over the `r * n`
/// slots) or `cu_seqlens_per_row`, `max_seqlen`, `num_items_in_batch`.
pub fn handle(request: &str, mask: Option<ArrayViewD<'_, f64>>) -> Value {
    let run = || -> Req<Value> {
        let v: Value = serde_json::from_str(request).map_err(|e| bad("request", e.to_string()))?;
        let o = options(v.get("options").unwrap_or(&json!({})))?;
        match v["op"].as_str() {
            Some("cases") => Ok(Value::Array(
                generate(&o)
                    .iter()
                    .map(|c| {
                        json!({
                            "features": c.features.iter().map(feature_to_json).collect::<Vec<_>>(),
                            "source": c.source,
                            "describe": c.describe(),
                            "tokens": c.tokens(),
                        })
                    })
                    .collect(),
            )),
            Some("judge") => {
                let f = features(&v["features"])?;
                let form = v["mask_form"].as_str().unwrap_or("bool");
                let b = collated(&v["batch"], mask.map(|m| (m, form)))?;
                match judge_collated(&f, &b, &o) {
                    Ok(j) => Ok(
                        json!({"ok": true, "rows": j.rows, "slots": j.slots, "fields": j.fields}),
                    ),
                    // Features the judge cannot read a layout from are bad
                    // input, not the collator's fault.
                    Err(e) if e.field == "features" => Err(bad(
                        &format!("features[{}]", e.index.unwrap_or(0)),
                        e.message,
                    )),
                    Err(e) => Ok(json!({"ok": false, "failure": failure(&e)})),
                }
            }
            _ => Err(bad("op", "expected 'cases' or 'judge'")),
        }
    };
    run().unwrap_or_else(|e| e)
}

/// `packshard._native.collator_json(request, mask=None)`: [`handle`], its
/// answer as JSON text; a panic becomes an `internal` error answer.
#[cfg(feature = "python")]
#[pyo3::pyfunction]
#[pyo3(signature = (request, mask=None))]
pub fn collator_json(
    py: pyo3::Python<'_>,
    request: String,
    mask: Option<numpy::PyReadonlyArrayDyn<'_, f64>>,
) -> String {
    let view = mask.as_ref().map(|m| m.as_array());
    let r = py.detach(|| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handle(&request, view)))
    });
    r.unwrap_or_else(|_| {
        json!({"error": {"kind": "internal", "field": null, "message": "packshard panicked in the collator check (a bug in packshard, please report it with the case)"}})
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_then_judge_round_trip_and_a_wrong_label_is_named() {
        let cases = handle(r#"{"op": "cases", "options": {"cases": 3}}"#, None);
        let first = &cases[0]["features"];
        assert_eq!(first.as_array().unwrap().len(), 3, "C3's [3, 1, 2] first");
        let ids: Vec<i64> = first
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|f| ints(&f["input_ids"], "x").unwrap())
            .collect();
        let ig = -100;
        let labels = vec![ids[1], ids[2], ig, ig, ids[5], ig];
        let mut batch = json!({
            "input_ids": [ids], "labels": [labels], "position_ids": [[0, 1, 2, 0, 0, 1]],
            "cu_seqlens": [0, 3, 4, 6], "max_seqlen": 3, "num_items_in_batch": 3,
        });
        let req = |b: &Value| json!({"op": "judge", "features": first, "batch": b}).to_string();
        let ok = handle(&req(&batch), None);
        assert_eq!(ok["ok"], json!(true), "{ok}");
        batch["cu_seqlens"] = json!([0, 3, 6]);
        let no = handle(&req(&batch), None);
        assert_eq!(no["failure"]["field"], json!("cu_seqlens"), "{no}");
        assert_eq!(no["failure"]["index"], json!(2), "{no}");
    }

    #[test]
    fn bad_requests_name_the_field() {
        let e = handle(r#"{"op": "cases", "options": {"labels": "both"}}"#, None);
        assert_eq!(e["error"]["field"], json!("labels"));
        let e = handle(
            r#"{"op": "judge", "features": [{"input_ids": [1]}], "batch": {"input_ids": [[1], [2, 3]], "labels": [[1]]}}"#,
            None,
        );
        assert_eq!(e["error"]["field"], json!("input_ids"), "{e}");
        let e = handle(r#"{"op": "cases", "options": {"kinds": ["tiny"]}}"#, None);
        assert!(e["error"]["message"].as_str().unwrap().contains("tiny"));
    }
}
