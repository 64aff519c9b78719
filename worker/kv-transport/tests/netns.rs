//! Across nodes: the relay, the pushing side and the pulling side each run in
//! their own network namespace (three "nodes" joined by veth pairs, addresses
//! 10.231.x.x inside those namespaces only), and a full 67.1 MB request moves
//! byte-exact. And `nixl-ucx` with `UCX_TLS=tcp`: prefill and decode in two
//! namespaces joined by a veth pair (the relay beside the prefill side), the
//! decode side READs the slot over UCX byte-exact, and the READ's
//! notification frees it. Needs root and iproute2 (CI has both); without them the test
//! fails with a message saying so. Namespaces are removed at the end, also on
//! failure.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

const PEER: &str = env!("CARGO_BIN_EXE_rngd-kv-peer");

/// Namespaces and processes this test created; removed on drop.
struct Cluster {
    namespaces: Vec<String>,
    children: Vec<Child>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in &self.namespaces {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip` (iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn must(r: Result<(), String>) {
    if let Err(e) = r {
        panic!("{e}");
    }
}

#[test]
fn request_crosses_network_namespaces_byte_exact() {
    let nonce = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
        ^ std::process::id();
    let tag = format!("k{:05x}", nonce & 0xfffff);
    let (nr, np, nd) = (format!("{tag}r"), format!("{tag}p"), format!("{tag}d"));
    let mut cluster = Cluster {
        namespaces: Vec::new(),
        children: Vec::new(),
    };
    for ns in [&nr, &np, &nd] {
        if let Err(e) = ip(&["netns", "add", ns]) {
            panic!(
                "network namespaces are unavailable, so the across-nodes test cannot run \
                 (it needs root and iproute2): {e}"
            );
        }
        cluster.namespaces.push(ns.clone());
        must(ip(&["-n", ns, "link", "set", "lo", "up"]));
    }
    // relay <-> prefill on 10.231.1.0/24, relay <-> decode on 10.231.2.0/24.
    for (peer_ns, side, subnet) in [(&np, "p", 1), (&nd, "d", 2)] {
        let (a, b) = (format!("{tag}r{side}"), format!("{tag}{side}r"));
        must(ip(&["link", "add", &a, "type", "veth", "peer", "name", &b]));
        must(ip(&["link", "set", &a, "netns", &nr]));
        must(ip(&["link", "set", &b, "netns", peer_ns]));
        must(ip(&[
            "-n",
            &nr,
            "addr",
            "add",
            &format!("10.231.{subnet}.1/24"),
            "dev",
            &a,
        ]));
        must(ip(&[
            "-n",
            peer_ns,
            "addr",
            "add",
            &format!("10.231.{subnet}.2/24"),
            "dev",
            &b,
        ]));
        must(ip(&["-n", &nr, "link", "set", &a, "up"]));
        must(ip(&["-n", peer_ns, "link", "set", &b, "up"]));
    }

    let mut relay = Command::new("ip")
        .args(["netns", "exec", &nr, PEER, "relay", "--listen", "0.0.0.0:0"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("starting the relay peer");
    let stdout = relay.stdout.take().expect("relay stdout");
    cluster.children.push(relay);
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("reading the relay's address");
    let port = line
        .trim()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse::<u16>().ok())
        .unwrap_or_else(|| panic!("relay did not report its address, said {line:?}"));

    let push = Command::new("ip")
        .args(["netns", "exec", &np, PEER, "push"])
        .args([
            "--addr",
            &format!("10.231.1.1:{port}"),
            "--id",
            "netns-req",
            "--seed",
            "77",
        ])
        .output()
        .expect("running the push peer");
    assert!(
        push.status.success(),
        "push from namespace {np} failed: {}",
        String::from_utf8_lossy(&push.stderr)
    );
    let handle = String::from_utf8(push.stdout).unwrap();
    assert!(handle.contains("\"transport\":\"tcp\""), "{handle}");

    // The decode namespace has no route to the prefill namespace: the bytes
    // can only have come through the relay.
    let pull = Command::new("ip")
        .args(["netns", "exec", &nd, PEER, "pull"])
        .args(["--addr", &format!("10.231.2.1:{port}"), "--seed", "77"])
        .args(["--handle", handle.trim()])
        .output()
        .expect("running the pull peer");
    assert!(
        pull.status.success(),
        "pull in namespace {nd} failed: {}",
        String::from_utf8_lossy(&pull.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&pull.stdout).trim(), "ok 67108864");
    let unroutable = Command::new("ip")
        .args(["netns", "exec", &nd, "ip", "route", "get", "10.231.1.2"])
        .output()
        .expect("ip route get");
    assert!(
        !unroutable.status.success(),
        "decode namespace unexpectedly routes to the prefill namespace"
    );
    // Closing the relay's stdin stops it cleanly.
    let mut relay = cluster.children.pop().expect("relay child");
    drop(relay.stdin.take());
    let status = relay.wait().expect("relay exit");
    assert!(status.success(), "relay exited with {status}");
}

/// Creates namespace `ns` (lo up), recorded in `cluster` for removal.
fn netns(cluster: &mut Cluster, ns: &str) {
    if let Err(e) = ip(&["netns", "add", ns]) {
        panic!(
            "network namespaces are unavailable, so the across-nodes test cannot run \
             (it needs root and iproute2): {e}"
        );
    }
    cluster.namespaces.push(ns.to_string());
    must(ip(&["-n", ns, "link", "set", "lo", "up"]));
}

fn first_line(child: &mut Child) -> String {
    let stdout = child.stdout.as_mut().expect("piped stdout");
    let mut line = String::new();
    let mut r = BufReader::new(stdout);
    r.read_line(&mut line).expect("reading a line");
    line
}

#[test]
fn nixl_ucx_crosses_network_namespaces_byte_exact() {
    let nonce = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
        ^ std::process::id();
    let tag = format!("n{:05x}", nonce & 0xfffff);
    let (np, nd) = (format!("{tag}p"), format!("{tag}d"));
    let mut cluster = Cluster {
        namespaces: Vec::new(),
        children: Vec::new(),
    };
    netns(&mut cluster, &np);
    netns(&mut cluster, &nd);
    let (a, b) = (format!("{tag}pd"), format!("{tag}dp"));
    must(ip(&["link", "add", &a, "type", "veth", "peer", "name", &b]));
    must(ip(&["link", "set", &a, "netns", &np]));
    must(ip(&["link", "set", &b, "netns", &nd]));
    must(ip(&["-n", &np, "addr", "add", "10.231.3.1/24", "dev", &a]));
    must(ip(&["-n", &nd, "addr", "add", "10.231.3.2/24", "dev", &b]));
    must(ip(&["-n", &np, "link", "set", &a, "up"]));
    must(ip(&["-n", &nd, "link", "set", &b, "up"]));

    let spawn = |ns: &str, args: &[&str]| {
        Command::new("ip")
            .args(["netns", "exec", ns, PEER])
            .args(args)
            .env("UCX_TLS", "tcp")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting a peer")
    };
    let mut relay = spawn(&np, &["relay", "--listen", "0.0.0.0:0"]);
    let line = first_line(&mut relay);
    cluster.children.push(relay);
    let port = line
        .trim()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse::<u16>().ok())
        .unwrap_or_else(|| panic!("relay did not report its address, said {line:?}"));
    let addr = format!("10.231.3.1:{port}");
    let mut push = spawn(
        &np,
        &[
            "push",
            "--transport",
            "nixl-ucx",
            "--addr",
            &addr,
            "--id",
            "netns-nixl",
            "--seed",
            "78",
            "--pool-mb",
            "96",
        ],
    );
    let handle = first_line(&mut push);
    assert!(
        handle.contains("\"transport\":\"nixl-ucx\""),
        "push in {np} printed {handle:?}"
    );
    let pull = Command::new("ip")
        .args([
            "netns",
            "exec",
            &nd,
            PEER,
            "pull",
            "--transport",
            "nixl-ucx",
        ])
        .args(["--addr", &addr, "--seed", "78", "--pool-mb", "96"])
        .args(["--handle", handle.trim()])
        .env("UCX_TLS", "tcp")
        .output()
        .expect("running the pull peer");
    assert!(
        pull.status.success(),
        "nixl-ucx pull in namespace {nd} failed: {}",
        String::from_utf8_lossy(&pull.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&pull.stdout).trim(), "ok 67108864");
    // The READ's notification freed the prefill slot (before its 60 s TTL).
    std::thread::sleep(std::time::Duration::from_millis(500));
    drop(push.stdin.take());
    let out = push.wait_with_output().expect("push exit");
    assert!(out.status.success(), "push exited with {}", out.status);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "slots 0");
}
