//! The golden vectors judge every registered implementation: each entry of
//! a family with an `eval` op runs the golden cases of that op (the set of
//! its precision: f64, f32 or bf16) through `eval`, and `check` must pass
//! every output under the manifest's rule. Cases an entry declines (an
//! algorithm it does not implement) are named and skipped; each entry must
//! run at least one case.

use packshard_oracle::golden::{
    self, cases, check, io,
    registry::{dtype_for, results_of},
};
use packshard_oracle::registry::{self, Family};

#[test]
fn every_registered_implementation_passes_the_golden_set_of_its_precision() {
    let root =
        std::env::temp_dir().join(format!("packshard-golden-registry-{}", std::process::id()));
    let mut checked = 0;
    for family in Family::ALL {
        if family.eval_op().is_none() {
            continue;
        }
        for entry in registry::of(family) {
            let dtype = dtype_for(entry.precision);
            let dir = root.join(dtype.name());
            if !dir.join("manifest.json").exists() {
                golden::write(&dir, dtype).unwrap();
            }
            let set = cases::all(dtype).unwrap();
            let out = results_of(&set, entry.name).unwrap();
            if out.cases.is_empty() && !out.refused.is_empty() {
                // Every case refused: only an unavailable entry may do that.
                assert!(
                    out.refused
                        .iter()
                        .all(|(_, m)| m.contains("cannot run here")),
                    "{}: {:?}",
                    entry.name,
                    out.refused
                );
                eprintln!("{}: skipped: {}", entry.name, out.refused[0].1);
                continue;
            }
            assert!(
                !out.cases.is_empty(),
                "{}: no golden case of {}",
                entry.name,
                family.name()
            );
            let file = root.join(format!("results-{}.safetensors", entry.name));
            std::fs::write(&file, io::serialize(&out.tensors).unwrap()).unwrap();
            let report = check::check(&dir, &file, false).unwrap();
            assert!(
                report.passed(),
                "{} on the {} set:\n{}",
                entry.name,
                dtype.name(),
                report.table()
            );
            eprintln!(
                "{} ({} set): {} cases passed{}",
                entry.name,
                dtype.name(),
                out.cases.len(),
                if out.refused.is_empty() {
                    String::new()
                } else {
                    format!(
                        ", declined {:?}",
                        out.refused.iter().map(|(c, _)| c).collect::<Vec<_>>()
                    )
                }
            );
            checked += 1;
        }
    }
    assert!(checked >= 9, "only {checked} implementations checked");
    let _ = std::fs::remove_dir_all(&root);
}
