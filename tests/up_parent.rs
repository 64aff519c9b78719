//! A process started by `rngd-pd up` (it carries `RNGD_PD_UP_PARENT`) stops
//! when its parent dies, even when the parent is SIGKILLed, and refuses to
//! start when the parent it names is already gone. Linux only (the kernel's
//! parent-death signal).

#![cfg(target_os = "linux")]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rngd_api::env::RNGD_PD_UP_PARENT;

const EXE: &str = env!("CARGO_BIN_EXE_rngd-pd");

/// Whether `pid` still runs (gone, or a zombie waiting for its reaper, is not running).
fn running(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z')),
        Err(_) => false,
    }
}

#[test]
fn a_child_of_up_stops_when_up_is_killed() {
    // A shell stands in for `up`: it starts a relay that names the shell as
    // its parent, prints the relay's pid, and waits.
    let script = format!(
        "{RNGD_PD_UP_PARENT}=$$ \"$0\" relay --listen 127.0.0.1:0 --insecure-no-auth & echo \"pid $!\"; wait"
    );
    let mut parent = Command::new("sh")
        .args(["-c", &script, EXE])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("starting sh");
    let mut lines = BufReader::new(parent.stdout.take().expect("stdout")).lines();
    let mut relay = None;
    let mut listening = false;
    while !(relay.is_some() && listening) {
        let line = lines
            .next()
            .expect("the relay printed its pid and address")
            .expect("reading the output");
        if let Some(pid) = line.strip_prefix("pid ") {
            relay = Some(pid.trim().parse::<u32>().expect("a pid"));
        }
        listening |= line.starts_with("relay listening on ");
    }
    let relay = relay.expect("pid");
    assert!(running(relay));

    parent.kill().expect("SIGKILL to the parent");
    parent.wait().expect("reaping the parent");
    let deadline = Instant::now() + Duration::from_secs(20);
    while running(relay) {
        assert!(
            Instant::now() < deadline,
            "the relay (pid {relay}) still runs 20 s after its parent was killed"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_child_whose_parent_is_gone_does_not_start() {
    // Pid 1 is never this test's process, the child's real parent.
    let out = Command::new(EXE)
        .args(["relay", "--listen", "127.0.0.1:0"])
        .env(RNGD_PD_UP_PARENT, "1")
        .stdin(Stdio::null())
        .output()
        .expect("running rngd-pd");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is gone; not starting"), "stderr: {err}");
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("listening"),
        "it must not have started serving"
    );
}
