//! Standard output of the binary, with its write errors mapped: the one
//! place the CLI prints (the `print!` / `println!` of `main.rs` call
//! [`write`]).
//!
//! - a closed pipe (`EPIPE`, e.g. `packshard bench --quick | head -c10`):
//!   the reader wanted no more; the process ends at once with status 0 and
//!   prints nothing more, as `cat`, `seq` and the coreutils do when `head`
//!   has what it wanted;
//! - any other error (`> /dev/full`: `ENOSPC`, `EIO`): one line on standard
//!   error naming standard output and the error, status [`WRITE_FAILED`].
//!
//! Standard output stays line-buffered (progress lines of `bench` appear
//! as they are printed); [`flush`] writes what is left when a command ends,
//! so a full disk is seen even when the last line had no newline.

use std::io::Write;

/// Exit status after a write error other than a closed pipe (sysexits'
/// `EX_IOERR`: distinct from 1, a failed check, and 2, bad input).
pub const WRITE_FAILED: i32 = 74;

/// Ends the process as the module docs say for write error `e`.
fn fail(e: &std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    eprintln!("packshard: standard output: {e}");
    std::process::exit(WRITE_FAILED);
}

/// Writes `args` to standard output; on an error ends the process as the
/// module docs say.
pub fn write(args: std::fmt::Arguments<'_>) {
    if let Err(e) = std::io::stdout().lock().write_fmt(args) {
        fail(&e);
    }
}

/// Writes everything buffered; on an error ends the process as the module
/// docs say.
pub fn flush() {
    if let Err(e) = std::io::stdout().lock().flush() {
        fail(&e);
    }
}
