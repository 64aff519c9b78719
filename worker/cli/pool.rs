//! The pool-discovery flags `ext-proc` and `gateway` share (`--pool-name`,
//! `--pool-namespace`, `--kubeconfig`), as the reference endpoint picker
//! names them, and their [`KubeOptions`].

use std::path::PathBuf;
use std::time::Duration;

use rngd_pool::discovery::{DEFAULT_STALE_AFTER, KubeOptions};

/// Flags of InferencePool discovery.
#[derive(Debug, Clone, clap::Args)]
pub struct PoolArgs {
    /// Name of the InferencePool (`inference.networking.k8s.io/v1`) whose
    /// ready pods are the endpoints, watched through the Kubernetes API
    /// (instead of an endpoints file).
    #[arg(long)]
    pub pool_name: Option<String>,
    /// Namespace of the InferencePool and its pods.
    #[arg(long, default_value = "default")]
    pub pool_namespace: String,
    /// kubeconfig file for use outside a cluster; unset = `$KUBECONFIG` or
    /// `~/.kube/config` if present, else the pod's service account.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// A watch that keeps failing marks the endpoint list stale after this
    /// (the last good list is still served), ms.
    #[arg(long, default_value_t = DEFAULT_STALE_AFTER.as_millis() as u64)]
    pub pool_stale_after_ms: u64,
}

impl PoolArgs {
    /// The discovery options, when `--pool-name` is given.
    pub fn options(&self) -> Option<KubeOptions> {
        let name = self.pool_name.as_ref()?;
        let mut o = KubeOptions::new(name.clone(), self.pool_namespace.clone());
        o.kubeconfig = self.kubeconfig.clone();
        o.stale_after = Duration::from_millis(self.pool_stale_after_ms.max(1));
        Some(o)
    }
}
