//! Helpers shared by the integration tests that run the `packshard` binary.

use std::io::Write;
use std::process::{Command, Output, Stdio};

/// Runs the `packshard` binary built for these tests with `args`, writing
/// `stdin` (when given) to its standard input, and waits for it.
pub fn packshard(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_packshard"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn packshard");
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .expect("piped stdin")
            .write_all(text.as_bytes())
            .expect("write stdin");
    }
    drop(child.stdin.take());
    child.wait_with_output().expect("wait for packshard")
}
