//! One NIXL agent with the UCX backend and the transport's arena registered
//! in it: the calls `nixl-ucx` makes (remote metadata, one-sided READ with a
//! notification, notifications received), over the `nixl-sys` bindings.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use nixl_sys::{
    AgentConfig, MemType, MemoryRegion, NixlDescriptor, NixlError, NotificationMap, OptArgs,
    RegistrationHandle, XferDescList, XferOp, XferRequest, XferStatus,
};
use sha2::{Digest, Sha256};

use super::arena::Arena;

/// The arena as NIXL sees it: DRAM at an address, of a size.
#[derive(Debug)]
struct Region {
    addr: usize,
    len: usize,
}

impl MemoryRegion for Region {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Region {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}

/// A NIXL agent (UCX backend) with one registered arena.
pub struct Agent {
    // Field order is drop order: the registration goes before the agent
    // is destroyed, the arena's memory after both.
    reg: Option<RegistrationHandle>,
    agent: nixl_sys::Agent,
    /// The registered arena.
    pub arena: Arc<Arena>,
    /// This agent's name (unique per process and transport).
    pub name: String,
    /// This agent's metadata (UCX worker address, the arena's keys), as
    /// published in every descriptor.
    pub metadata: Vec<u8>,
    /// Remote agents whose metadata is loaded: name → SHA-256 of it.
    remotes: Mutex<HashMap<String, [u8; 32]>>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.name)
            .field("arena", &self.arena)
            .finish_non_exhaustive()
    }
}

/// What went wrong in a NIXL call: which call, and NIXL's error.
#[derive(Debug, thiserror::Error)]
#[error("NIXL {call} failed: {source}")]
pub struct CallError {
    /// The call.
    pub call: &'static str,
    /// NIXL's error.
    #[source]
    pub source: NixlError,
}

fn at(call: &'static str) -> impl FnOnce(NixlError) -> CallError {
    move |source| CallError { call, source }
}

/// Remote agents whose metadata is kept at most (older ones are forgotten).
const MAX_REMOTES: usize = 256;

impl Agent {
    /// Creates the agent `name`, its UCX backend, and registers `arena`.
    /// The runtime must be loaded ([`super::runtime::load`]).
    pub fn new(name: &str, arena: Arc<Arena>) -> Result<Agent, CallError> {
        let cfg = AgentConfig {
            // NIXL's progress thread serves the READs peers make from our
            // arena (UCX over TCP needs the target to make progress), and
            // receives their notifications; it sleeps when there is nothing.
            enable_prog_thread: true,
            pthr_delay_us: 100,
            ..AgentConfig::default()
        };
        let agent = nixl_sys::Agent::new_configured(name, &cfg).map_err(at("createAgent"))?;
        let (_mems, params) = agent
            .get_plugin_params("UCX")
            .map_err(at("getPluginParams(UCX)"))?;
        agent
            .create_backend("UCX", &params)
            .map_err(at("createBackend(UCX)"))?;
        let region = Region {
            addr: arena.base(),
            len: arena.len(),
        };
        let reg = agent
            .register_memory(&region, None)
            .map_err(at("registerMem"))?;
        let metadata = agent.get_local_md().map_err(at("getLocalMD"))?;
        Ok(Agent {
            reg: Some(reg),
            agent,
            arena,
            name: name.to_string(),
            metadata,
            remotes: Mutex::new(HashMap::new()),
        })
    }

