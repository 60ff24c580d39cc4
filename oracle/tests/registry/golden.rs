//! The golden vectors judge every registered implementation
//! (`<family>::<impl>::golden`): each entry of a family with an `eval` op
//! runs the golden cases of that op (the set of its precision: f64, f32 or
//! bf16) through `eval`, and `check` must pass every output under the
//! manifest's rule. Cases an entry declines (an algorithm it does not
//! implement) are named and skipped; each entry must run at least one case.

use std::path::PathBuf;
use std::sync::Mutex;

use packshard_oracle::golden::{
    self, cases, check, io,
    registry::{dtype_for, results_of},
};
use packshard_oracle::registry::{self, Entry, Family};

use crate::harness::{Config, Tests};

/// Where this process writes its golden sets and results (removed by
/// [`clean`]).
fn root() -> PathBuf {
    std::env::temp_dir().join(format!("packshard-golden-registry-{}", std::process::id()))
}

/// Held while a golden set is written, so that two tests never write the
/// same one at once.
static WRITING: Mutex<()> = Mutex::new(());

/// Removes what the golden tests wrote.
pub fn clean() {
    let _ = std::fs::remove_dir_all(root());
}

fn golden_of<K: ?Sized>(family: Family, entry: &Entry<K>) -> Result<String, String> {
    let dtype = dtype_for(entry.precision);
    let dir = root().join(dtype.name());
    {
        let _held = WRITING.lock().unwrap_or_else(|e| e.into_inner());
        if !dir.join("manifest.json").exists() {
            golden::write(&dir, dtype).map_err(|e| e.to_string())?;
        }
    }
    // This family's cases only (the reference of each family runs its own).
    let set: Vec<_> = cases::all(dtype)
        .map_err(|e| e.to_string())?
        .into_iter()
        .filter(|c| family.eval_op() == Some(c.op))
        .collect();
    let out = results_of(&set, entry.name).map_err(|e| e.to_string())?;
    if out.cases.is_empty() {
        return Err(format!(
            "no golden case of {} ran; refused: {:?}",
            family.name(),
            out.refused
        ));
    }
    let file = root().join(format!(
        "results-{}-{}.safetensors",
        family.name(),
        entry.name
    ));
    std::fs::write(
        &file,
        io::serialize(&out.tensors).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    let report = check::check(&dir, &file, false).map_err(|e| e.to_string())?;
    if !report.passed() {
        return Err(format!("on the {} set:\n{}", dtype.name(), report.table()));
    }
    let declined = if out.refused.is_empty() {
        String::new()
    } else {
        format!(
            ", declined {:?}",
            out.refused.iter().map(|(c, _)| c).collect::<Vec<_>>()
        )
    };
    Ok(format!(
        "{} set: {} cases passed{declined}",
        dtype.name(),
        out.cases.len()
    ))
}

/// Adds the golden test of every entry of every family with an `eval` op.
pub fn add(t: &mut Tests, attention: &[Entry<dyn packshard_reference::ops::AttentionOp>]) {
    let g = "golden";
    let r = Config::Registered;
    t.each(Family::Attention, attention, g, r, 4, |_, e| {
        golden_of(Family::Attention, e)
    });
    t.each(
        Family::CrossEntropy,
        &registry::cross_entropy(),
        g,
        r,
        2,
        |_, e| golden_of(Family::CrossEntropy, e),
    );
    t.each(
        Family::LinearCrossEntropy,
        &registry::linear_cross_entropy(),
        g,
        r,
        3,
        |_, e| golden_of(Family::LinearCrossEntropy, e),
    );
    t.each(
        Family::Embedding,
        &registry::embedding(),
        g,
        r,
        1,
        |_, e| golden_of(Family::Embedding, e),
    );
}
