//! `rngd-pd`: the one binary (worker, relay, gateway, ext-proc, up, model, policy, bench).

fn main() {}
