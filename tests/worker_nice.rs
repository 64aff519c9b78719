//! `rngd-pd worker --nice N` runs every thread of the worker at niceness N
//! (what `rngd-pd up` gives its prefill workers), and without it the
//! worker keeps its parent's. Linux only (the threads listed in `/proc`).

#![cfg(target_os = "linux")]

mod common;

use common::Proc;

/// The niceness of every thread of `pid`: `getpriority` with a thread id
/// reads that thread's own (Linux keeps niceness per thread).
fn thread_niceness(pid: u32) -> Vec<i32> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("the worker's tasks") {
        let tid = task
            .expect("a task")
            .file_name()
            .to_str()
            .and_then(|t| t.parse().ok())
            .and_then(rustix::process::Pid::from_raw)
            .expect("a thread id");
        out.push(rustix::process::getpriority_process(Some(tid)).expect("a thread's niceness"));
    }
    out
}

#[test]
fn every_thread_of_a_worker_runs_at_its_nice() {
    let dir = tempfile::tempdir().unwrap();
    let envs = [("RNGD_PD_MODEL", common::model().display().to_string())];
    let base = rustix::process::getpriority_process(None).expect("this test's niceness");
    let want = (base + 7).min(19);
    let nice = want.to_string();
    let w = Proc::start(
        "niced",
        dir.path(),
        &["worker", "--role", "solo", "--port", "0", "--nice", &nice],
        &envs,
        "rngd-pd worker listening on http://",
    );
    // Ready (the model loaded, the engine and the runtime running): many
    // threads, every one of them at `want`.
    let niced = thread_niceness(w.child.id());
    assert!(niced.len() > 2, "threads: {niced:?}");
    assert!(niced.iter().all(|&n| n == want), "want {want}: {niced:?}");
    assert!(
        w.log_text().contains("CPU priority lowered"),
        "{}",
        w.log_text()
    );
    drop(w);

    // Without --nice: the parent's niceness, untouched.
    let w = Proc::worker("plain", dir.path(), "solo", &envs);
    let plain = thread_niceness(w.child.id());
    assert!(plain.iter().all(|&n| n == base), "want {base}: {plain:?}");
}

#[test]
fn a_nice_outside_0_to_19_is_refused() {
    for bad in ["20", "-1"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_rngd-pd"))
            .args(["worker", &format!("--nice={bad}")])
            .output()
            .expect("running the worker");
        assert!(!out.status.success(), "--nice {bad} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--nice"), "{err}");
    }
}
