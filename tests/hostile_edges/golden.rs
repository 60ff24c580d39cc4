//! `packshard check` trusts nothing it can verify: an edited manifest (a
//! tolerance, a shape, a name) is refused with status 2, an expected tensor
//! of another shape than the manifest's is refused even when the manifest's
//! own hash was forged, an untouched set passes, and a wrong result still
//! fails with status 1.

use std::path::{Path, PathBuf};

use packshard::golden::io::{load, serialize, Tensor};
use packshard::golden::{self, cases, Dtype};

use super::*;

/// A fresh golden set (f64) in a directory of its own, and the results
/// file that answers every case with its expected values.
fn golden_set(name: &str) -> (PathBuf, PathBuf) {
    let dir = temp_path("edges-golden", name);
    let _ = std::fs::remove_dir_all(&dir);
    let o = packshard(&["golden", "--out", dir.to_str().unwrap()], None);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let results = dir.with_extension("results.safetensors");
    write_results(&results, |_, _| {});
    (dir, results)
}

/// Writes every expected output under its result name, after `edit` (given
/// the result name and the values).
fn write_results(path: &Path, edit: impl Fn(&str, &mut [f64])) {
    let cases = cases::all(Dtype::F64).unwrap();
    let tensors: Vec<Tensor> = cases
        .iter()
        .flat_map(|c| {
            c.outputs.iter().map(|o| {
                let name = c.result_name(&o.tensor.name);
                let mut values = o.tensor.as_f64();
                edit(&name, &mut values);
                Tensor::float(&name, &o.tensor.shape, values, Dtype::F64)
            })
        })
        .collect();
    std::fs::write(path, serialize(&tensors).unwrap()).unwrap();
}

fn check(dir: &Path, results: &Path) -> Output {
    let o = packshard(
        &["check", dir.to_str().unwrap(), results.to_str().unwrap()],
        None,
    );
    assert_clean(&o, "check");
    o
}

/// The manifest edited by `edit` (on its parsed JSON) and written back
/// pretty-printed; when `forge`, its hash recomputed as `packshard golden`
/// would (what someone who read the code could do).
fn edit_manifest(dir: &Path, forge: bool, edit: impl Fn(&mut Value)) {
    let path = dir.join("manifest.json");
    let mut m: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut m);
    let mut text = serde_json::to_string_pretty(&m).unwrap() + "\n";
    if forge {
        let hash = m[golden::SEAL_KEY].as_str().unwrap().to_string();
        text = golden::seal(&text.replace(&hash, &"0".repeat(64)));
    }
    std::fs::write(&path, text).unwrap();
}

/// Every output entry of every case.
fn outputs(m: &mut Value) -> impl Iterator<Item = &mut Value> {
    m["cases"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .flat_map(|c| c["outputs"].as_object_mut().unwrap().values_mut())
}

/// Results 1.0 off in every value of every output: out of every tolerance
/// the set states.
fn wrong(_: &str, values: &mut [f64]) {
    values.iter_mut().for_each(|x| *x += 1.0);
}

#[test]
fn an_untouched_set_passes_and_a_wrong_result_fails() {
    let (dir, results) = golden_set("untouched");
    let o = check(&dir, &results);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(common::stdout_text(&o).contains("PASS: 131 of 131"));
    write_results(&results, wrong);
    let o = check(&dir, &results);
    assert_eq!(o.status.code(), Some(1), "{}", common::stdout_text(&o));
    assert!(common::stdout_text(&o).contains("FAIL:"));
}

#[test]
fn an_edited_manifest_is_refused_whatever_was_edited() {
    #[allow(clippy::type_complexity)]
    let edits: Vec<(&str, Box<dyn Fn(&mut Value)>)> = vec![
        (
            "every tolerance 1e300",
            Box::new(|m| {
                for o in outputs(m) {
                    o["tolerance"]["atol"] = json!(1e300);
                    o["tolerance"]["rel"] = json!(1e300);
                }
            }),
        ),
        (
            "one tolerance",
            Box::new(|m| {
                let o = outputs(m).next().unwrap();
                o["tolerance"]["atol"] = json!(1.0);
            }),
        ),
        (
            "every shape [1]",
            Box::new(|m| outputs(m).for_each(|o| o["shape"] = json!([1]))),
        ),
        (
            "a result name",
            Box::new(|m| {
                let o = outputs(m).next().unwrap();
                o["result"] = json!("pack_spfhp/renamed");
            }),
        ),
        ("whitespace only", Box::new(|_| {})),
    ];
    for (what, edit) in edits {
        let (dir, results) = golden_set("edited");
        edit_manifest(&dir, false, edit);
        // Wrong results must not pass an edited set: refused, status 2.
        write_results(&results, wrong);
        let o = check(&dir, &results);
        assert_eq!(o.status.code(), Some(2), "{what}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("does not match its manifest_sha256"),
            "{what}: {}",
            stderr(&o)
        );
    }
    // Without its hash, a manifest is refused as well.
    let (dir, results) = golden_set("unsealed");
    edit_manifest(&dir, false, |m| {
        m.as_object_mut().unwrap().remove(golden::SEAL_KEY);
    });
    let o = check(&dir, &results);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("needs exactly one manifest_sha256"));
}

#[test]
fn a_shape_edit_is_refused_even_with_a_forged_hash() {
    // The forged hash passes the seal; the expected tensors' own shapes
    // (and a results file of the manifest's shapes) still disagree.
    let (dir, results) = golden_set("forged");
    edit_manifest(&dir, true, |m| {
        outputs(m).for_each(|o| o["shape"] = json!([1]))
    });
    let o = check(&dir, &results);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("the manifest says I64 [1]"),
        "{}",
        stderr(&o)
    );
    // A negative control: the forged hash alone (no edit) passes, so the
    // refusal above is the shape check's.
    let (dir, results) = golden_set("forged-control");
    edit_manifest(&dir, true, |_| {});
    let o = check(&dir, &results);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[test]
fn an_expected_tensor_reshaped_in_its_file_is_refused() {
    // Same bytes (so the same sha256), another shape in the header.
    let (dir, results) = golden_set("reshaped");
    let path = dir.join("expected/cross_entropy.safetensors");
    let tensors = load("x", &std::fs::read(&path).unwrap()).unwrap();
    let reshaped: Vec<Tensor> = tensors
        .iter()
        .map(|(n, l)| Tensor::float(n, &[l.values.len()], l.values.clone(), Dtype::F64))
        .collect();
    assert!(tensors.iter().any(|(_, l)| l.shape.len() != 1));
    std::fs::write(&path, serialize(&reshaped).unwrap()).unwrap();
    let o = check(&dir, &results);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("the manifest says"), "{}", stderr(&o));
}
