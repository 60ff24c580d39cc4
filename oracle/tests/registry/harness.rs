//! One test per (implementation, suite) over the registry, under its one
//! availability policy ([`registry::here`]).
//!
//! A test is named `<family>::<implementation>::<suite>`, so that
//! `cargo test -p packshard-oracle attention_varlen_scalar` runs that
//! kernel's suites alone, and a failing kernel fails its own tests only. An
//! entry that cannot run here (a GPU kernel without a device) is listed as
//! ignored and said once on stderr as `<name>: skipped: <why>`; where this run
//! requires it (`PACKSHARD_REQUIRE_GPU=1`, `PACKSHARD_REQUIRE_EMULATOR=1`,
//! or an entry that needs nothing) its tests fail instead.

use std::sync::Arc;

use libtest_mimic::{Failed, Trial};
use packshard_oracle::registry::{Entry, Family, Here};

/// Which configuration of an entry a test runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Config {
    /// As registered ([`Entry::make`]).
    Registered,
    /// Its configuration for small cases ([`Entry::make_small`]); a test of
    /// it is listed only for entries that have a separate one.
    Small,
    /// Its configuration for small cases whether or not it is separate (what
    /// the fuzz targets run).
    SmallAlways,
}

/// The tests of a run, and how many of each (family, suite) can run here.
#[derive(Default)]
pub struct Tests {
    /// Every test, in listing order.
    pub trials: Vec<Trial>,
    said: Vec<&'static str>,
}

impl Tests {
    /// Adds one test per entry of `list` (of `family`) running `body` on the
    /// entry's `config` as `<family>::<entry>::<suite>`, and a test
    /// `<family>::<suite>::at_least_<min>_ran` that fails when fewer than
    /// `min` of them can run here (a suite that runs nothing proves nothing).
    /// `body` returns a one-line report (printed) or the failure.
    pub fn each<K: ?Sized + 'static>(
        &mut self,
        family: Family,
        list: &[Entry<K>],
        suite: &str,
        config: Config,
        min: usize,
        body: impl Fn(&K, &Entry<K>) -> Result<String, String> + Send + Sync + 'static,
    ) {
        let body = Arc::new(body);
        let mut runs = 0;
        for entry in list {
            if config == Config::Small && !entry.has_small() {
                continue;
            }
            let name = format!("{}::{}::{suite}", family.name(), entry.name);
            match make(entry, config) {
                Here::Runs(_) => {
                    runs += 1;
                    let (entry, body) = (entry.clone(), Arc::clone(&body));
                    self.trials.push(Trial::test(name.clone(), move || {
                        let imp = make(&entry, config)
                            .or_fail(entry.name)?
                            .ok_or_else(|| format!("{}: no longer available", entry.name))?;
                        let report = body(&imp, &entry).map_err(|m| format!("{name}: {m}"))?;
                        eprintln!("{name}: {report}");
                        Ok(())
                    }));
                }
                Here::Skipped(why) => {
                    if !self.said.contains(&entry.name) {
                        self.said.push(entry.name);
                        eprintln!("{}: skipped: {why}", entry.name);
                    }
                    // Run anyway (`--ignored`), it says why it cannot.
                    let why = why.to_string();
                    self.trials.push(
                        Trial::test(name, move || Err(format!("cannot run here: {why}").into()))
                            .with_ignored_flag(true),
                    );
                }
                Here::Missing(why) => {
                    let msg = format!("{}: required here but cannot run: {why}", entry.name);
                    self.trials
                        .push(Trial::test(name, move || Err(Failed::from(msg))));
                }
            }
        }
        self.trials.push(Trial::test(
            format!("{}::{suite}::at_least_{min}_ran", family.name()),
            move || {
                if runs >= min {
                    Ok(())
                } else {
                    Err(format!("only {runs} implementations can run here").into())
                }
            },
        ));
    }
}

fn make<K: ?Sized + 'static>(entry: &Entry<K>, config: Config) -> Here<Box<K>> {
    match config {
        Config::Registered => entry.here(),
        Config::Small | Config::SmallAlways => entry.here_small(),
    }
}
