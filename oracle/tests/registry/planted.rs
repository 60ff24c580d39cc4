//! A planted failing kernel, to show that a failing kernel fails its own
//! tests alone: `attention_planted_scaled`, `attention_varlen_scalar` with
//! every output scaled by 1 + 1e-2 (a hundred times the f32 judges'
//! tolerance, far inside what a "looks plausible" check would pass).
//!
//! `PACKSHARD_PLANT_FAULT=1 cargo test -p packshard-oracle --test registry`
//! adds it to the attention list of every suite: exactly its own tests fail.
//! The test `harness::a_planted_kernel_fails_its_own_tests_alone` shows the
//! same on every run, on the own-numbers test (cheap).

use libtest_mimic::{Arguments, Trial};
use packshard_equivalence::compare::{Judge, RelativeRule, Tolerance};
use packshard_optimized::ops::ScalarAttention;
use packshard_oracle::registry::{self, Entry, Family, Needs, Precision};
use packshard_reference::attention::{AttentionGrads, AttentionOutput};
use packshard_reference::ops::{AttentionOp, AttentionSupport, Grad, Masked, Qkv, Varlen};
use packshard_reference::Result;

use crate::harness::{Config, Tests};

/// The planted fault's factor on every output.
const FAULT: f64 = 1.0 + 1e-2;

struct Scaled(ScalarAttention);

fn scaled(mut out: AttentionOutput) -> AttentionOutput {
    out.output.mapv_inplace(|x| x * FAULT);
    out
}

impl AttentionOp for Scaled {
    fn support(&self) -> AttentionSupport {
        self.0.support()
    }
    fn varlen_forward(&self, x: Qkv<'_>, p: &Varlen<'_>) -> Result<AttentionOutput> {
        self.0.varlen_forward(x, p).map(scaled)
    }
    fn varlen_backward(&self, x: Qkv<'_>, p: &Varlen<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        self.0.varlen_backward(x, p, g)
    }
    fn masked_forward(&self, x: Qkv<'_>, m: Masked<'_>) -> Result<AttentionOutput> {
        self.0.masked_forward(x, m).map(scaled)
    }
    fn masked_backward(&self, x: Qkv<'_>, m: Masked<'_>, g: Grad<'_>) -> Result<AttentionGrads> {
        self.0.masked_backward(x, m, g)
    }
}

/// The planted entry, judged as `attention_varlen_scalar`.
pub fn entry() -> Entry<dyn AttentionOp> {
    let judge = Judge::Relative {
        rule: RelativeRule::F32,
        inputs: Precision::F32,
        packed: Tolerance::EXACT,
    };
    Entry::new(
        "attention_planted_scaled",
        "attention_varlen_scalar with every output scaled by 1 + 1e-2 (a planted fault)",
        Precision::F32,
        (judge, Judge::Rewrite(Tolerance::F32_REWRITE)),
        Needs::Nothing,
        || Ok(Box::new(Scaled(ScalarAttention))),
    )
}

/// Whether `PACKSHARD_PLANT_FAULT=1` asks for the planted entry in every suite.
pub fn asked() -> bool {
    std::env::var("PACKSHARD_PLANT_FAULT").is_ok_and(|v| v == "1")
}

/// The harness's own test: the own-numbers tests of `attention_varlen_scalar`
/// and the planted kernel, run as a whole run would (in parallel): exactly
/// the planted kernel's test fails.
pub fn add(t: &mut Tests) {
    t.trials.push(Trial::test(
        "harness::a_planted_kernel_fails_its_own_tests_alone",
        || {
            let list = registry::attention();
            let scalar = registry::find(&list, "attention_varlen_scalar")
                .ok_or("attention_varlen_scalar is not registered")?;
            let mut inner = Tests::default();
            inner.each(
                Family::Attention,
                &[scalar.clone(), entry()],
                "own_numbers",
                Config::Registered,
                2,
                crate::own_numbers::attention,
            );
            // The inner run's report goes to a file (read back on failure),
            // not to the outer run's output.
            let log = std::env::temp_dir().join(format!(
                "packshard-registry-planted-{}.log",
                std::process::id()
            ));
            let args = Arguments {
                test_threads: Some(2),
                logfile: Some(log.display().to_string()),
                ..Arguments::default()
            };
            let c = libtest_mimic::run(&args, inner.trials);
            let report = std::fs::read_to_string(&log).unwrap_or_default();
            let _ = std::fs::remove_file(&log);
            // Three tests: the two kernels' and the count; the planted one
            // alone fails.
            let planted_failed = report.lines().any(|l| {
                l.contains("attention::attention_planted_scaled::own_numbers")
                    && l.contains("FAILED")
            });
            if (c.num_passed, c.num_failed) == (2, 1) && planted_failed {
                Ok(())
            } else {
                Err(
                    format!("{c:?}: not exactly the planted kernel's test failed:\n{report}")
                        .into(),
                )
            }
        },
    ));
}
