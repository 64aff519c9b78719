//! The in-memory fake passes the same conformance suite as the real transports.

use std::sync::Arc;
use std::time::Duration;

use rngd_kv_transport::conformance::{self, Harness};
use rngd_kv_transport::fake::MemoryTransport;
use rngd_kv_transport::{KvError, KvHandle, KvTransport};

struct FakeHarness(Arc<MemoryTransport>);

#[async_trait::async_trait]
impl Harness for FakeHarness {
    fn make(&self) -> Arc<dyn KvTransport> {
        self.0.clone()
    }

    async fn held(&self) -> Result<usize, KvError> {
        Ok(self.0.held())
    }

    async fn corrupt(&self, handle: &KvHandle, index: usize) -> Result<(), KvError> {
        assert!(
            self.0.corrupt(&handle.request_id, index, 0),
            "blob to corrupt"
        );
        Ok(())
    }

    fn ttl(&self) -> Duration {
        Duration::from_millis(300)
    }

    async fn restart(&self) -> Result<bool, KvError> {
        Ok(false)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_transport_passes_the_conformance_suite() {
    let h = FakeHarness(Arc::new(MemoryTransport::with_ttl(Duration::from_millis(
        300,
    ))));
    let report = conformance::run_all(&h)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.passed.len(), 8, "{report:?}");
    assert_eq!(report.not_applicable.len(), 1);
}

#[tokio::test]
async fn injected_push_failures() {
    let fake = MemoryTransport::new();
    fake.fail_pushes(true);
    let err = fake
        .push(conformance::payload("x", 1, 1, 1))
        .await
        .unwrap_err();
    assert!(matches!(err, KvError::Capacity { .. }), "{err}");
    fake.fail_pushes(false);
    let h = fake.push(conformance::payload("x", 1, 1, 1)).await.unwrap();
    assert_eq!(fake.held(), 1);
    fake.release(&h).await.unwrap();
    assert_eq!(fake.held(), 0);
}
