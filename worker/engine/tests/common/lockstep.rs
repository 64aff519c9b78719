//! [`Lockstep`]: an iteration observer that lets a test step the CPU
//! engine's scheduler one iteration at a time and read what each computed.

use std::future::Future;
use std::sync::{Arc, Condvar, Mutex};

use rngd_engine::cpu::CpuEngine;
use rngd_engine::{Engine, IterationObserver};

/// An iteration observer that holds the engine thread after each iteration
/// until the test lets it take one more ([`Lockstep::pump`]), and records
/// each iteration's computed tokens. The engine can then run ahead of the
/// test by one iteration at most, however the test is scheduled: a stream
/// of 300 tokens cannot end while the test waits for the CPU.
#[derive(Default)]
pub struct Lockstep {
    state: Mutex<Steps>,
    turn: Condvar,
}

#[derive(Default)]
struct Steps {
    /// The engine thread waits in [`IterationObserver::iteration`].
    parked: bool,
    /// It may take one more iteration.
    go: bool,
    /// Released: it runs freely.
    free: bool,
    /// Each observed iteration's tokens, in order.
    sizes: Vec<usize>,
}

impl IterationObserver for Lockstep {
    fn iteration(&self, tokens: usize) {
        let mut st = self.state.lock().unwrap();
        st.sizes.push(tokens);
        st.parked = true;
        while !st.go && !st.free {
            st = self.turn.wait(st).unwrap();
        }
        st.go = false;
        st.parked = false;
    }
}

impl Lockstep {
    /// A lockstep observer attached to `engine`, and the guard that releases
    /// it (keep the guard after the engine, so it drops first).
    pub fn attach(engine: &CpuEngine) -> (Arc<Lockstep>, Release) {
        let gate = Arc::new(Lockstep::default());
        assert!(engine.set_iteration_observer(Some(gate.clone())));
        (gate.clone(), Release(gate))
    }

    /// Awaits `fut`, letting the engine take one iteration whenever it is
    /// parked and the test runs.
    pub async fn pump<F: Future>(&self, fut: F) -> F::Output {
        let mut fut = std::pin::pin!(fut);
        loop {
            tokio::select! {
                biased;
                out = &mut fut => return out,
                () = tokio::task::yield_now() => {
                    let mut st = self.state.lock().unwrap();
                    if st.parked && !st.go {
                        st.go = true;
                        self.turn.notify_all();
                    }
                }
            }
        }
    }

    /// Lets the engine run freely from now on.
    pub fn release(&self) {
        self.state.lock().unwrap().free = true;
        self.turn.notify_all();
    }

    pub fn sizes(&self) -> Vec<usize> {
        self.state.lock().unwrap().sizes.clone()
    }
}

/// Releases the engine when dropped: declared after the engine, it drops
/// first, so a failed assertion never leaves the engine's thread parked
/// for the engine's `Drop` to join.
pub struct Release(Arc<Lockstep>);

impl Drop for Release {
    fn drop(&mut self) {
        self.0.release();
    }
}
