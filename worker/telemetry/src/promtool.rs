//! TEST HELPER: `promtool check metrics` (Debian's `prometheus` package,
//! installed by `tests/setup.sh`) on a metrics page, for the servers' tests.

use std::io::Write;
use std::process::{Command, Stdio};

/// What promtool said of a page.
#[derive(Debug)]
pub struct Report {
    /// Its exit code (0 clean, 3 lint findings only, other: unparsable).
    pub code: Option<i32>,
    /// Its findings, one per line.
    pub findings: Vec<String>,
}

impl Report {
    /// Whether the page parsed and every finding satisfies `allowed`.
    pub fn clean_but(&self, allowed: impl Fn(&str) -> bool) -> bool {
        matches!(self.code, Some(0) | Some(3)) && self.findings.iter().all(|l| allowed(l))
    }
}

/// Runs `promtool check metrics` on `text`.
///
/// # Panics
/// When promtool is not installed (the tests need it; `tests/setup.sh`
/// installs it).
pub fn check(text: &str) -> Report {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool not found: install Debian's `prometheus` package (tests/setup.sh does)");
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(text.as_bytes()).expect("promtool stdin");
    }
    let out = child.wait_with_output().expect("promtool output");
    let findings = String::from_utf8_lossy(&out.stdout)
        .lines()
        .chain(String::from_utf8_lossy(&out.stderr).lines())
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();
    Report {
        code: out.status.code(),
        findings,
    }
}
