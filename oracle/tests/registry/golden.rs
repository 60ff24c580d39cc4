//! The golden vectors judge every registered implementation
//! (`<family>::<impl>::golden`): each entry of a family with an `eval` op
//! runs the golden cases of that op (the set of its precision: f64, f32 or
//! bf16) through `eval`, and `check` must pass every output under the
//! manifest's rule. Each entry must run at least one case.
//!
//! An attention entry runs exactly the cases within its declared
//! [`AttentionSupport`](packshard_reference::ops::AttentionSupport): a case
//! outside it (a window, cross attention, GQA the kernel does not declare)
//! must be refused by `eval` and is named as skipped, with the option, in
//! the test's report; a refused case within it, or a case outside it that
//! runs, fails the test. Entries of the other families declare no support
//! per case: a case one refuses (an algorithm it does not implement) is
//! named as declined.

use std::path::PathBuf;
use std::sync::Mutex;

use packshard_oracle::golden::{
    self, cases, check, io,
    registry::{outside_attention_support, results_of},
    GoldenCase,
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

/// Why the entry must refuse a case (its declared support), for a family
/// that declares one; `None` for the others.
type Declared<'a> = Option<&'a dyn Fn(&GoldenCase) -> Option<String>>;

fn golden_of<K: ?Sized>(
    family: Family,
    entry: &Entry<K>,
    declared: Declared<'_>,
) -> Result<String, String> {
    let dtype = entry.precision;
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
    let mut skipped = Vec::new();
    if let Some(outside) = declared {
        for case in &set {
            let refused = out.refused.iter().find(|(c, _)| *c == case.name);
            match (outside(case), refused) {
                (Some(why), Some(_)) => skipped.push(format!("{} ({why})", case.name)),
                (None, Some((_, e))) => {
                    return Err(format!(
                        "refused {}, which is within its declared support: {e}",
                        case.name
                    ))
                }
                (Some(why), None) => {
                    return Err(format!(
                        "ran {}, which is outside its declared support ({why}): it must refuse it",
                        case.name
                    ))
                }
                (None, None) => {}
            }
        }
    }
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
    let declined = if !skipped.is_empty() {
        format!(
            "; skipped, outside its declared support: {}",
            skipped.join(", ")
        )
    } else if out.refused.is_empty() {
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
    t.each(Family::Attention, attention, g, r, 4, |imp, e| {
        let support = imp.support();
        let outside = move |c: &GoldenCase| outside_attention_support(c, support);
        golden_of(Family::Attention, e, Some(&outside))
    });
    t.each(
        Family::CrossEntropy,
        &registry::cross_entropy(),
        g,
        r,
        2,
        |_, e| golden_of(Family::CrossEntropy, e, None),
    );
    t.each(
        Family::LinearCrossEntropy,
        &registry::linear_cross_entropy(),
        g,
        r,
        3,
        |_, e| golden_of(Family::LinearCrossEntropy, e, None),
    );
    t.each(
        Family::Embedding,
        &registry::embedding(),
        g,
        r,
        1,
        |_, e| golden_of(Family::Embedding, e, None),
    );
}