    /// The plugins NIXL found (for the doctor).
    pub fn plugins(&self) -> Vec<String> {
        self.agent
            .get_available_plugins()
            .map(|l| {
                l.iter()
                    .filter_map(|s| s.ok())
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The UCX backend's parameters (for the doctor).
    pub fn ucx_params(&self) -> Vec<(String, String)> {
        let Ok((_m, params)) = self.agent.get_plugin_params("UCX") else {
            return Vec::new();
        };
        let Ok(iter) = params.iter() else {
            return Vec::new();
        };
        iter.filter_map(|p| p.ok())
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// Makes sure the metadata of remote agent `name` is loaded (and is
    /// `metadata`: an agent that came back under the same name with other
    /// metadata is loaded anew).
    pub fn ensure_remote(&self, name: &str, metadata: &[u8]) -> Result<(), CallError> {
        let digest: [u8; 32] = Sha256::digest(metadata).into();
        let mut remotes = self.remotes.lock().unwrap_or_else(|p| p.into_inner());
        match remotes.get(name) {
            Some(d) if *d == digest => return Ok(()),
            Some(_) => {
                let _ = self.agent.invalidate_remote_md(name);
                remotes.remove(name);
            }
            None => {}
        }
        if remotes.len() >= MAX_REMOTES
            && let Some(old) = remotes.keys().next().cloned()
        {
            let _ = self.agent.invalidate_remote_md(&old);
            remotes.remove(&old);
        }
        let loaded = self
            .agent
            .load_remote_md(metadata)
            .map_err(at("loadRemoteMD"))?;
        if loaded != name {
            let _ = self.agent.invalidate_remote_md(&loaded);
            return Err(CallError {
                call: "loadRemoteMD (the metadata is another agent's)",
                source: NixlError::InvalidParam,
            });
        }
        remotes.insert(name.to_string(), digest);
        Ok(())
    }

    /// Forgets remote agent `name` (after a failed READ: the next one
    /// loads its metadata and connects anew).
    pub fn forget_remote(&self, name: &str) {
        let mut remotes = self.remotes.lock().unwrap_or_else(|p| p.into_inner());
        if remotes.remove(name).is_some() {
            let _ = self.agent.invalidate_remote_md(name);
        }
    }

    /// Posts a one-sided READ of `len` bytes at `remote_addr` of agent
    /// `remote` into our arena at `local_addr`; `notif` reaches the remote
    /// agent when the READ is complete.
    pub fn post_read(
        &self,
        remote: &str,
        remote_addr: usize,
        local_addr: usize,
        len: usize,
        notif: &[u8],
    ) -> Result<XferRequest, CallError> {
        let mut local = XferDescList::new(MemType::Dram).map_err(at("createXferDlist"))?;
        local.add_desc(local_addr, len, 0);
        let mut far = XferDescList::new(MemType::Dram).map_err(at("createXferDlist"))?;
        far.add_desc(remote_addr, len, 0);
        let mut opt = OptArgs::new().map_err(at("createOptArgs"))?;
        opt.set_has_notification(true).map_err(at("setHasNotif"))?;
        opt.set_notification_message(notif)
            .map_err(at("setNotifMsg"))?;
        let req = self
            .agent
            .create_xfer_req(XferOp::Read, &local, &far, remote, Some(&opt))
            .map_err(at("createXferReq"))?;
        self.agent
            .post_xfer_req(&req, Some(&opt))
            .map_err(at("postXferReq"))?;
        Ok(req)
    }

    /// Whether a posted transfer is done (`Ok(true)`), still running, or failed.
    pub fn done(&self, req: &XferRequest) -> Result<bool, CallError> {
        match self
            .agent
            .get_xfer_status(req)
            .map_err(at("getXferStatus"))?
        {
            XferStatus::Success => Ok(true),
            XferStatus::InProgress => Ok(false),
        }
    }

    /// Notifications received since the last call: (agent, message).
    pub fn notifications(&self, map: &mut NotificationMap) -> Vec<(String, String)> {
        if self.agent.get_notifications(map, None).is_err() {
            return Vec::new();
        }
        match map.take_notifs() {
            Ok(all) => all
                .into_iter()
                .flat_map(|(agent, msgs)| msgs.into_iter().map(move |m| (agent.clone(), m)))
                .collect(),
            Err(_) => Vec::new(),
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // Deregister before the agent goes (explicit, whatever the field order).
        drop(self.reg.take());
    }
}
